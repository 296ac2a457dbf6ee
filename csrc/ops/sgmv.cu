// Bindings of the SGMV ops: tensor checks, the dispatch table, launch on the current stream.
//
// Dispatch table (anything else fails with every parameter named):
//   dtype x:     fp16, bf16, fp32          v dtype: fp32 or x's dtype
//   max rank R:  1..256                    slices:  1..4
//   kernel path: segments of <= kSmallMaxRows rows (decode)  -> CUDA-core kernels, 16-byte loads when
//                                                               rows are 16-byte aligned, else scalar
//                longer segments, fp16/bf16, in_dim % 8 == 0, R % 8 == 0, slice offsets % 8 == 0,
//                16-byte aligned pointers                    -> tensor-core (mma.sync) kernels
//                anything else                               -> CUDA-core kernels
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <cstring>

#include "ops/checks.h"
#include "ops/ops.h"
#include "ops/sgmv_launch.h"

namespace lora_kernels {
namespace {

constexpr int64_t kMaxRank = 256;

void check_metadata(const at::Tensor& ref, const at::Tensor& seg_indptr, const at::Tensor& weight_indices,
                    const at::Tensor& lora_ranks, const std::optional<at::Tensor>& permutation) {
  for (const at::Tensor* t : {&seg_indptr, &weight_indices, &lora_ranks}) {
    TORCH_CHECK(t->is_cuda() && t->device() == ref.device(), "batch metadata must be on ", ref.device(),
                ", got ", t->device());
    TORCH_CHECK(t->scalar_type() == at::kInt, "batch metadata must be int32, got ", t->scalar_type());
    TORCH_CHECK(t->dim() == 1 && t->is_contiguous(), "batch metadata must be 1-D contiguous, got shape ",
                t->sizes());
  }
  TORCH_CHECK(seg_indptr.numel() == weight_indices.numel() + 1, "seg_indptr must have num_segments+1=",
              weight_indices.numel() + 1, " entries, got ", seg_indptr.numel());
  if (permutation) {
    CHECK_INPUT(*permutation);
    CHECK_SAME_DEVICE(*permutation, ref);
    CHECK_DTYPE(*permutation, at::kInt);
  }
}

SgmvParams make_params(const at::Tensor& seg_indptr, const at::Tensor& weight_indices,
                       const at::Tensor& lora_ranks, const std::optional<at::Tensor>& permutation,
                       int num_slices, int max_rank) {
  SgmvParams p{};
  p.seg_indptr = seg_indptr.data_ptr<int32_t>();
  p.weight_indices = weight_indices.data_ptr<int32_t>();
  p.lora_ranks = lora_ranks.data_ptr<int32_t>();
  p.permutation = permutation ? permutation->data_ptr<int32_t>() : nullptr;
  p.num_segments = static_cast<int>(weight_indices.numel());
  p.num_slots = static_cast<int>(lora_ranks.numel());
  p.num_slices = num_slices;
  p.max_rank = max_rank;
  p.splits = 1;  // v itself; the shrink plan may split K into fp32 planes
  return p;
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// Programmatic dependent launch of the expand kernel inside sgmv_apply; LORA_KERNELS_PDL=0 turns it off.
bool pdl_enabled() {
  static const bool on = [] {
    const char* env = std::getenv("LORA_KERNELS_PDL");
    return !(env && std::strcmp(env, "0") == 0);
  }();
  return on;
}

LaunchCtx make_ctx(int64_t rows, int64_t max_seg_len, bool pdl) {
  return LaunchCtx{at::cuda::getCurrentCUDAStream(), at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                   rows, max_seg_len, pdl};
}

// Calls f(T{}, V{}) with the CUDA storage types of (x dtype, v dtype); false if unsupported.
template <typename F>
bool dispatch(at::ScalarType t, at::ScalarType v, F&& f) {
#define LK_CASE(TT, CT)                                 \
  if (t == TT) {                                        \
    if (v == at::kFloat) return f(CT{}, float{}), true; \
    if (v == TT) return f(CT{}, CT{}), true;            \
    return false;                                       \
  }
  LK_CASE(at::kHalf, __half)
  LK_CASE(at::kBFloat16, __nv_bfloat16)
  LK_CASE(at::kFloat, float)
#undef LK_CASE
  return false;
}

template <typename T>
constexpr bool kIs16Bit = sizeof(T) == 2;

void check_shrink_args(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& seg_indptr,
                       const at::Tensor& weight_indices, const at::Tensor& lora_ranks,
                       const std::optional<at::Tensor>& permutation, int64_t num_slices) {
  CHECK_INPUT(x);
  CHECK_DIM(2, x);  // [T, in_dim]
  CHECK_INPUT(lora_a);
  CHECK_DIM(3, lora_a);  // [num_slots, S*R, in_dim]
  CHECK_SAME_DEVICE(lora_a, x);
  CHECK_DTYPE(lora_a, x.scalar_type());
  check_metadata(x, seg_indptr, weight_indices, lora_ranks, permutation);
  TORCH_CHECK(num_slices >= 1 && num_slices <= 4, "num_slices must be in 1..4, got ", num_slices);
  TORCH_CHECK(lora_a.size(1) % num_slices == 0, "lora_a.shape[1]=", lora_a.size(1),
              " is not a multiple of num_slices=", num_slices);
  TORCH_CHECK(lora_a.size(1) / num_slices <= kMaxRank, "max rank R=lora_a.shape[1]/num_slices=",
              lora_a.size(1) / num_slices, " exceeds ", kMaxRank);
  TORCH_CHECK(lora_a.size(2) == x.size(1), "lora_a in_dim ", lora_a.size(2), " != x in_dim ", x.size(1));
  TORCH_CHECK(lora_a.size(0) == lora_ranks.size(0), "lora_a has ", lora_a.size(0), " slots but lora_ranks ",
              lora_ranks.size(0));
}

void check_expand_args(const at::Tensor& lora_b, const at::Tensor& seg_indptr, const at::Tensor& weight_indices,
                       const at::Tensor& lora_ranks, const at::Tensor& scalings,
                       const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets,
                       const at::Tensor& out) {
  CHECK_INPUT(lora_b);
  CHECK_DIM(3, lora_b);  // [num_slots, out_total, R]
  CHECK_INPUT(out);
  CHECK_DIM(2, out);  // [T, out_total]
  CHECK_SAME_DEVICE(lora_b, out);
  CHECK_DTYPE(lora_b, out.scalar_type());
  check_metadata(out, seg_indptr, weight_indices, lora_ranks, permutation);
  CHECK_INPUT(scalings);
  CHECK_SAME_DEVICE(scalings, out);
  CHECK_DTYPE(scalings, at::kFloat);
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  TORCH_CHECK(num_slices >= 1 && num_slices <= 4, "slice_offsets must have 2..5 entries, got ",
              slice_offsets.size());
  TORCH_CHECK(slice_offsets[0] == 0 && slice_offsets[num_slices] == out.size(1),
              "slice_offsets must run from 0 to out_total=", out.size(1), ", got ", slice_offsets);
  for (int64_t i = 1; i <= num_slices; ++i)
    TORCH_CHECK(slice_offsets[i] >= slice_offsets[i - 1], "slice_offsets must be non-decreasing, got ",
                slice_offsets);
  TORCH_CHECK(lora_b.size(2) <= kMaxRank, "lora_b max rank R=", lora_b.size(2), " exceeds ", kMaxRank);
  TORCH_CHECK(lora_b.size(1) == out.size(1), "lora_b out_total ", lora_b.size(1), " != out columns ",
              out.size(1));
  TORCH_CHECK(lora_b.size(0) == lora_ranks.size(0) && scalings.size(0) == lora_ranks.size(0),
              "lora_b (", lora_b.size(0), "), scalings (", scalings.size(0), ") and lora_ranks (",
              lora_ranks.size(0), ") must agree on num_slots");
}

// How the shrink runs for these tensors: a host decision from shapes, capacities and alignment only.
struct ShrinkPlan {
  bool mma;    // tensor-core kernel (else CUDA-core)
  bool vec16;  // rows of x and lora_a are 16-byte aligned
  int splits;  // K splits of the tensor-core kernel (fp32 partial planes when > 1)
  int k_chunk;
};

ShrinkPlan plan_shrink(const at::Tensor& x, const at::Tensor& lora_a, bool v_aligned, const SgmvParams& p,
                       const LaunchCtx& ctx) {
  ShrinkPlan sp{false, false, 1, 0};
  const int64_t K = x.size(1);
  sp.vec16 = (K * x.element_size()) % 16 == 0 && aligned16(x) && aligned16(lora_a);
  sp.mma = x.element_size() == 2 && ctx.max_seg_len > kSmallMaxRows && sp.vec16 && p.max_rank % 8 == 0 &&
           v_aligned;
  if (sp.mma) sp.splits = shrink_mma_splits(x.size(0), K, lora_a.size(1), ctx.num_sms, &sp.k_chunk);
  return sp;
}

// Launches the shrink of plan sp: into v, or into the fp32 planes ws when p.splits > 1.
void launch_shrink(const at::Tensor& x, const at::Tensor& lora_a, const SgmvParams& p, const ShrinkPlan& sp,
                   at::ScalarType v_dtype, void* v, float* ws, const LaunchCtx& ctx) {
  const bool ok = dispatch(x.scalar_type(), v_dtype, [&](auto t, auto vt) {
    using T = decltype(t);
    using V = decltype(vt);
    const auto* xp = reinterpret_cast<const T*>(x.data_ptr());
    const auto* ap = reinterpret_cast<const T*>(lora_a.data_ptr());
    auto* vp = reinterpret_cast<V*>(v);
    if constexpr (kIs16Bit<T>) {
      if (sp.mma) {
        launch_shrink_mma<T, V>(xp, ap, vp, ws, p, ctx);
        return;
      }
    }
    launch_shrink_small<T, V>(xp, ap, vp, p, sp.vec16, ctx);
  });
  TORCH_CHECK(ok, "sgmv_shrink: no kernel for dtype=", x.scalar_type(), " v dtype=", v_dtype,
              " max_rank=", p.max_rank, " num_slices=", p.num_slices, " in_dim=", p.in_dim,
              " (supported: fp16/bf16/fp32 with v fp32 or the same dtype, R<=256, 1..4 slices)");
}

void run_expand(const at::Tensor& v, const at::Tensor& lora_b, SgmvParams p, at::Tensor& out, const LaunchCtx& ctx) {
  const bool ok = dispatch(out.scalar_type(), v.scalar_type(), [&](auto t, auto vt) {
    using T = decltype(t);
    using V = decltype(vt);
    const auto* vp = reinterpret_cast<const V*>(v.data_ptr());
    const auto* bp = reinterpret_cast<const T*>(lora_b.data_ptr());
    auto* op = reinterpret_cast<T*>(out.data_ptr());
    const bool vec16 = (p.max_rank * sizeof(T)) % 16 == 0 && aligned16(lora_b);
    if constexpr (kIs16Bit<T>) {
      bool offsets8 = true;
      for (int i = 0; i <= p.num_slices; ++i) offsets8 = offsets8 && p.slice_offsets[i] % 8 == 0;
      if (ctx.max_seg_len > kSmallMaxRows && vec16 && offsets8 && aligned16(out) && aligned16(v)) {
        launch_expand_mma<T, V>(vp, bp, op, p, ctx);
        return;
      }
    }
    launch_expand_small<T, V>(vp, bp, op, p, vec16, ctx);
  });
  TORCH_CHECK(ok, "sgmv_expand: no kernel for dtype=", out.scalar_type(), " v dtype=", v.scalar_type(),
              " max_rank=", p.max_rank, " num_slices=", p.num_slices, " out_total=", p.out_total,
              " (supported: fp16/bf16/fp32 with v fp32 or the same dtype, R<=256, 1..4 slices)");
}

}  // namespace

void sgmv_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& seg_indptr,
                 const at::Tensor& weight_indices, const at::Tensor& lora_ranks,
                 const std::optional<at::Tensor>& permutation, int64_t num_slices, int64_t max_seg_len,
                 at::Tensor& v) {
  check_shrink_args(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices);
  CHECK_INPUT(v);
  CHECK_DIM(2, v);  // [T, S*R]
  CHECK_SAME_DEVICE(v, x);
  TORCH_CHECK(v.size(0) == x.size(0) && v.size(1) == lora_a.size(1), "v must have shape [", x.size(0), ", ",
              lora_a.size(1), "], got ", v.sizes());
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto p = make_params(seg_indptr, weight_indices, lora_ranks, permutation, num_slices,
                       lora_a.size(1) / num_slices);
  p.in_dim = static_cast<int>(x.size(1));
  if (p.num_segments == 0 || lora_a.size(1) == 0) return;
  const LaunchCtx ctx = make_ctx(x.size(0), max_seg_len, false);
  const ShrinkPlan sp = plan_shrink(x, lora_a, aligned16(v), p, ctx);
  if (sp.splits == 1) {
    p.k_chunk = sp.k_chunk;
    launch_shrink(x, lora_a, p, sp, v.scalar_type(), v.data_ptr(), nullptr, ctx);
    return;
  }
  // Few rows: K is split over blocks into fp32 planes, summed in plane order by a second pass.
  at::Tensor ws = at::empty({sp.splits, v.size(0), v.size(1)}, x.options().dtype(at::kFloat));
  p.splits = sp.splits;
  p.k_chunk = sp.k_chunk;
  p.split_stride = v.size(0) * v.size(1);
  launch_shrink(x, lora_a, p, sp, v.scalar_type(), v.data_ptr(), ws.data_ptr<float>(), ctx);
  dispatch(v.scalar_type(), v.scalar_type(), [&](auto vt, auto) {
    using V = decltype(vt);
    launch_split_reduce<V>(ws.data_ptr<float>(), reinterpret_cast<V*>(v.data_ptr()), p,
                           static_cast<int>(v.size(0)), ctx);
  });
}

void sgmv_expand(const at::Tensor& v, const at::Tensor& lora_b, const at::Tensor& seg_indptr,
                 const at::Tensor& weight_indices, const at::Tensor& lora_ranks, const at::Tensor& scalings,
                 const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets,
                 int64_t max_seg_len, at::Tensor& out) {
  check_expand_args(lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets, out);
  CHECK_INPUT(v);
  CHECK_DIM(2, v);  // [T, S*R]
  CHECK_SAME_DEVICE(v, out);
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  const int64_t max_rank = lora_b.size(2);
  TORCH_CHECK(v.size(1) == num_slices * max_rank, "v has ", v.size(1), " columns, expected num_slices*R=",
              num_slices * max_rank);
  TORCH_CHECK(v.size(0) == out.size(0), "v has ", v.size(0), " rows but out has ", out.size(0));
  const at::cuda::OptionalCUDAGuard guard(v.device());
  auto p = make_params(seg_indptr, weight_indices, lora_ranks, permutation, num_slices, max_rank);
  p.scalings = scalings.data_ptr<float>();
  p.out_total = static_cast<int>(out.size(1));
  for (int i = 0; i <= num_slices; ++i) p.slice_offsets[i] = static_cast<int>(slice_offsets[i]);
  if (p.num_segments == 0 || p.out_total == 0 || max_rank == 0) return;
  run_expand(v, lora_b, p, out, make_ctx(out.size(0), max_seg_len, false));
}

void sgmv_apply(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b,
                const at::Tensor& seg_indptr, const at::Tensor& weight_indices, const at::Tensor& lora_ranks,
                const at::Tensor& scalings, const std::optional<at::Tensor>& permutation,
                at::IntArrayRef slice_offsets, int64_t max_seg_len, at::Tensor& out) {
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  check_expand_args(lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets, out);
  check_shrink_args(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices);
  CHECK_SAME_DEVICE(out, x);
  CHECK_DTYPE(out, x.scalar_type());
  TORCH_CHECK(out.size(0) == x.size(0), "out has ", out.size(0), " rows but x has ", x.size(0));
  TORCH_CHECK(lora_a.size(1) == num_slices * lora_b.size(2), "lora_a has ", lora_a.size(1),
              " rows but num_slices*R = ", num_slices, "*", lora_b.size(2));
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto p = make_params(seg_indptr, weight_indices, lora_ranks, permutation, num_slices, lora_b.size(2));
  p.in_dim = static_cast<int>(x.size(1));
  p.scalings = scalings.data_ptr<float>();
  p.out_total = static_cast<int>(out.size(1));
  for (int i = 0; i <= num_slices; ++i) p.slice_offsets[i] = static_cast<int>(slice_offsets[i]);
  if (p.num_segments == 0 || p.out_total == 0 || lora_b.size(2) == 0) return;
  const LaunchCtx ctx = make_ctx(x.size(0), max_seg_len, false);
  const ShrinkPlan sp = plan_shrink(x, lora_a, true, p, ctx);
  // v (or its split-K planes, which the expand sums) is written by the shrink for every covered row
  // before the expand reads those rows; other rows are never read.
  at::Tensor v = at::empty({sp.splits, x.size(0), lora_a.size(1)}, x.options().dtype(at::kFloat));
  p.splits = sp.splits;
  p.k_chunk = sp.k_chunk;
  p.split_stride = x.size(0) * lora_a.size(1);
  float* vp = v.data_ptr<float>();
  launch_shrink(x, lora_a, p, sp, at::kFloat, vp, sp.splits > 1 ? vp : nullptr, ctx);
  // The expand may start while the shrink runs (its weight and out reads overlap it); it waits for
  // the shrink before reading v.
  run_expand(v, lora_b, p, out, make_ctx(out.size(0), max_seg_len, pdl_enabled()));
}

}  // namespace lora_kernels
