// Bindings of the SGMV ops: tensor checks, the launch plan (ops/sgmv_plan.h), launch on the current
// stream. The batch arrives as the builder's work list (kernels/work.cuh); every kernel runs a
// persistent grid over it, so grids follow the capacity of the list, never its contents.
//
// Paths (from shapes only, see sgmv_plan.h): fp16/bf16 with 16-byte-aligned rows and pointers ->
// tensor-core kernels (split-K shrink into fp32 planes, expand summing them in order); anything else ->
// CUDA-core kernels. Programmatic dependent launch on sm_90+ (LORA_KERNELS_PDL=0 turns it off).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdlib>
#include <cstring>

#include "ops/checks.h"
#include "ops/ops.h"
#include "ops/sgmv_run.h"

namespace lora_kernels {

bool pdl_enabled() {
  static const bool env_on = [] {
    const char* env = std::getenv("LORA_KERNELS_PDL");
    return !(env && std::strcmp(env, "0") == 0);
  }();
  return env_on && at::cuda::getCurrentDeviceProperties()->major >= 9;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

WorkArgs make_work(const at::Tensor& work, const at::Tensor& lora_ranks, const std::optional<at::Tensor>& perm,
                   int64_t max_tiles, int64_t rows) {
  WorkArgs w{};
  w.work = work.data_ptr<int32_t>();
  w.lora_ranks = lora_ranks.data_ptr<int32_t>();
  w.perm = perm ? perm->data_ptr<int32_t>() : nullptr;
  w.max_tiles = static_cast<int>(max_tiles);
  w.num_slots = static_cast<int>(lora_ranks.numel());
  w.perm_len = perm ? static_cast<int>(perm->numel()) : 0;
  w.num_rows = static_cast<int>(rows);
  return w;
}

namespace {

// The one-launch path: sgmv_apply takes it only with LORA_KERNELS_CUDA_FUSED=1 (on the H200 it measured slower than
// the two launches on the GPU: bench/RESULTS.md, tenth session); sgmv_linear where its caller asks (one_launch, the
// eager HF decode step, whose GPU waits on the host). LORA_KERNELS_CUDA_FUSED=0 turns it off for both, =1 on for
// both (A/B runs). Read at each call: the GPU tests compare its bits with the two launches' in one process.
bool fused_enabled(bool requested) {
  const char* env = std::getenv("LORA_KERNELS_CUDA_FUSED");
  if (env && std::strcmp(env, "1") == 0) return true;
  if (env && std::strcmp(env, "0") == 0) return false;
  return requested;
}

// A/B switches for the next device run (read at each call; to be kept as the plan or removed): LK_SHRINK_FIT=1 gives
// the one-warp decode shrink 5 pipeline stages instead of 8 where its split is at most 4 slabs (K / splits <= 256:
// every slab still in flight at once, 20 KB of shared memory a CTA instead of 32, so more of the expand's CTAs fit
// beside the shrink's while it runs); LK_STREAM_CTAS=N (1-5) runs the streaming expand's persistent grid with N CTAs
// an SM instead of 5 (room for the next shrink's CTAs). Neither changes a bit: the stages and the grid change which
// thread computes what, never the sums.
int env_int(const char* name) {
  const char* env = std::getenv(name);
  return env ? std::atoi(env) : 0;
}
ShrinkPlan fit_shrink(ShrinkPlan sp) {
  if (env_int("LK_SHRINK_FIT") == 1 && sp.mma && !sp.wgmma && sp.warps == 1 && sp.stages == 8 && sp.tiles == 1 &&
      cdiv(int64_t{sp.k_chunk}, int64_t{kMmaBK}) <= 4)
    sp.stages = 5;
  return sp;
}
int stream_ctas(const ExpandPlan& plan) {
  const int n = env_int("LK_STREAM_CTAS");
  return plan.kernel == ExpandKernel::stream && n >= 1 && n <= plan.ctas_per_sm ? n : plan.ctas_per_sm;
}

LaunchCfg make_cfg(int64_t items_upper, int ctas_per_sm, bool pdl = true) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return LaunchCfg{at::cuda::getCurrentCUDAStream(), persistent_grid(items_upper, ctas_per_sm, sms),
                   pdl && pdl_enabled()};
}

void check_work(const at::Tensor& ref, const at::Tensor& work, const at::Tensor& lora_ranks,
                const std::optional<at::Tensor>& permutation, int64_t max_tiles) {
  for (const at::Tensor* t : {&work, &lora_ranks}) {
    CHECK_INPUT(*t);
    CHECK_SAME_DEVICE(*t, ref);
    CHECK_DTYPE(*t, at::kInt);
    CHECK_DIM(1, *t);
  }
  TORCH_CHECK(max_tiles >= 0 && work.numel() >= 1 + 3 * max_tiles, "work must have 1 + 3*max_tiles = ",
              1 + 3 * max_tiles, " entries or more (max_tiles=", max_tiles, "), got shape ", work.sizes());
  if (permutation) {
    CHECK_INPUT(*permutation);
    CHECK_SAME_DEVICE(*permutation, ref);
    CHECK_DTYPE(*permutation, at::kInt);
    CHECK_DIM(1, *permutation);
  }
}

void check_shrink_args(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_ranks,
                       int64_t num_slices) {
  CHECK_INPUT(x);
  CHECK_DIM(2, x);  // [T, in_dim]
  CHECK_INPUT(lora_a);
  CHECK_DIM(3, lora_a);  // [num_slots, S*R, in_dim]
  CHECK_SAME_DEVICE(lora_a, x);
  CHECK_DTYPE(lora_a, x.scalar_type());
  TORCH_CHECK(num_slices >= 1 && num_slices <= kMaxSlices, "num_slices must be in 1..", kMaxSlices, ", got ",
              num_slices);
  TORCH_CHECK(lora_a.size(1) % num_slices == 0, "lora_a.shape[1]=", lora_a.size(1),
              " is not a multiple of num_slices=", num_slices);
  TORCH_CHECK(lora_a.size(1) / num_slices <= kMaxRank, "max rank R=lora_a.shape[1]/num_slices=",
              lora_a.size(1) / num_slices, " exceeds ", kMaxRank);
  TORCH_CHECK(lora_a.size(2) == x.size(1), "lora_a in_dim ", lora_a.size(2), " != x in_dim ", x.size(1));
  TORCH_CHECK(lora_a.size(0) == lora_ranks.size(0), "lora_a has ", lora_a.size(0), " slots but lora_ranks ",
              lora_ranks.size(0));
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31) && x.size(1) < (int64_t{1} << 31), "x is too large: ", x.sizes());
}

