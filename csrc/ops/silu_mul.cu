// silu_mul: the gated MLP's activation, silu(gate) * up from the stacked [..., 2I] output, in one launch.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <vector>

#include "kernels/silu_mul.cuh"
#include "ops/checks.h"
#include "ops/dtypes.h"
#include "ops/ops.h"

namespace lora_kernels {

at::Tensor silu_mul(const at::Tensor& gu) {
  CHECK_INPUT(gu);
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "gu must be [..., 2 * inter] (gate | up), got shape ",
              gu.sizes());
  const int64_t inter = gu.size(-1) / 2;
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  shape.back() = inter;
  TORCH_CHECK(dispatch_dtype(gu.scalar_type(), [](auto) {}),  // the one dtype list (ops/dtypes.h)
              "gu must have dtype float32, float16 or bfloat16, got ", gu.scalar_type());
  at::Tensor out = at::empty(shape, gu.options());
  const int64_t rows = inter ? out.numel() / inter : 0;
  if (out.numel() == 0) return out;
  const at::cuda::OptionalCUDAGuard guard(gu.device());
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks =
      static_cast<int>(std::min<int64_t>((out.numel() + kSiluMulThreads - 1) / kSiluMulThreads, sms * 8));
  dispatch_dtype(gu.scalar_type(), [&](auto t) {
    using T = decltype(t);
    silu_mul_kernel<T><<<blocks, kSiluMulThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        static_cast<const T*>(gu.data_ptr()), static_cast<T*>(out.data_ptr()), rows, inter);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace lora_kernels
