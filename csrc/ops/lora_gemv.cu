// The decode-sized LoRA linear in one launch (kernels/lora_gemv.cuh): argument checks, the plan of its shrink's K
// ranges, the grid of co-resident CTAs, and the launch on the current stream. The batch is the builder's work list.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <type_traits>

#include "ops/checks.h"
#include "ops/dtypes.h"
#include "ops/ops.h"
#include "ops/sgmv_run.h"

namespace lora_kernels {
namespace {

// K ranges of the shrink: the most, up to a bound, that cut K into whole kGemvKAlign blocks. The bound is
// kGemvMaxSplits, or 4 where a row has two or more 16-column blocks of v at pool ranks up to 32 (qkv and gate_up at
// r16: half as many shrink items, each one load batch at K = 4096; H100, 16 rows r16, with the qkv dealing of the
// kernel: layer 188.5 -> 185.8 µs, 12 rows r32 196.1 -> 191.3; not at r64, where one row measured slower). Shapes
// alone decide (in_dim, columns of v, pool rank), so a row's bits never depend on its batch.
int gemv_shrink_splits(int64_t K, int64_t N, int64_t R) {
  const int64_t blocks = K / kGemvKAlign;
  for (int s = N >= 2 * kGemvCols && R <= 32 ? 4 : kGemvMaxSplits; s > 1; --s)
    if (blocks % s == 0) return s;
  return 1;
}

// What lora_gemv needs beyond sgmv_apply's checks (check_apply_args): its dtypes, rows, in_dim, rank and alignment,
// and the base layer's weight and bias.
void check_gemv_shapes(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& out) {
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "lora_gemv: x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(0) <= kGemvRows, "lora_gemv: x must have at most ", kGemvRows, " rows, got shape ", x.sizes());
  TORCH_CHECK(x.size(1) % kGemvKAlign == 0, "lora_gemv: in_dim must be a multiple of ", kGemvKAlign, ", got x shape ",
              x.sizes());
  CHECK_INPUT(weight);
  CHECK_DIM(2, weight);  // [out_total, in_dim]
  CHECK_SAME_DEVICE(weight, x);
  CHECK_DTYPE(weight, x.scalar_type());
  TORCH_CHECK(weight.size(1) == x.size(1) && weight.size(0) == out.size(1), "lora_gemv: weight must have shape [",
              out.size(1), ", ", x.size(1), "] (out's columns, x's in_dim), got ", weight.sizes());
  if (bias) {
    CHECK_INPUT(*bias);
    CHECK_DIM(1, *bias);
    CHECK_SAME_DEVICE(*bias, x);
    CHECK_DTYPE(*bias, x.scalar_type());
    TORCH_CHECK(bias->size(0) == weight.size(0), "lora_gemv: bias must have shape [", weight.size(0), "], got ",
                bias->sizes());
  }
  const int64_t R = lora_b.size(2);
  TORCH_CHECK(R % 8 == 0 && R <= kGemvMaxR, "lora_gemv: the pool rank R=lora_b.shape[2] must be a multiple of 8 up to ",
              kGemvMaxR, ", got lora_b shape ", lora_b.sizes());
  for (const at::Tensor* t : {&x, &weight, &lora_a, &lora_b})
    TORCH_CHECK(aligned16(t->data_ptr()), "lora_gemv: tensors must start 16-byte aligned (shape ", t->sizes(), ")");
}

GemvArgs make_gemv_args(const at::Tensor& x, const at::Tensor& lora_b, const at::Tensor& work,
                        const at::Tensor& lora_ranks, const at::Tensor& scalings,
                        const std::optional<at::Tensor>& perm, at::IntArrayRef offs, int64_t max_tiles,
                        int* sync) {
  GemvArgs p{};
  p.w = make_work(work, lora_ranks, perm, max_tiles, x.size(0));
  p.scalings = scalings.data_ptr<float>();
  p.K = static_cast<int>(x.size(1));
  p.out_total = static_cast<int>(lora_b.size(1));
  p.R = static_cast<int>(lora_b.size(2));
  p.num_slices = static_cast<int>(offs.size()) - 1;
  p.N = p.num_slices * p.R;
  p.v_items = static_cast<int>(cdiv(p.N, kGemvCols));
  p.splits = gemv_shrink_splits(x.size(1), p.N, p.R);
  for (int i = 0; i <= kMaxSlices; ++i) p.offsets[i] = static_cast<int>(offs[std::min(i, p.num_slices)]);
  p.items = static_cast<int>(cdiv(p.out_total, kGemvCols));
  p.sync = sync;
  return p;
}

}  // namespace

void lora_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
               const at::Tensor& lora_ranks, const at::Tensor& scalings, const std::optional<at::Tensor>& permutation,
               at::IntArrayRef slice_offsets, int64_t max_tiles, at::Tensor& sync, int64_t sync_slot,
               at::Tensor& out) {
  check_apply_args(x, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out);
  check_gemv_shapes(x, weight, bias, lora_a, lora_b, out);
  CHECK_INPUT(sync);
  CHECK_DIM(1, sync);
  CHECK_SAME_DEVICE(sync, x);
  CHECK_DTYPE(sync, at::kInt);
  TORCH_CHECK(sync_slot >= 0 && 2 * (sync_slot + 1) <= sync.numel(), "lora_gemv: sync_slot ", sync_slot,
              " is outside sync (", sync.numel(), " words, 2 a slot)");
  if (x.size(0) == 0 || out.size(1) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(x.device());
  TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 8, "lora_gemv: needs compute capability 8.0 or newer");
  const GemvArgs p = make_gemv_args(x, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles,
                                    sync.data_ptr<int32_t>() + 2 * sync_slot);
  at::Tensor v = at::empty({p.splits, x.size(0), p.N}, x.options().dtype(at::kFloat));
  run_lora_gemv(x, weight, bias, lora_a, lora_b, v.data_ptr<float>(), out, p);
}

