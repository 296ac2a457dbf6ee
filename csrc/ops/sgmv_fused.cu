// Dispatch of the one-launch (cluster) apply kernel over the 16-bit dtypes (ops/dtypes.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "ops/dtypes.h"
#include "ops/sgmv_run.h"

namespace lora_kernels {

bool run_fused(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, at::Tensor& out,
               const ShrinkArgs& sp, const ExpandArgs& ep, bool pdl) {
  if (at::cuda::getCurrentDeviceProperties()->major < 9) return false;
  bool launched = false;
  dispatch_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    if constexpr (sizeof(T) == 2) {
      if (!has_sm90_code<sgmv_fused_cluster_kernel<T>>()) return;  // a compute_80 PTX build: an empty body
      // One CTA per SM at most: the next kernel's CTAs then find room beside this one's (see kFusedBaseBytes).
      const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
      const int clusters = std::min(fused_cluster_count<T>(), sms / kFusedCluster);
      if (clusters <= 0) return;
      C10_CUDA_CHECK((launch_fused_cluster<T>(
          static_cast<const T*>(x.data_ptr()), static_cast<const T*>(lora_a.data_ptr()),
          static_cast<const T*>(lora_b.data_ptr()), static_cast<T*>(out.data_ptr()), sp, ep,
          at::cuda::getCurrentCUDAStream(), clusters, pdl)));
      launched = true;
    }
  });
  return launched;
}

}  // namespace lora_kernels
