// batched_h2d_copy: many pinned-host -> device copies issued in one call on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <vector>

#include "ops/ops.h"

namespace lora_kernels {

void batched_h2d_copy(at::TensorList srcs, at::TensorList dsts) {
  TORCH_CHECK(srcs.size() == dsts.size(), "srcs has ", srcs.size(), " tensors but dsts has ", dsts.size());
  if (srcs.empty()) return;
  const auto device = dsts[0].device();
  TORCH_CHECK(device.is_cuda(), "dsts[0] must be a CUDA tensor, got ", device);
  std::vector<void*> dst_ptrs(srcs.size());
  std::vector<const void*> src_ptrs(srcs.size());
  std::vector<size_t> sizes(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& s = srcs[i];
    const at::Tensor& d = dsts[i];
    TORCH_CHECK(s.device().is_cpu() && s.is_pinned(), "srcs[", i, "] must be pinned host memory, got ",
                s.device(), s.is_pinned() ? "" : " (not pinned)");
    TORCH_CHECK(d.device() == device, "dsts[", i, "] is on ", d.device(), " but dsts[0] is on ", device);
    TORCH_CHECK(s.is_contiguous() && d.is_contiguous(), "srcs[", i, "] and dsts[", i, "] must be contiguous");
    const size_t bytes = s.numel() * s.element_size();
    TORCH_CHECK(bytes == d.numel() * d.element_size(), "srcs[", i, "] has ", bytes, " bytes but dsts[", i,
                "] has ", d.numel() * d.element_size());
    src_ptrs[i] = s.data_ptr();
    dst_ptrs[i] = d.data_ptr();
    sizes[i] = bytes;
  }
  const at::cuda::OptionalCUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Empty tensors have no copy to issue (and the batch API rejects size 0).
  size_t n = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) continue;
    dst_ptrs[n] = dst_ptrs[i];
    src_ptrs[n] = src_ptrs[i];
    sizes[n++] = sizes[i];
  }
  if (n == 0) return;
#if CUDART_VERSION >= 13000
  // The batch API rejects the legacy NULL stream (torch's default stream) and cannot be captured
  // into a CUDA graph; those cases take the cudaMemcpyAsync loop below.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (stream != nullptr && stream != cudaStreamLegacy && capture == cudaStreamCaptureStatusNone) {
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.srcLocHint.type = cudaMemLocationTypeHost;
    attr.dstLocHint.type = cudaMemLocationTypeDevice;
    attr.dstLocHint.id = device.index();
    size_t attr_idx = 0;
    C10_CUDA_CHECK(cudaMemcpyBatchAsync(dst_ptrs.data(), src_ptrs.data(), sizes.data(), n, &attr, &attr_idx, 1,
                                        stream));
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i) {
    C10_CUDA_CHECK(cudaMemcpyAsync(dst_ptrs[i], src_ptrs[i], sizes[i], cudaMemcpyHostToDevice, stream));
  }
}

}  // namespace lora_kernels