void check_expand_args(const at::Tensor& lora_b, const at::Tensor& lora_ranks, const at::Tensor& scalings,
                       at::IntArrayRef slice_offsets, const at::Tensor& out) {
  CHECK_INPUT(lora_b);
  CHECK_DIM(3, lora_b);  // [num_slots, out_total, R]
  CHECK_INPUT(out);
  CHECK_DIM(2, out);  // [T, out_total]
  CHECK_SAME_DEVICE(lora_b, out);
  CHECK_DTYPE(lora_b, out.scalar_type());
  CHECK_INPUT(scalings);
  CHECK_SAME_DEVICE(scalings, out);
  CHECK_DTYPE(scalings, at::kFloat);
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  TORCH_CHECK(num_slices >= 1 && num_slices <= kMaxSlices, "slice_offsets must have 2..", kMaxSlices + 1,
              " entries, got ", slice_offsets.size());
  TORCH_CHECK(slice_offsets[0] == 0 && slice_offsets[num_slices] == out.size(1),
              "slice_offsets must run from 0 to out_total=", out.size(1), ", got ", slice_offsets);
  for (int64_t i = 0; i < num_slices; ++i)
    TORCH_CHECK(slice_offsets[i] <= slice_offsets[i + 1], "slice_offsets must not decrease, got ", slice_offsets);
  TORCH_CHECK(lora_b.size(1) == out.size(1), "lora_b out_total ", lora_b.size(1), " != out columns ", out.size(1));
  TORCH_CHECK(lora_b.size(2) <= kMaxRank, "lora_b max rank R=", lora_b.size(2), " exceeds ", kMaxRank);
  TORCH_CHECK(lora_b.size(0) == lora_ranks.size(0) && scalings.numel() == lora_ranks.numel(), "lora_b has ",
              lora_b.size(0), " slots, lora_ranks ", lora_ranks.size(0), ", scalings ", scalings.numel());
}

