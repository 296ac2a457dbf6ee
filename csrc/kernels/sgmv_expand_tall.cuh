// The tensor-core expand for many rows (prefill): the same sums as sgmv_expand_mma.cuh, over taller items.
//   out[row, n] += scaling[slot] * sum_{j<rank} v[row, i*R + j] * lora_b[slot, n, j]     n in slice i
// Item (group of kTallTiles consecutive work-list tiles, column tile of kExpandBN columns). At 16 rows
// an item's fixed work (its tile, a 64-wide B slab, four barriers) outweighs its 4 KB of out, and ncu found the
// 16-row kernel issue-bound at prefill (SM 64%, DRAM 28-35%, `not_selected` the top stall). Here one B slab serves
// a run of tiles of the same slot (a prefill segment is 64 tiles), only the k16 steps under the rank are loaded,
// and the out tile is 64 rows, the next item's loading while one computes (two CTAs per SM, each with about 16 KB of
// out in flight). 8 warps: warp w owns tile w / 2 of the group, 64 columns (w % 2) of the item.
//
// Bits: a row's sum is the same mma.sync m16n8k16 chain over the same k16 steps of the same operands (v rounded to
// T, zero past the rank) and the same fma epilogue as the 16-row kernel's; the M tiling does not enter a row's
// result. So the choice between the two kernels (by rows, ops/sgmv_plan.h) keeps batch invariance.
// Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/sgmv_expand_mma.cuh"

