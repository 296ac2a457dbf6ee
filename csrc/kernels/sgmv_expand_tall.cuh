// The tensor-core expand for many rows (prefill): the same sums as sgmv_expand_mma.cuh, with no shared memory.
//   out[row, n] += scaling[slot] * sum_{j<rank} v[row, i*R + j] * lora_b[slot, n, j]     n in slice i
// Item (group of kTallTiles consecutive work-list tiles, column tile of kExpandBN columns), one CTA of 4 warps each;
// warp w owns tile w / 2 of the group and 64 columns (w % 2) of the item: 16 rows x 64 columns, its own work. Each
// lane loads its out pairs, v and B fragments straight into registers in the mma.sync layout (out first, so that
// its DRAM reads fly while v and B come from L2), runs the k16 steps, and stores its pairs: no barrier, no staging.
// ncu found the 16-row kernel issue-bound at prefill (SM 64%, DRAM 28-35%, `not_selected` the top stall): a
// 256-thread CTA spent its fixed work (its tile, a 64-wide B slab, four barriers) on 4 KB of out.
// Forms measured slower at gate_up prefill r16 (H100, µs; the 16-row kernel 797): 64-row items in 8-warp CTAs
// staging out, v and B in shared memory 647; the same as a persistent grid with a double-buffered out tile 752;
// 32-row items of that form held to 80 registers (144-176 bytes of stack frame) 823.
//
// Bits: a row's sum is the same mma.sync m16n8k16 chain over the same k16 steps of the same operands (v summed over
// its planes in order, rounded to T, zero past the rank; B zero past the rank) and the same fma epilogue as the
// 16-row kernel's; the M tiling does not enter a row's result. So the choice between the two kernels (by rows,
// ops/sgmv_plan.h) keeps batch invariance. Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/sgmv_expand_mma.cuh"

namespace lora_kernels {

constexpr int kTallTiles = 2, kTallThreads = 128;
static_assert(kTallThreads / 32 == 2 * kTallTiles && kExpandBN == 2 * 64, "warp w: tile w / 2, 64 columns");

// Two consecutive 16-bit elements as one 32-bit register (the low half is the first: the mma.sync operand order).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  Pack<T, 2> pk;
  pk.v[0] = from_float<T>(lo);
  pk.v[1] = from_float<T>(hi);
  return *reinterpret_cast<const uint32_t*>(&pk);
}

// The A fragment half of one row: v[row, col .. col + 1] summed over the planes, 0 at k >= rank or without a row.
template <typename T, typename V>
__device__ __forceinline__ uint32_t tall_v_pair(const V* v, const ExpandArgs& p, int row, int col, int k, int rank) {
  if (row < 0 || k >= rank) return 0u;
  const V* src = v + static_cast<int64_t>(row) * p.N + col;
  const float lo = sum_planes(src, p.split_stride, p.splits);
  const float hi = k + 1 < rank ? sum_planes(src + 1, p.split_stride, p.splits) : 0.f;
  return pack2<T>(lo, hi);
}

// The B fragment half lora_b[slot, n, k .. k + 1], 0 past the rank or the slice (R and k even: 4-byte aligned).
template <typename T>
__device__ __forceinline__ uint32_t tall_b_pair(const T* b, const ExpandArgs& p, int slot, int n, int n_end, int k,
                                                int rank) {
  if (n >= n_end || k >= rank) return 0u;
  uint32_t u = __ldg(reinterpret_cast<const unsigned int*>(b + (static_cast<int64_t>(slot) * p.out_total + n) * p.R + k));
  return k + 1 < rank ? u : (u & 0xffffu);
}

// One warp's 16 rows x 64 columns of an item: out += scale * v Bᵀ over the tile's rank, pairs in registers.
template <typename T, typename V>
__device__ __forceinline__ void tall_warp(const V* v, const T* b, T* out, const ExpandArgs& p, const TileInfo& ti,
                                          int c0, int n_end, int vcol0, bool& waited) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t2 = (lane & 3) * 2;
  const int row[2] = {tile_row(p.w, ti, g), tile_row(p.w, ti, g + 8)};
  wait_once(waited);  // v and out are written by earlier kernels
  uint32_t old[8][2];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = c0 + nt * 8 + t2;
      old[nt][h] = row[h] >= 0 && col < n_end
                       ? *reinterpret_cast<const uint32_t*>(out + static_cast<int64_t>(row[h]) * p.out_total + col)
                       : 0u;
    }
  WarpAcc<1, 8> acc;
  zero_acc(acc);
  for (int k0 = 0; k0 < ti.rank; k0 += 16) {  // the k16 steps, in order
    const uint32_t a[4] = {tall_v_pair<T>(v, p, row[0], vcol0 + k0 + t2, k0 + t2, ti.rank),
                           tall_v_pair<T>(v, p, row[1], vcol0 + k0 + t2, k0 + t2, ti.rank),
                           tall_v_pair<T>(v, p, row[0], vcol0 + k0 + t2 + 8, k0 + t2 + 8, ti.rank),
                           tall_v_pair<T>(v, p, row[1], vcol0 + k0 + t2 + 8, k0 + t2 + 8, ti.rank)};
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int n = c0 + nt * 8 + g;
      mma_16816<T>(acc[0][nt], a, tall_b_pair(b, p, ti.slot, n, n_end, k0 + t2, ti.rank),
                   tall_b_pair(b, p, ti.slot, n, n_end, k0 + t2 + 8, ti.rank));
    }
  }
  const float scale = p.scalings[ti.slot];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = c0 + nt * 8 + t2;
      if (row[h] < 0 || col >= n_end) continue;
      const Pack<T, 2> o = *reinterpret_cast<const Pack<T, 2>*>(&old[nt][h]);
      store_pair(out + static_cast<int64_t>(row[h]) * p.out_total + col,
                 expand_out(to_float(o.v[0]), scale, acc[0][nt][2 * h]),
                 expand_out(to_float(o.v[1]), scale, acc[0][nt][2 * h + 1]));
    }
}

template <typename T, typename V>
__global__ void __launch_bounds__(kTallThreads, 4)
    sgmv_expand_tall_kernel(const V* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
  griddep_launch_dependents();
  bool waited = false;
  const int n = num_tiles(p.w), warp = threadIdx.x >> 5;
  const int total = (n + kTallTiles - 1) / kTallTiles * p.n_tiles;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {  // warps run alone: no barrier anywhere
    const int ct = item % p.n_tiles, sl = slice_of(p, ct), t = item / p.n_tiles * kTallTiles + (warp >> 1);
    const int c0 = pick(p.offsets, sl) + (ct - pick(p.tile_start, sl)) * kExpandBN + (warp & 1) * 64;
    const int n_end = pick(p.offsets, sl + 1);
    if (t >= n || c0 >= n_end) continue;
    const TileInfo ti = load_tile(p.w, t, p.R);
    if (ti.slot >= 0) tall_warp<T, V>(v, b, out, p, ti, c0, n_end, sl * p.R, waited);
  }
  wait_once(waited);  // as sgmv_expand_mma_kernel: the stream's next kernel must not overtake the producer
}

template <typename T, typename V>
cudaError_t launch_expand_tall(const V* v, const T* b, T* out, const ExpandArgs& p, const LaunchCfg& cfg) {
  return launch_kernel<sgmv_expand_tall_kernel<T, V>>(cfg, kTallThreads, 0, v, b, out, p);
}

}  // namespace lora_kernels