ShrinkArgs make_shrink_args(const WorkArgs& w, const at::Tensor& x, const at::Tensor& lora_a, int64_t num_slices,
                            const ShrinkPlan& plan) {
  ShrinkArgs p{};
  p.w = w;
  p.K = static_cast<int>(x.size(1));
  p.R = static_cast<int>(lora_a.size(1) / num_slices);
  p.N = static_cast<int>(lora_a.size(1));
  p.n_tiles = plan.n_tiles;
  p.splits = plan.splits;
  p.k_chunk = plan.k_chunk;
  p.split_stride = x.size(0) * lora_a.size(1);
  return p;
}

ExpandArgs make_expand_args(const WorkArgs& w, const at::Tensor& lora_b, const at::Tensor& scalings,
                            at::IntArrayRef offs, const at::Tensor& out, const ExpandPlan& plan, int splits) {
  ExpandArgs p{};
  p.w = w;
  p.scalings = scalings.data_ptr<float>();
  p.R = static_cast<int>(lora_b.size(2));
  p.num_slices = static_cast<int>(offs.size()) - 1;
  p.N = p.num_slices * p.R;
  p.out_total = static_cast<int>(out.size(1));
  for (int i = 0; i <= kMaxSlices; ++i) {
    p.offsets[i] = static_cast<int>(offs[std::min(i, p.num_slices)]);
    p.tile_start[i] = plan.tile_start[i];
  }
  p.n_tiles = plan.n_tiles;
  p.splits = splits;
  p.split_stride = out.size(0) * int64_t{p.N};
  return p;
}

// max_tiles: the work list's tile capacity (as many tiles as rows: every tile is one row, sgmv_plan.h).
ExpandPlan expand_plan_for(const at::Tensor& lora_b, at::IntArrayRef offs, const at::Tensor& out, const void* v,
                           int v_elem, int64_t max_tiles) {
  const bool aligned = aligned16(lora_b.data_ptr()) && aligned16(out.data_ptr()) &&
                       reinterpret_cast<uintptr_t>(v) % (4 * v_elem) == 0;
  return plan_expand(static_cast<int>(out.element_size()), lora_b.size(2), offs.data(),
                     static_cast<int>(offs.size()) - 1, aligned, aligned16(v), out.size(0), max_tiles);
}

void expand_launch(const void* v, at::ScalarType v_dtype, const at::Tensor& lora_b, at::Tensor& out,
                   const ExpandArgs& p, const ExpandPlan& plan, int64_t max_tiles) {
  run_expand(v, v_dtype, lora_b, out, p, plan, make_cfg(expand_items_upper(plan, max_tiles), stream_ctas(plan)));
}

// The one-launch path where its limits hold and the device runs it (sgmv_plan.h: fused_fits); false otherwise.
bool try_fused(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& scalings,
               at::IntArrayRef offs, at::Tensor& out, const WorkArgs& w, const ShrinkArgs& p, const ShrinkPlan& sp,
               bool pdl) {
  // v lives in shared memory: no v pointer. The kernel has column groups of its own: only the plan's kind counts.
  const ExpandPlan ep = expand_plan_for(lora_b, offs, out, nullptr, 4, w.max_tiles);
  if (!fused_fits(sp, ep, lora_b.size(2), lora_a.size(1))) return false;
  const ExpandArgs e = make_expand_args(w, lora_b, scalings, offs, out, ep, 1);
  return run_fused(x, lora_a, lora_b, out, p, e, pdl && pdl_enabled());
}

}  // namespace