namespace lora_kernels {

constexpr int kTallTiles = 4, kTallM = kTallTiles * kTileM;
constexpr int kTallSmemBytes = (2 * kTallM * kExpandOutLd + (kTallM + kExpandBN) * kMmaBK) * 2;  // 2 out tiles
static_assert(kExpandThreads / 32 == 2 * kTallTiles && kExpandBN == 2 * 64, "warp w: tile w / 2, 64 columns");

struct TallGroup {
  int slot[kTallTiles];  // -1: no LoRA rows (no tile, slot -1, rank 0)
  int rank[kTallTiles];
  int rows[kTallM];  // physical row of each group row, -1 where none (or its tile has no LoRA)
};

// The group's tiles and rows into shared memory (the caller syncs after).
__device__ __forceinline__ void tall_fill_group(TallGroup& g, const WorkArgs& w, int t0, int n, int R) {
  const int i = threadIdx.x;
  if (i < kTallM) {
    const int t = t0 + i / kTileM;
    int row = -1;
    if (t < n) {
      const TileInfo ti = load_tile(w, t, R);
      if (ti.slot >= 0) row = tile_row(w, ti, i % kTileM);
      if (i % kTileM == 0) {
        g.slot[i / kTileM] = ti.slot;
        g.rank[i / kTileM] = ti.rank;
      }
    } else if (i % kTileM == 0) {
      g.slot[i / kTileM] = -1;
      g.rank[i / kTileM] = 0;
    }
    g.rows[i] = row;
  }
}

// B slab kt of `slot` for the item's columns: only the chunks of the first `ksteps` k16 steps (what the MMAs read),
// zero-filled past the rank and past the slice.
template <typename T>
__device__ __forceinline__ void tall_load_b(T* bs, const T* b, const ExpandArgs& p, int slot, int rank, int n0,
                                            int n_end, int kt, int ksteps) {
#pragma unroll
  for (int i = 0; i < (kExpandBN * kMmaBK / 8) / kExpandThreads; ++i) {
    const int idx = threadIdx.x + i * kExpandThreads, r = idx >> 3, c = idx & 7;
    if (c >= 2 * ksteps) continue;
    const int n = n0 + r, j = kt * kMmaBK + c * 8;
    const int bytes = n < n_end ? max(0, min(16, (rank - j) * 2)) : 0;
    cp_async16(bs + swz(r, c), bytes ? b + (static_cast<int64_t>(slot) * p.out_total + n) * p.R + j : b, bytes);
  }
}

template <typename T>
__device__ __forceinline__ void tall_load_out(T* out_sm, const T* out, const ExpandArgs& p, const int* rows, int n0,
                                              int n_end) {
#pragma unroll
  for (int i = 0; i < (kTallM * kExpandBN / 8) / kExpandThreads; ++i) {
    const int idx = threadIdx.x + i * kExpandThreads, r = idx >> 4, c = idx & 15;
    if (rows[r] >= 0 && n0 + c * 8 < n_end)
      cp_async16(out_sm + r * kExpandOutLd + c * 8, out + static_cast<int64_t>(rows[r]) * p.out_total + n0 + c * 8,
                 16);
  }
}

// vs rows of tiles [t_lo, t_hi) = v (planes summed in order) for the slab's first `ksteps` k16 steps, as T, 0 past
// the rank and for rows outside x.
template <typename T, typename V>
__device__ __forceinline__ void tall_fill_v(T* vs, const V* v, const ExpandArgs& p, const int* rows, int vcol0,
                                            int rank, int t_lo, int t_hi, int kt, int ksteps) {
#pragma unroll
  for (int i = 0; i < (kTallM * kMmaBK / 4) / kExpandThreads; ++i) {
    const int idx = threadIdx.x + i * kExpandThreads, r = idx >> 4, q = idx & 15;
    if (r / kTileM < t_lo || r / kTileM >= t_hi || q >= 4 * ksteps) continue;
    const int j0 = kt * kMmaBK + q * 4;
    float f[4] = {0.f, 0.f, 0.f, 0.f};
    if (rows[r] >= 0 && j0 < rank) {
      sum_planes4(f, v + static_cast<int64_t>(rows[r]) * p.N + vcol0 + j0, p.split_stride, p.splits);
#pragma unroll
      for (int e = 0; e < 4; ++e) f[e] = j0 + e < rank ? f[e] : 0.f;
    }
    Pack<T, 4> t;
#pragma unroll
    for (int e = 0; e < 4; ++e) t.v[e] = from_float<T>(f[e]);
    *reinterpret_cast<Pack<T, 4>*>(vs + swz(r, q >> 1) + (q & 1) * 4) = t;
  }
}

// out tile += scale * acc (each warp with its tile's slot) in shared memory, then 16-byte stores of the LoRA rows.
template <typename T>
__device__ __forceinline__ void tall_epilogue(const WarpAcc<1, 8>& acc, T* out_sm, T* out, const ExpandArgs& p,
                                              const TallGroup& g, int n0, int n_end) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tile = warp >> 1;
  if (g.slot[tile] >= 0) {
    const float scale = p.scalings[g.slot[tile]];
    for_each_acc_pair(acc, tile * kTileM, (warp & 1) * 64, lane, [&](int r, int c, float lo, float hi) {
      if (g.rows[r] < 0 || n0 + c >= n_end) return;
      T* o = out_sm + r * kExpandOutLd + c;
      const Pack<T, 2> old = *reinterpret_cast<const Pack<T, 2>*>(o);
      store_pair(o, expand_out(to_float(old.v[0]), scale, lo), expand_out(to_float(old.v[1]), scale, hi));
    });
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < (kTallM * kExpandBN / 8) / kExpandThreads; ++i) {
    const int idx = threadIdx.x + i * kExpandThreads, r = idx >> 4, c = idx & 15;
    if (g.rows[r] >= 0 && n0 + c * 8 < n_end)
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(g.rows[r]) * p.out_total + n0 + c * 8) =
          *reinterpret_cast<const uint4*>(out_sm + r * kExpandOutLd + c * 8);
  }
}

// Where an item writes: its first group tile, columns [n0, n_end) of the slice that starts at v column vcol0.
struct TallCols {
  int t0, n0, n_end, vcol0;
};

__device__ __forceinline__ TallCols tall_cols(const ExpandArgs& p, int item) {
  const int ct = item % p.n_tiles, sl = slice_of(p, ct);
  return TallCols{item / p.n_tiles * kTallTiles, pick(p.offsets, sl) + (ct - pick(p.tile_start, sl)) * kExpandBN,
                  pick(p.offsets, sl + 1), sl * p.R};
}