void run_lora_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   const at::Tensor& lora_a, const at::Tensor& lora_b, float* v, at::Tensor& out,
                   const GemvArgs& p) {
  dispatch_dtype(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    if constexpr (sizeof(T) == 2) {
      const auto* props = at::cuda::getCurrentDeviceProperties();
      const auto launch = [&](auto hi, auto xs) {
        constexpr bool HI = decltype(hi)::value, XS = decltype(xs)::value;
        const int smem = static_cast<int>(gemv_smem_bytes<T, XS>(p.K));
        const int per_sm = gemv_ctas_per_sm<T, HI, XS>(smem, static_cast<int>(props->sharedMemPerBlockOptin));
        if (XS && per_sm == 0) return false;  // x does not fit shared memory: the path without XS
        TORCH_CHECK(per_sm > 0, "lora_gemv: the kernel does not fit an SM on this device");
        // Every CTA resident at once (the in-kernel count needs it): the grid never exceeds the occupancy. A grid
        // of that size also has CTAs for the shrink items beyond the W items.
        const LaunchCfg cfg{at::cuda::getCurrentCUDAStream(), per_sm * props->multiProcessorCount, pdl_enabled()};
        C10_CUDA_CHECK((launch_lora_gemv<T, HI, XS>(
            static_cast<const T*>(x.data_ptr()), static_cast<const T*>(weight.data_ptr()),
            bias ? static_cast<const T*>(bias->data_ptr()) : nullptr, static_cast<const T*>(lora_a.data_ptr()),
            static_cast<const T*>(lora_b.data_ptr()), v, static_cast<T*>(out.data_ptr()), p, cfg, smem)));
        return true;
      };
      // x in shared memory (XS) past 8 rows, at pool ranks up to kGemvXsMaxR, where it fits. H100, 16 rows: r16
      // layer 197.7 -> 193.9 µs (gate_up 97.1 -> 94.1); r64 gate_up 131.5 -> 137.2, slower. Same bits either way.
      if (p.w.num_rows <= 8)
        launch(std::false_type{}, std::false_type{});
      else if (!(p.R <= kGemvXsMaxR && launch(std::true_type{}, std::true_type{})))
        launch(std::true_type{}, std::false_type{});
    }
  });
}

}  // namespace lora_kernels
