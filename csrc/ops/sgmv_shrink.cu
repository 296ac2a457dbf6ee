// Dispatch of the shrink and split-reduction launchers over the dtype list (ops/dtypes.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <type_traits>

#include "ops/dtypes.h"
#include "ops/sgmv_run.h"

namespace lora_kernels {

namespace {

// The warpgroup-MMA shrink (stages by its items and the SMs: sgmv_plan.h), where this build has its sm_90a code and
// the device runs it; false, having launched nothing, otherwise.
template <typename T, typename V>
bool launch_wgmma(const T* x, const T* a, V* v, const ShrinkArgs& p, const LaunchCfg& cfg) {
  const int64_t items = cdiv(p.w.max_tiles, kWgTiles) * p.n_tiles;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount, stages = shrink_wgmma_stages(items, sms);
  const auto launch = [&](auto st) {
    constexpr int ST = decltype(st)::value;
    if (!has_sm90_code<sgmv_shrink_wgmma_kernel<T, V, ST>>()) return false;
    C10_CUDA_CHECK((launch_shrink_wgmma<T, V, ST>(x, a, v, p, cfg, items, sms)));
    return true;
  };
  if (stages == 8) return launch(std::integral_constant<int, 8>{});
  if (stages == 6) return launch(std::integral_constant<int, 6>{});
  return launch(std::integral_constant<int, 4>{});
}

}  // namespace

void run_shrink(const at::Tensor& x, const at::Tensor& lora_a, void* v, at::ScalarType v_dtype, float* ws,
                const ShrinkArgs& p, const ShrinkPlan& plan, const LaunchCfg& cfg) {
  const bool ok = dispatch_dtype_v(x.scalar_type(), v_dtype, [&](auto t, auto vt) {
    using T = decltype(t);
    using V = decltype(vt);
    const auto* xp = static_cast<const T*>(x.data_ptr());
    const auto* ap = static_cast<const T*>(lora_a.data_ptr());
    auto* vp = static_cast<V*>(v);
    if constexpr (sizeof(T) == 2) {
      // The warpgroup-MMA kernel writes v (no planes: at prefill the splits are folded or there is one).
      if (plan.mma && plan.wgmma && ws == nullptr && launch_wgmma<T, V>(xp, ap, vp, p, cfg)) return;
      if (plan.mma) {
        C10_CUDA_CHECK((launch_shrink_mma<T, V>(xp, ap, vp, ws, p, cfg, plan.warps, plan.stages, plan.tiles,
                                                   plan.fold)));
        return;
      }
    }
    TORCH_CHECK(!plan.mma && plan.splits == 1, "sgmv_shrink: plan of a 16-bit kernel for ", x.scalar_type());
    C10_CUDA_CHECK((launch_shrink_simt<T, V>(xp, ap, vp, p, plan.vec16, cfg)));
  });
  TORCH_CHECK(ok, "sgmv_shrink: no kernel for dtype=", x.scalar_type(), " v dtype=", v_dtype, " max_rank=", p.R,
              " num_slices=", p.N / std::max(p.R, 1), " in_dim=", p.K,
              " (supported: fp16/bf16/fp32 with v fp32 or the same dtype, R<=", kMaxRank, ", 1..", kMaxSlices,
              " slices)");
}

void run_split_reduce(const float* ws, void* v, at::ScalarType v_dtype, const ShrinkArgs& p, const LaunchCfg& cfg) {
  const bool ok = dispatch_dtype(v_dtype, [&](auto vt) {
    using V = decltype(vt);
    C10_CUDA_CHECK((launch_split_reduce<V>(ws, static_cast<V*>(v), p, cfg)));
  });
  TORCH_CHECK(ok, "sgmv_shrink: no split reduction into v dtype=", v_dtype);
}

}  // namespace lora_kernels
