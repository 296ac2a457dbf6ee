// Bindings of the SGMV kernels: tensor checks, dtype dispatch, launch on the current stream.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/sgmv_simple.cuh"
#include "ops/checks.h"
#include "ops/ops.h"

namespace lora_kernels {
namespace {

constexpr int kMaxRowBlocks = 1024;

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
  return p;
}

dim3 grid_for(const SgmvParams& p, int64_t max_seg_len) {
  const int rows = static_cast<int>(std::min<int64_t>(std::max<int64_t>(max_seg_len, 1), kMaxRowBlocks));
  return dim3(std::max(p.num_segments, 1), rows);
}

// Calls f(T{}, V{}) with the CUDA storage types of (x dtype, v dtype); false if unsupported.
template <typename F>
bool dispatch(at::ScalarType t, at::ScalarType v, F&& f) {
#define LK_CASE(TT, CT)                                       \
  if (t == TT) {                                              \
    if (v == at::kFloat) return f(CT{}, float{}), true;       \
    if (v == TT) return f(CT{}, CT{}), true;                  \
    return false;                                             \
  }
  LK_CASE(at::kHalf, __half)
  LK_CASE(at::kBFloat16, __nv_bfloat16)
  LK_CASE(at::kFloat, float)
#undef LK_CASE
  return false;
}

}  // namespace

void sgmv_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& seg_indptr,
                 const at::Tensor& weight_indices, const at::Tensor& lora_ranks,
                 const std::optional<at::Tensor>& permutation, int64_t num_slices, int64_t max_seg_len,
                 at::Tensor& v) {
  CHECK_INPUT(x);
  CHECK_DIM(2, x);  // [T, in_dim]
  CHECK_INPUT(lora_a);
  CHECK_DIM(3, lora_a);  // [num_slots, S*R, in_dim]
  CHECK_INPUT(v);
  CHECK_DIM(2, v);  // [T, S*R]
  CHECK_SAME_DEVICE(lora_a, x);
  CHECK_SAME_DEVICE(v, x);
  CHECK_DTYPE(lora_a, x.scalar_type());
  check_metadata(x, seg_indptr, weight_indices, lora_ranks, permutation);
  TORCH_CHECK(num_slices >= 1 && num_slices <= 4, "num_slices must be in 1..4, got ", num_slices);
  TORCH_CHECK(lora_a.size(1) % num_slices == 0, "lora_a.shape[1]=", lora_a.size(1),
              " is not a multiple of num_slices=", num_slices);
  TORCH_CHECK(lora_a.size(2) == x.size(1), "lora_a in_dim ", lora_a.size(2), " != x in_dim ", x.size(1));
  TORCH_CHECK(lora_a.size(0) == lora_ranks.size(0), "lora_a has ", lora_a.size(0), " slots but lora_ranks ",
              lora_ranks.size(0));
  TORCH_CHECK(v.size(0) == x.size(0) && v.size(1) == lora_a.size(1), "v must have shape [", x.size(0), ", ",
              lora_a.size(1), "], got ", v.sizes());
  const at::cuda::OptionalCUDAGuard guard(x.device());
  auto p = make_params(seg_indptr, weight_indices, lora_ranks, permutation, num_slices,
                       lora_a.size(1) / num_slices);
  p.in_dim = static_cast<int>(x.size(1));
  if (p.num_segments == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const bool ok = dispatch(x.scalar_type(), v.scalar_type(), [&](auto t, auto vt) {
    using T = decltype(t);
    using V = decltype(vt);
    sgmv_shrink_simple_kernel<T, V><<<grid_for(p, max_seg_len), 256, 0, stream>>>(
        reinterpret_cast<const T*>(x.data_ptr()), reinterpret_cast<const T*>(lora_a.data_ptr()),
        reinterpret_cast<V*>(v.data_ptr()), p);
  });
  TORCH_CHECK(ok, "sgmv_shrink: no kernel for dtype=", x.scalar_type(), " v dtype=", v.scalar_type());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void sgmv_expand(const at::Tensor& v, const at::Tensor& lora_b, const at::Tensor& seg_indptr,
                 const at::Tensor& weight_indices, const at::Tensor& lora_ranks, const at::Tensor& scalings,
                 const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets,
                 int64_t max_seg_len, at::Tensor& out) {
  CHECK_INPUT(v);
  CHECK_DIM(2, v);  // [T, S*R]
  CHECK_INPUT(lora_b);
  CHECK_DIM(3, lora_b);  // [num_slots, out_total, R]
  CHECK_INPUT(out);
  CHECK_DIM(2, out);  // [T, out_total]
  CHECK_SAME_DEVICE(lora_b, v);
  CHECK_SAME_DEVICE(out, v);
  CHECK_DTYPE(lora_b, out.scalar_type());
  check_metadata(v, seg_indptr, weight_indices, lora_ranks, permutation);
  CHECK_INPUT(scalings);
  CHECK_DTYPE(scalings, at::kFloat);
  const int64_t num_slices = static_cast<int64_t>(slice_offsets.size()) - 1;
  TORCH_CHECK(num_slices >= 1 && num_slices <= 4, "slice_offsets must have 2..5 entries, got ",
              slice_offsets.size());
  TORCH_CHECK(slice_offsets[0] == 0 && slice_offsets[num_slices] == out.size(1),
              "slice_offsets must run from 0 to out_total=", out.size(1), ", got ", slice_offsets);
  const int64_t max_rank = lora_b.size(2);
  TORCH_CHECK(v.size(1) == num_slices * max_rank, "v has ", v.size(1), " columns, expected num_slices*R=",
              num_slices * max_rank);
  TORCH_CHECK(lora_b.size(1) == out.size(1), "lora_b out_total ", lora_b.size(1), " != out columns ",
              out.size(1));
  TORCH_CHECK(v.size(0) == out.size(0), "v has ", v.size(0), " rows but out has ", out.size(0));
  TORCH_CHECK(lora_b.size(0) == lora_ranks.size(0) && scalings.size(0) == lora_ranks.size(0),
              "lora_b, scalings and lora_ranks must agree on num_slots");
  const at::cuda::OptionalCUDAGuard guard(v.device());
  auto p = make_params(seg_indptr, weight_indices, lora_ranks, permutation, num_slices, max_rank);
  p.scalings = scalings.data_ptr<float>();
  p.out_total = static_cast<int>(out.size(1));
  for (int i = 0; i <= num_slices; ++i) {
    TORCH_CHECK(i == 0 || slice_offsets[i] >= slice_offsets[i - 1], "slice_offsets must be non-decreasing, got ",
                slice_offsets);
    p.slice_offsets[i] = static_cast<int>(slice_offsets[i]);
  }
  if (p.num_segments == 0) return;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const bool ok = dispatch(out.scalar_type(), v.scalar_type(), [&](auto t, auto vt) {
    using T = decltype(t);
    using V = decltype(vt);
    sgmv_expand_simple_kernel<T, V><<<grid_for(p, max_seg_len), 256, 0, stream>>>(
        reinterpret_cast<const V*>(v.data_ptr()), reinterpret_cast<const T*>(lora_b.data_ptr()),
        reinterpret_cast<T*>(out.data_ptr()), p);
  });
  TORCH_CHECK(ok, "sgmv_expand: no kernel for dtype=", out.scalar_type(), " v dtype=", v.scalar_type());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace lora_kernels
