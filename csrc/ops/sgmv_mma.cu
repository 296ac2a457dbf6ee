// Launchers of the tensor-core SGMV kernels (kernels/sgmv_mma.cuh), fp16 and bf16.
#include "kernels/sgmv_mma.cuh"
#include "ops/sgmv_launch.h"

namespace lora_kernels {

int shrink_mma_splits(int64_t rows, int64_t in_dim, int64_t cols, int num_sms, int* k_chunk) {
  // Split K while the row and column tiles of the whole batch (its capacity: rows of x) would fill
  // fewer than two waves of SMs; at least 256 K elements per split, at most 16 splits.
  const int w = mma_window(rows);
  const int64_t tiles = std::max<int64_t>(1, ((cols + kShrinkBN - 1) / kShrinkBN) * ((rows + w - 1) / w));
  int64_t splits = 1;
  if (tiles < 2LL * num_sms)
    splits = std::min<int64_t>({16, std::max<int64_t>(1, in_dim / 256), (2LL * num_sms + tiles - 1) / tiles});
  const int64_t chunk = ((in_dim + splits - 1) / splits + kMmaBK - 1) / kMmaBK * kMmaBK;
  *k_chunk = static_cast<int>(std::max<int64_t>(chunk, kMmaBK));
  return static_cast<int>(std::max<int64_t>(1, (in_dim + *k_chunk - 1) / *k_chunk));
}

template <typename T, typename V>
void launch_shrink_mma(const T* x, const T* lora_a, V* v, float* ws, SgmvParams p, const LaunchCtx& ctx) {
  constexpr auto kernel = sgmv_shrink_mma_kernel<T, V>;
  allow_dynamic_smem<kernel>(kShrinkSmemBytes);
  const int cols = p.num_slices * p.max_rank;
  p.window = mma_window(ctx.rows);
  const dim3 grid((cols + kShrinkBN - 1) / kShrinkBN * p.splits, row_chunks(ctx.rows, p.window));
  launch_kernel<kernel>(grid, dim3(kShrinkThreads), kShrinkSmemBytes, ctx, false, x, lora_a, v, ws, p);
}

template <typename V>
void launch_split_reduce(const float* ws, V* v, SgmvParams p, int rows, const LaunchCtx& ctx) {
  const dim3 grid(std::max(1, std::min(rows, 8 * ctx.num_sms)));
  launch_kernel<sgmv_split_reduce_kernel<V>>(grid, dim3(128), 0, ctx, false, ws, v, p, rows);
}

template <typename T, typename V>
void launch_expand_mma(const V* v, const T* lora_b, T* out, SgmvParams p, const LaunchCtx& ctx) {
  constexpr auto kernel = sgmv_expand_mma_kernel<T, V>;
  allow_dynamic_smem<kernel>(kExpandSmemBytes);
  p.tile_start[0] = 0;
  for (int i = 0; i < p.num_slices; ++i) {
    const int width = p.slice_offsets[i + 1] - p.slice_offsets[i];
    p.tile_start[i + 1] = p.tile_start[i] + (width + kExpandBN - 1) / kExpandBN;
  }
  const int tiles = p.tile_start[p.num_slices];
  if (tiles == 0) return;
  p.window = mma_window(ctx.rows);
  const dim3 grid(tiles, row_chunks(ctx.rows, p.window));
  launch_kernel<kernel>(grid, dim3(kExpandThreads), kExpandSmemBytes, ctx, ctx.pdl, v, lora_b, out, p);
}

#define LK_INSTANTIATE(T, V)                                                                         \
  template void launch_shrink_mma<T, V>(const T*, const T*, V*, float*, SgmvParams, const LaunchCtx&); \
  template void launch_expand_mma<T, V>(const V*, const T*, T*, SgmvParams, const LaunchCtx&);
LK_INSTANTIATE(__half, float)
LK_INSTANTIATE(__half, __half)
LK_INSTANTIATE(__nv_bfloat16, float)
LK_INSTANTIATE(__nv_bfloat16, __nv_bfloat16)
#undef LK_INSTANTIATE
template void launch_split_reduce<float>(const float*, float*, SgmvParams, int, const LaunchCtx&);
template void launch_split_reduce<__half>(const float*, __half*, SgmvParams, int, const LaunchCtx&);
template void launch_split_reduce<__nv_bfloat16>(const float*, __nv_bfloat16*, SgmvParams, int, const LaunchCtx&);

}  // namespace lora_kernels
