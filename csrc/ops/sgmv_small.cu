// Launchers of the CUDA-core SGMV kernels (kernels/sgmv_small.cuh), instantiated for every dtype.
#include "kernels/sgmv_small.cuh"
#include "ops/sgmv_launch.h"

namespace lora_kernels {
namespace {

template <typename T, typename V, int VEC, int ROWS>
void shrink_small(const T* x, const T* lora_a, V* v, SgmvParams p, const LaunchCtx& ctx) {
  const int cols = p.num_slices * p.max_rank;
  const int chunks = row_chunks(ctx.max_seg_len, ROWS);
  // Fewer columns per block while the grid would leave SMs idle (batch-1 decode): more blocks, each
  // reading a shorter stretch of weights; more columns per block when there are many segments, so
  // each block's x rows are reused across columns.
  int c = kShrinkMaxCols;
  while (c > 1 && static_cast<int64_t>(p.num_segments) * ((cols + c - 1) / c) * chunks < 4LL * ctx.num_sms) c >>= 1;
  p.cols_per_block = c;
  const dim3 grid(p.num_segments, (cols + c - 1) / c, chunks);
  launch_kernel<sgmv_shrink_small_kernel<T, V, VEC, ROWS>>(grid, dim3(kSmallThreads), 0, ctx, false, x, lora_a, v, p);
}

template <typename T, typename V, int VEC, int ROWS>
void expand_small(const V* v, const T* lora_b, T* out, SgmvParams p, const LaunchCtx& ctx) {
  const int chunks_per_row = (p.max_rank + VEC - 1) / VEC;
  int g = 1;
  while (g < chunks_per_row && g < 32) g <<= 1;
  p.lanes_per_col = g;
  const int cols_per_block = kExpandUnroll * (kSmallThreads / g);
  const dim3 grid(p.num_segments, (p.out_total + cols_per_block - 1) / cols_per_block,
                  row_chunks(ctx.max_seg_len, ROWS));
  launch_kernel<sgmv_expand_small_kernel<T, V, VEC, ROWS>>(grid, dim3(kSmallThreads), 0, ctx, ctx.pdl, v, lora_b,
                                                          out, p);
}

}  // namespace

template <typename T, typename V>
void launch_shrink_small(const T* x, const T* lora_a, V* v, SgmvParams p, bool vec16, const LaunchCtx& ctx) {
  constexpr int kVec = 16 / sizeof(T);
  if (ctx.max_seg_len <= 1) {
    vec16 ? shrink_small<T, V, kVec, 1>(x, lora_a, v, p, ctx) : shrink_small<T, V, 1, 1>(x, lora_a, v, p, ctx);
  } else {
    vec16 ? shrink_small<T, V, kVec, 4>(x, lora_a, v, p, ctx) : shrink_small<T, V, 1, 4>(x, lora_a, v, p, ctx);
  }
}

template <typename T, typename V>
void launch_expand_small(const V* v, const T* lora_b, T* out, SgmvParams p, bool vec16, const LaunchCtx& ctx) {
  constexpr int kVec = 16 / sizeof(T);
  if (ctx.max_seg_len <= 1) {
    vec16 ? expand_small<T, V, kVec, 1>(v, lora_b, out, p, ctx) : expand_small<T, V, 1, 1>(v, lora_b, out, p, ctx);
  } else {
    vec16 ? expand_small<T, V, kVec, 4>(v, lora_b, out, p, ctx) : expand_small<T, V, 1, 4>(v, lora_b, out, p, ctx);
  }
}

#define LK_INSTANTIATE(T, V)                                                                          \
  template void launch_shrink_small<T, V>(const T*, const T*, V*, SgmvParams, bool, const LaunchCtx&); \
  template void launch_expand_small<T, V>(const V*, const T*, T*, SgmvParams, bool, const LaunchCtx&);
LK_INSTANTIATE(__half, float)
LK_INSTANTIATE(__half, __half)
LK_INSTANTIATE(__nv_bfloat16, float)
LK_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
LK_INSTANTIATE(float, float)
#undef LK_INSTANTIATE

}  // namespace lora_kernels