void check_apply_args(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
                      const at::Tensor& lora_ranks, const at::Tensor& scalings,
                      const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets, int64_t max_tiles,
                      const at::Tensor& out) {
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  check_expand_args(lora_b, lora_ranks, scalings, slice_offsets, out);
  check_shrink_args(x, lora_a, lora_ranks, num_slices);
  check_work(x, work, lora_ranks, permutation, max_tiles);
  CHECK_SAME_DEVICE(out, x);
  CHECK_DTYPE(out, x.scalar_type());
  TORCH_CHECK(out.size(0) == x.size(0), "out has ", out.size(0), " rows but x has ", x.size(0));
  TORCH_CHECK(lora_a.size(1) == num_slices * lora_b.size(2), "lora_a has ", lora_a.size(1),
              " rows but num_slices*R = ", num_slices, "*", lora_b.size(2));
}

void sgmv_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& work, const at::Tensor& lora_ranks,
                 const std::optional<at::Tensor>& permutation, int64_t num_slices, int64_t max_tiles, at::Tensor& v) {
  check_shrink_args(x, lora_a, lora_ranks, num_slices);
  check_work(x, work, lora_ranks, permutation, max_tiles);
  CHECK_INPUT(v);
  CHECK_DIM(2, v);  // [T, S*R]
  CHECK_SAME_DEVICE(v, x);
  TORCH_CHECK(v.size(0) == x.size(0) && v.size(1) == lora_a.size(1), "v must have shape [", x.size(0), ", ",
              lora_a.size(1), "], got ", v.sizes());
  if (max_tiles == 0 || v.numel() == 0) return;
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const ShrinkPlan plan = fit_shrink(plan_shrink(static_cast<int>(x.element_size()), x.size(1), lora_a.size(1),
                                                 aligned16(x.data_ptr()) && aligned16(lora_a.data_ptr()), x.size(0),
                                                 max_tiles));
  const ShrinkArgs p =
      make_shrink_args(make_work(work, lora_ranks, permutation, max_tiles, x.size(0)), x, lora_a, num_slices, plan);
  const LaunchCfg cfg = make_cfg(shrink_items_upper(plan, max_tiles), plan.ctas_per_sm);
  if (plan.splits == 1 || plan.fold) {  // straight into v (fold: each item sums its splits in order)
    run_shrink(x, lora_a, v.data_ptr(), v.scalar_type(), nullptr, p, plan, cfg);
    return;
  }
  // K split into fp32 planes, then summed in plane order into v (the same sums sgmv_apply's expand makes).
  at::Tensor ws = at::empty({plan.splits, x.size(0), lora_a.size(1)}, x.options().dtype(at::kFloat));
  run_shrink(x, lora_a, v.data_ptr(), v.scalar_type(), ws.data_ptr<float>(), p, plan, cfg);
  run_split_reduce(ws.data_ptr<float>(), v.data_ptr(), v.scalar_type(), p, make_cfg(max_tiles, 4));
}