// One item whose out tile is already requested into out_sm: for each run of tiles with one slot, its rank slabs
// (B slab, v rows of the run, the run's warps' MMAs), then the epilogue. The next item's out tile (next_g and
// next_c; next_g == nullptr: none) is requested into next_out after this item's first B slab, so that its loads fly
// while this item computes and stores (cp.async groups complete in order: the first slab waits with one group left).
template <typename T, typename V>
__device__ __forceinline__ void tall_item(const V* v, const T* b, T* out, const ExpandArgs& p, const TallGroup& g,
                                          const TallCols& ic, T* out_sm, T* vs, T* bs, const TallGroup* next_g,
                                          const TallCols& next_c, T* next_out) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tile = warp >> 1;
  const bool warp_live = ic.n0 + (warp & 1) * 64 < ic.n_end;
  WarpAcc<1, 8> acc;
  zero_acc(acc);
  bool live = false;
  for (int lo = 0; lo < kTallTiles;) {  // block-uniform: g is in shared memory
    int hi = lo + 1;
    while (hi < kTallTiles && g.slot[hi] == g.slot[lo]) ++hi;
    const int slot = g.slot[lo], rank = g.rank[lo];
    for (int kt = 0; slot >= 0 && kt * kMmaBK < rank; ++kt) {
      const int ksteps = min(4, (rank - kt * kMmaBK + 15) / 16);
      tall_load_b(bs, b, p, slot, rank, ic.n0, ic.n_end, kt, ksteps);
      cp_async_commit();
      const bool first = !live && next_g;
      if (first) {
        tall_load_out(next_out, out, p, next_g->rows, next_c.n0, next_c.n_end);
        cp_async_commit();
      }
      live = true;
      tall_fill_v(vs, v, p, g.rows, ic.vcol0, rank, lo, hi, kt, ksteps);
      if (first)
        cp_async_wait<1>();
      else
        cp_async_wait<0>();
      __syncthreads();  // vs, bs and this item's out tile are complete
      if (warp_live && tile >= lo && tile < hi)
        warp_mma_slab<T, 1, 8>(acc, vs, bs, tile * kTileM, (warp & 1) * 64, ksteps, lane);
      __syncthreads();  // vs and bs are refilled by the next slab or run
    }
    lo = hi;
  }
  if (!live && next_g) {  // no LoRA rows here: still request the next tile
    tall_load_out(next_out, out, p, next_g->rows, next_c.n0, next_c.n_end);
    cp_async_commit();
  }
  if (live) tall_epilogue(acc, out_sm, out, p, g, ic.n0, ic.n_end);
}

// A persistent grid: each CTA walks items blockIdx.x, + gridDim.x, ... with two out tiles and two groups in shared
// memory, item i computing while item i + 1's out tile loads.
template <typename T, typename V>
__global__ void __launch_bounds__(kExpandThreads, 2)
    sgmv_expand_tall_kernel(const V* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* out_sm[2] = {reinterpret_cast<T*>(smem_raw), reinterpret_cast<T*>(smem_raw) + kTallM * kExpandOutLd};
  T* vs = out_sm[1] + kTallM * kExpandOutLd;  // [kTallM * kMmaBK]
  T* bs = vs + kTallM * kMmaBK;               // [kExpandBN * kMmaBK]
  __shared__ TallGroup g[2];
  griddep_launch_dependents();
  bool waited = false;
  const int n = num_tiles(p.w);
  const int total = (n + kTallTiles - 1) / kTallTiles * p.n_tiles;
  int item = blockIdx.x, c = 0;
  TallCols ic = tall_cols(p, item);
  if (item < total) {
    tall_fill_group(g[0], p.w, ic.t0, n, p.R);
    __syncthreads();
    wait_once(waited);  // v and out are written by earlier kernels
    tall_load_out(out_sm[0], out, p, g[0].rows, ic.n0, ic.n_end);
    cp_async_commit();
  }
  for (; item < total; item += gridDim.x, c ^= 1) {
    const int next = item + gridDim.x;
    const TallCols nc = tall_cols(p, next);
    __syncthreads();  // the item before is done with g[c ^ 1] and out_sm[c ^ 1]
    if (next < total) tall_fill_group(g[c ^ 1], p.w, nc.t0, n, p.R);
    __syncthreads();
    tall_item<T, V>(v, b, out, p, g[c], ic, out_sm[c], vs, bs, next < total ? &g[c ^ 1] : nullptr, nc,
                    out_sm[c ^ 1]);
    ic = nc;
  }
  wait_once(waited);  // as sgmv_expand_mma_kernel: the stream's next kernel must not overtake the producer
}

template <typename T, typename V>
cudaError_t launch_expand_tall(const V* v, const T* b, T* out, const ExpandArgs& p, const LaunchCfg& cfg) {
  return launch_kernel<sgmv_expand_tall_kernel<T, V>>(cfg, kExpandThreads, kTallSmemBytes, v, b, out, p);
}

}  // namespace lora_kernels
