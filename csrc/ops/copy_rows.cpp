// copy_rows: dst.copy_(src) for tensors of contiguous rows, issued to the copy engine.
//
// The loader's scatter of a rank-r B block into a slot of rank R is a copy of `out` rows of r elements into
// rows of R. torch's copy_ runs that as an elementwise kernel, which must wait for SM room behind the
// compute stream's kernels (a persistent GEMM keeps every SM until it ends). cudaMemcpy2DAsync moves the
// same rows on a DMA engine: the load finishes when its bytes do, whatever the SMs run.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "ops/ops.h"

namespace lora_kernels {

void copy_rows(const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.dim() == dst.dim() && (dst.dim() == 2 || dst.dim() == 3),
              "copy_rows: src and dst must both be 2-D or 3-D, got src shape ", src.sizes(), " and dst shape ",
              dst.sizes());
  TORCH_CHECK(src.sizes() == dst.sizes(), "copy_rows: src shape ", src.sizes(), " differs from dst shape ",
              dst.sizes());
  TORCH_CHECK(src.scalar_type() == dst.scalar_type(), "copy_rows: src dtype ", src.scalar_type(),
              " differs from dst dtype ", dst.scalar_type());
  TORCH_CHECK(dst.is_cuda(), "copy_rows: dst must be a CUDA tensor, got ", dst.device());
  TORCH_CHECK((src.is_cuda() && src.device() == dst.device()) || (src.is_cpu() && src.is_pinned()),
              "copy_rows: src must be on dst's device (", dst.device(), ") or in pinned host memory, got ",
              src.device(), src.is_cpu() && !src.is_pinned() ? " (not pinned)" : "");
  const int64_t d = dst.dim();
  const int64_t rows = dst.size(d - 2), width = dst.size(d - 1), outer = d == 3 ? dst.size(0) : 1;
  if (rows == 0 || width == 0 || outer == 0) return;
  for (const at::Tensor* t : {&src, &dst}) {
    TORCH_CHECK(t->stride(d - 1) == 1 || width == 1, "copy_rows: rows must be contiguous, got strides ",
                t->strides(), " for shape ", t->sizes());
    TORCH_CHECK(rows == 1 || t->stride(d - 2) >= width, "copy_rows: rows must not overlap, got strides ",
                t->strides(), " for shape ", t->sizes());
  }
  const size_t es = dst.element_size();
  const size_t wbytes = width * es;
  const size_t spitch = (rows == 1 ? width : src.stride(d - 2)) * es;
  const size_t dpitch = (rows == 1 ? width : dst.stride(d - 2)) * es;
  const at::cuda::OptionalCUDAGuard guard(dst.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto kind = src.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
  const char* s = static_cast<const char*>(src.data_ptr());
  char* p = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < outer; ++i) {
    const size_t so = d == 3 ? src.stride(0) * es * i : 0, dof = d == 3 ? dst.stride(0) * es * i : 0;
    C10_CUDA_CHECK(cudaMemcpy2DAsync(p + dof, dpitch, s + so, spitch, wbytes, rows, kind, stream));
  }
}

}  // namespace lora_kernels