void sgmv_expand(const at::Tensor& v, const at::Tensor& lora_b, const at::Tensor& work, const at::Tensor& lora_ranks,
                 const at::Tensor& scalings, const std::optional<at::Tensor>& permutation,
                 at::IntArrayRef slice_offsets, int64_t max_tiles, at::Tensor& out) {
  check_expand_args(lora_b, lora_ranks, scalings, slice_offsets, out);
  check_work(out, work, lora_ranks, permutation, max_tiles);
  CHECK_INPUT(v);
  CHECK_DIM(2, v);  // [T, S*R]
  CHECK_SAME_DEVICE(v, out);
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  TORCH_CHECK(v.size(0) == out.size(0) && v.size(1) == num_slices * lora_b.size(2), "v must have shape [",
              out.size(0), ", num_slices*R=", num_slices * lora_b.size(2), "], got ", v.sizes());
  TORCH_CHECK(out.size(0) < (int64_t{1} << 31), "out is too large: ", out.sizes());
  if (max_tiles == 0 || out.numel() == 0 || lora_b.size(2) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(out.device());
  const ExpandPlan plan =
      expand_plan_for(lora_b, slice_offsets, out, v.data_ptr(), static_cast<int>(v.element_size()), max_tiles);
  if (plan.n_tiles == 0) return;
  const ExpandArgs p = make_expand_args(make_work(work, lora_ranks, permutation, max_tiles, out.size(0)), lora_b,
                                        scalings, slice_offsets, out, plan, 1);
  expand_launch(v.data_ptr(), v.scalar_type(), lora_b, out, p, plan, max_tiles);
}

namespace {

// sgmv_apply; pdl_first: its first kernel may be a programmatic dependent launch (off behind a kernel that never
// triggers dependents, such as sgmv_linear's cuBLAS GEMM: there PDL overlaps nothing and costs host time);
// one_launch, fused_max_rows: whether the caller asks for the one-launch path (fused_enabled) and the most rows it
// takes (sgmv_plan.h).
void apply_into(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
                const at::Tensor& lora_ranks, const at::Tensor& scalings,
                const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets, int64_t max_tiles,
                at::Tensor& out, bool pdl_first, bool one_launch, int64_t fused_max_rows) {
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  check_apply_args(x, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out);
  if (max_tiles == 0 || out.numel() == 0 || lora_b.size(2) == 0) return;
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const ShrinkPlan sp = fit_shrink(plan_shrink(static_cast<int>(x.element_size()), x.size(1), lora_a.size(1),
                                               aligned16(x.data_ptr()) && aligned16(lora_a.data_ptr()), x.size(0),
                                               max_tiles));
  const WorkArgs w = make_work(work, lora_ranks, permutation, max_tiles, x.size(0));
  const ShrinkArgs p = make_shrink_args(w, x, lora_a, num_slices, sp);
  if (x.size(0) <= fused_max_rows && fused_enabled(one_launch) &&
      try_fused(x, lora_a, lora_b, scalings, slice_offsets, out, w, p, sp, pdl_first))
    return;
  // fp32 v, or the shrink's split-K planes, which the expand sums in plane order: the same bits as
  // sgmv_shrink (planes reduced in the same order) followed by sgmv_expand on an fp32 v.
  at::Tensor ws = at::empty({sp.fold ? 1 : sp.splits, x.size(0), lora_a.size(1)}, x.options().dtype(at::kFloat));
  float* wsp = ws.data_ptr<float>();
  const ExpandPlan ep = expand_plan_for(lora_b, slice_offsets, out, wsp, 4, max_tiles);
  if (ep.n_tiles == 0) return;
  const void* v = wsp;  // the planes, or their sum
  at::ScalarType v_dtype = at::kFloat;
  int planes = sp.splits;
  if (sp.fold || (sp.wgmma && sp.splits == 1)) {
    // Prefill: the shrink sums its splits in order itself, or has one. For the tensor-core expands v is rounded to
    // x's dtype, as each rounds v for its MMAs: the same bits, half the bytes to read, and the warpgroup-MMA expand
    // (which reads v of out's dtype) for R 17-64. The CUDA-core expand takes v in fp32.
    v_dtype = ep.kernel == ExpandKernel::simt ? at::kFloat : x.scalar_type();
    planes = 1;
  }
  run_shrink(x, lora_a, wsp, v_dtype, planes > 1 ? wsp : nullptr, p, sp,
             make_cfg(shrink_items_upper(sp, max_tiles), sp.ctas_per_sm, pdl_first));
  // Planes are left only where prefill_plan does not hold (below kPrefillRows rows, or a sparse work list such as a
  // chunked-prefill step's): where it holds, the shrink folds its splits and the prefill expands run (sgmv_plan.h
  // asserts it). The streaming warps read one plane: from kReduceFirstRowsStream rows the planes are summed once first
  // (same order, same bits), rounded as above, as they are for the 16-row kernel's wide modules from
  // kReduceFirstRowsMma rows; the other expands sum them in every column tile.
  at::Tensor v_sum;
  const bool reduce_first =
      (ep.kernel == ExpandKernel::stream && x.size(0) >= kReduceFirstRowsStream) ||
      (ep.kernel == ExpandKernel::mma && x.size(0) >= kReduceFirstRowsMma && ep.n_tiles >= kReduceFirstTilesMma);
  if (planes > 1 && reduce_first) {
    v_sum = at::empty({x.size(0), lora_a.size(1)}, x.options());
    run_split_reduce(wsp, v_sum.data_ptr(), v_sum.scalar_type(), p, make_cfg(max_tiles, 4));
    v = v_sum.data_ptr();
    v_dtype = v_sum.scalar_type();
    planes = 1;
  }
  const ExpandArgs e = make_expand_args(w, lora_b, scalings, slice_offsets, out, ep, planes);
  expand_launch(v, v_dtype, lora_b, out, e, ep, max_tiles);
}

}  // namespace

void sgmv_apply(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
                const at::Tensor& lora_ranks, const at::Tensor& scalings,
                const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets, int64_t max_tiles,
                at::Tensor& out) {
  apply_into(x, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out, true, false,
             kFusedMaxRows);
}

at::Tensor sgmv_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
                       const at::Tensor& lora_ranks, const at::Tensor& scalings,
                       const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets,
                       int64_t max_tiles, bool one_launch) {
  CHECK_INPUT(x);
  TORCH_CHECK(x.dim() >= 2, "x must be [..., in_dim] with at least 2 dims, got shape ", x.sizes());
  CHECK_DIM(2, weight);  // [out_total, in_dim]
  CHECK_SAME_DEVICE(weight, x);
  CHECK_DTYPE(weight, x.scalar_type());
  TORCH_CHECK(weight.size(1) == x.size(-1), "weight must have shape [out_total, ", x.size(-1), "] (x's in_dim), got ",
              weight.sizes());
  TORCH_CHECK(weight.size(0) == lora_b.size(1), "weight has ", weight.size(0), " output rows but lora_b out_total ",
              lora_b.size(1));
  if (bias) {
    CHECK_DIM(1, *bias);
    CHECK_SAME_DEVICE(*bias, x);
    CHECK_DTYPE(*bias, x.scalar_type());
    TORCH_CHECK(bias->size(0) == weight.size(0), "bias must have shape [", weight.size(0), "], got ", bias->sizes());
  }
  // One host call for the base GEMM and the LoRA launches: an eager decode step is host-bound, and each
  // Python-to-C++ crossing it saves is several µs per module.
  const at::Tensor x2 = x.view({-1, x.size(-1)});
  at::Tensor out, out2;
  if (x.dim() <= 3) {
    // What at::linear runs for a contiguous x of 2 or 3 dims (folded to [rows, in_dim]: addmm with a bias, mm
    // without; the same cuBLAS call, the same bits), called directly: linear's and matmul's dispatch layers
    // cost µs of host time per module.
    out2 = bias ? at::addmm(*bias, x2, weight.t()) : at::mm(x2, weight.t());
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = weight.size(0);
    out = out2.view(shape);
  } else {  // more dims: linear adds a bias after the matmul, another rounding; its own path keeps its bits
    out = at::linear(x, weight, bias);
    if (!out.is_contiguous()) out = out.contiguous();
    out2 = out.view({-1, out.size(-1)});
  }
  apply_into(x2, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out2, false,
             one_launch, kFusedMaxRowsLinear);
  return out;
}

}  // namespace lora_kernels
