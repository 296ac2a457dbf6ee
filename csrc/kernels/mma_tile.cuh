// Device helpers shared by the tensor-core (mma.sync m16n8k16) kernels: the swizzled shared-memory
// tile layout, one warp's MMAs over a K slab, and the accumulator prologue / epilogue loops.
//
// Operand tiles live in shared memory as rows of kMmaBK = 64 16-bit elements (8 chunks of 16 bytes),
// the chunk index XOR-swizzled by (row % 8) so cp.async stores and ldmatrix reads are conflict-free.
// A CTA tile is the kTileM rows of one work-list tile; its warps split the columns, each owning all rows
// of kTileM x 16 columns (WarpAcc<kTileM / 16, 2>).
// Raw pointers only; no torch headers.
#pragma once
#include <cstdint>

#include "kernels/ptx.cuh"
#include "kernels/types.cuh"
#include "kernels/work.cuh"

namespace lora_kernels {

constexpr int kMmaBK = 64;  // K elements per shared-memory slab (128 bytes per row)
static_assert(kTileM % 16 == 0, "a work-list tile is whole m16 MMA tiles");
constexpr int kWarpN = 16;  // columns per warp: two n8 MMA tiles
constexpr int kWarpMT = kTileM / 16, kWarpNT = kWarpN / 8;
using TileAcc = float[kWarpMT][kWarpNT][4];

__device__ __forceinline__ int swz(int row, int chunk) { return row * kMmaBK + ((chunk ^ (row & 7)) << 3); }

// A warp's accumulators: MT m16 tiles x NT n8 tiles x 4 floats (the mma.sync m16n8 fragment).
template <int MT, int NT>
using WarpAcc = float[MT][NT][4];

template <int MT, int NT>
__device__ __forceinline__ void zero_acc(WarpAcc<MT, NT>& acc) {
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
}

// sum += acc, then acc = 0: one K split's MMA chain folded into the running sum (fp32 adds in split order).
template <int MT, int NT>
__device__ __forceinline__ void add_acc(WarpAcc<MT, NT>& sum, WarpAcc<MT, NT>& acc) {
#pragma unroll
  for (int a = 0; a < MT; ++a)
#pragma unroll
    for (int b = 0; b < NT; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        sum[a][b][c] += acc[a][b][c];
        acc[a][b][c] = 0.f;
      }
}

// f(r, c, lo, hi): the warp's accumulator pairs (r, c) and (r, c + 1) of its (16 MT) x (8 NT) block at
// (m_off, n_off), r and c relative to the CTA tile (the m16n8 fragment layout of mma.sync).
template <int MT, int NT, typename F>
__device__ __forceinline__ void for_each_acc_pair(const WarpAcc<MT, NT>& acc, int m_off, int n_off, int lane, F&& f) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        f(m_off + mt * 16 + (lane >> 2) + h * 8, n_off + nt * 8 + (lane & 3) * 2, acc[mt][nt][2 * h],
          acc[mt][nt][2 * h + 1]);
}

// An expand's output element: out + scaling * acc as one fused multiply-add, written out so that every expand
// kernel rounds it the same way (the one-launch path must give the two launches' bits).
__device__ __forceinline__ float expand_out(float old, float scale, float acc) { return __fmaf_rn(scale, acc, old); }

template <typename V>
__device__ __forceinline__ void store_pair(V* dst, float a, float b) {
  Pack<V, 2> pk;
  pk.v[0] = from_float<V>(a);
  pk.v[1] = from_float<V>(b);
  *reinterpret_cast<Pack<V, 2>*>(dst) = pk;
}

// rows_sm[i] = physical row of tile row i, -1 past the tile (threads 0..kTileM-1; the caller syncs).
__device__ __forceinline__ void fill_tile_rows(int* rows_sm, const WorkArgs& w, const TileInfo& ti) {
  if (threadIdx.x < kTileM) rows_sm[threadIdx.x] = tile_row(w, ti, threadIdx.x);
}

// One warp's MMAs over a 64-wide K slab: rows [m_off, m_off + 16 MT) of xs times rows
// [n_off, n_off + 8 NT) of ws, the first `ksteps` (<= 4) k16 steps only. The order of the k16 steps is
// fixed, so a row's result depends on its own data only (whatever the other rows of the tile hold).
template <typename T, int MT, int NT>
__device__ __forceinline__ void warp_mma_slab(WarpAcc<MT, NT>& acc, const T* xs, const T* ws, int m_off, int n_off,
                                              int ksteps, int lane) {
  static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
#pragma unroll
  for (int ks = 0; ks < kMmaBK / 16; ++ks) {
    if (ks < ksteps) {
      uint32_t a[MT][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], xs + swz(m_off + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, ws + swz(n_off + nt * 8 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1)));
        b[nt][0] = r[0];
        b[nt][1] = r[1];
        b[nt + 1][0] = r[2];
        b[nt + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_16816<T>(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  }
}

}  // namespace lora_kernels
