// Dispatch of the expand launchers over the dtype list (ops/dtypes.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "ops/dtypes.h"
#include "ops/sgmv_run.h"

namespace lora_kernels {

void run_expand(const void* v, at::ScalarType v_dtype, const at::Tensor& lora_b, at::Tensor& out,
                const ExpandArgs& p, const ExpandPlan& plan, const LaunchCfg& cfg) {
  const bool ok = dispatch_dtype_v(out.scalar_type(), v_dtype, [&](auto t, auto vt) {
    using T = decltype(t);
    using V = decltype(vt);
    const auto* vp = static_cast<const V*>(v);
    const auto* bp = static_cast<const T*>(lora_b.data_ptr());
    auto* op = static_cast<T*>(out.data_ptr());
    if constexpr (sizeof(T) == 2) {
      switch (plan.kernel) {
        case ExpandKernel::flat:
          TORCH_CHECK(p.splits == 1, "sgmv_expand: the flat expand reads one plane of v, got ", p.splits);
          C10_CUDA_CHECK((launch_expand_flat<T, V>(vp, bp, op, p, cfg)));
          return;
        case ExpandKernel::regs:
          TORCH_CHECK(p.splits == 1, "sgmv_expand: the register expand reads one plane of v, got ", p.splits);
          if constexpr (std::is_same_v<T, V>) {  // v of T on sm_90a: the warpgroup-MMA form, the same bits
            if (has_sm90_code<sgmv_expand_wgmma_kernel<T>>()) {
              const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
              C10_CUDA_CHECK(launch_expand_wgmma<T>(vp, bp, op, p, cfg, sms));
              return;
            }
          }
          C10_CUDA_CHECK((launch_expand_regs<T, V>(vp, bp, op, p, cfg)));
          return;
        case ExpandKernel::tall:
          C10_CUDA_CHECK((launch_expand_tall<T, V>(vp, bp, op, p, cfg)));
          return;
        case ExpandKernel::stream:
          C10_CUDA_CHECK((launch_expand_stream<T, V>(vp, bp, op, p, cfg)));
          return;
        case ExpandKernel::mma:
          C10_CUDA_CHECK((launch_expand_mma<T, V>(vp, bp, op, p, cfg, plan.one_row)));
          return;
        case ExpandKernel::simt:
          break;
      }
    }
    TORCH_CHECK(plan.kernel == ExpandKernel::simt, "sgmv_expand: plan of a 16-bit kernel for ", out.scalar_type());
    C10_CUDA_CHECK((launch_expand_simt<T, V>(vp, bp, op, p, cfg)));
  });
  TORCH_CHECK(ok, "sgmv_expand: no kernel for dtype=", out.scalar_type(), " v dtype=", v_dtype, " max_rank=", p.R,
              " num_slices=", p.num_slices, " out_total=", p.out_total,
              " (supported: fp16/bf16/fp32 with v fp32 or the same dtype, R<=", kMaxRank, ", 1..", kMaxSlices,
              " slices)");
}

}  // namespace lora_kernels
