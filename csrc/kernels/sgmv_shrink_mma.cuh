// Tensor-core shrink over the work list (fp16/bf16; in_dim % 8 == 0; x and lora_a 16-byte aligned):
//   v[row, c] = sum_k x[row, k] * lora_a[slot, c, k]   for c % R < rank, else 0      (c < N = S*R)
// Item (group of MT work-list tiles, column tile nt, K split ks) of a persistent grid: a 16 MT x 16 W block of the
// group's rows and columns over the split's K range, through an ST-stage cp.async pipeline, once per run of tiles
// with one slot (the other rows masked); W warps side by side, each all 16 MT rows x 16 columns, its MMA chain over
// the split's k16 steps in order whatever W, ST and MT (ops/sgmv_plan.h picks them by the batch: the bits stay). MT = 2
// at prefill: one weight slab serves 32 rows instead of 16 (a prefill segment is many tiles of one slot). splits == 1:
// the item writes v. splits > 1: it writes its fp32 partial sums to plane ks of ws, and a later kernel sums the planes
// in plane order (the batch-invariant reduction: the split count comes from the shapes alone, see ops/sgmv_plan.h);
// or, FOLD (prefill), one item runs every split of its block in turn through one pipeline over the whole K axis, adds
// each split's chain to a running sum in split order (the reduction's sums, bit for bit) and writes v: no planes, no
// reduction kernel, and enough items to fill the GPU at prefill.
// Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "kernels/mma_tile.cuh"

namespace lora_kernels {

constexpr int kShrinkStages = 4;
// A CTA of W warps: a column tile of 16 W columns; ST pipeline stages.
template <int W, int ST, int MT>
constexpr int shrink_smem_bytes() { return ST * (kTileM * MT + kWarpN * W) * kMmaBK * 2; }
template <int W, int MT>
struct ShrinkShape {
  static constexpr int threads = 32 * W, bn = kWarpN * W, bm = kTileM * MT;
  static constexpr int row_step = threads / 8;  // rows between a thread's copies (8 16-byte chunks a row)
  static constexpr int x_copies = bm * 8 / threads, w_copies = bn * 8 / threads;
  static_assert(x_copies * threads == bm * 8 && w_copies * threads == bn * 8, "copies cover the tiles exactly");
};

// Where each thread copies from: chunk (tid & 7) of rows (tid >> 3) + 4 W i of the x tile
// (i < x_copies) and of the weight tile (i < w_copies), from the split's first K element;
// masked rows (past the tile, columns at or past the rank) are zero-filled by cp.async, so they
// contribute exact zeros.
template <typename T, int W, int MT>
struct ShrinkCopy {
  const T* x[ShrinkShape<W, MT>::x_copies];
  const T* w[ShrinkShape<W, MT>::w_copies];
  bool xok[ShrinkShape<W, MT>::x_copies], wok[ShrinkShape<W, MT>::w_copies];
};

template <typename T, int W, int MT>
__device__ __forceinline__ ShrinkCopy<T, W, MT> shrink_copy_plan(const T* x, const T* a, const ShrinkArgs& p,
                                                                 const TileInfo& ti, const int* rows_sm, int n0,
                                                                 int kbeg) {
  using S = ShrinkShape<W, MT>;
  ShrinkCopy<T, W, MT> cp;
  const int chunk = threadIdx.x & 7;
#pragma unroll
  for (int i = 0; i < S::x_copies; ++i) {
    const int r = (threadIdx.x >> 3) + i * S::row_step;
    cp.xok[i] = rows_sm[r] >= 0;
    cp.x[i] = x + static_cast<int64_t>(cp.xok[i] ? rows_sm[r] : 0) * p.K + kbeg + chunk * 8;
  }
#pragma unroll
  for (int i = 0; i < S::w_copies; ++i) {
    const int n = n0 + (threadIdx.x >> 3) + i * S::row_step;
    cp.wok[i] = n < p.N && n % p.R < ti.rank;
    cp.w[i] = a + (static_cast<int64_t>(ti.slot) * p.N + (cp.wok[i] ? n : 0)) * p.K + kbeg + chunk * 8;
  }
  return cp;
}

// One slab of a tile into stage `dst`: the thread's COPIES chunks (chunk tid & 7 of rows (tid >> 3) + ROW_STEP i,
// swizzled), each from src[i] + k0 where ok[i] and kok (the chunk lies before the K range's end), else zero-filled
// (from `fallback`, of which no byte is read).
template <typename T, int COPIES, int ROW_STEP>
__device__ __forceinline__ void shrink_load_slab(T* dst, const T* const (&src)[COPIES], const bool (&ok)[COPIES],
                                                 const T* fallback, int k0, bool kok) {
  const int tid = threadIdx.x, chunk = tid & 7;
#pragma unroll
  for (int i = 0; i < COPIES; ++i) {
    const bool o = ok[i] && kok;
    cp_async16(dst + swz((tid >> 3) + i * ROW_STEP, chunk), o ? src[i] + k0 : fallback, o ? 16 : 0);
  }
}

// The first ST - 1 slabs of a pipeline of KT: the weight slabs first, before griddep_wait (no kernel writes the
// weights), then x's after it, one commit group a slab (group 0 also holds every early weight slab).
template <int ST, typename LoadW, typename LoadX>
__device__ __forceinline__ void shrink_prologue(LoadW&& load_w, LoadX&& load_x, int KT, bool& waited) {
#pragma unroll
  for (int s = 0; s < ST - 1; ++s)
    if (s < KT) load_w(s, s);
  wait_once(waited);
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < KT) load_x(s, s);
    cp_async_commit();
  }
}

// The item's MT work-list tiles from t0 cut into runs of consecutive tiles with one slot (tis: MT entries of shared
// memory). For each run that skip(ti) keeps, rows_sm (16 MT entries) holds the run's physical rows and -1 for the
// item's other rows, and block(ti) runs with the run's first tile. Block-uniform: every thread of the CTA calls it.
template <int MT, typename Skip, typename Block>
__device__ __forceinline__ void for_each_slot_run(TileInfo* tis, int* rows_sm, const WorkArgs& w, int R, int tiles,
                                                  int t0, Skip&& skip, Block&& block) {
  __syncthreads();  // the previous item is done with tis, rows_sm and the pipeline buffers
  if (threadIdx.x < MT)
    tis[threadIdx.x] = t0 + threadIdx.x < tiles ? load_tile(w, t0 + threadIdx.x, R) : TileInfo{-1, 0, 0, 0};
  __syncthreads();
  for (int lo = 0; lo < MT;) {  // tis is in shared memory: the runs are the same in every thread
    int hi = lo + 1;
    while (hi < MT && tis[hi].slot == tis[lo].slot) ++hi;
    const TileInfo ti = tis[lo];
    const int run_lo = lo;
    lo = hi;
    if (skip(ti)) continue;
    if (run_lo > 0) __syncthreads();  // the previous run is done with rows_sm and the pipeline buffers
    if (threadIdx.x < kTileM * MT) {
      const int t = threadIdx.x / kTileM;
      rows_sm[threadIdx.x] = t >= run_lo && t < hi ? tile_row(w, tis[t], threadIdx.x % kTileM) : -1;
    }
    __syncthreads();
    block(ti);
  }
}

// acc = the warp's block of x_tile * w_tile^T over K range [kbeg, kend). The weight slabs of the first
// stages are requested before griddep_wait (no kernel writes weights); x only after it.
// FOLD: [kbeg, kend) is the whole K axis; after the last slab of each split (fold_slabs slabs) acc is added to sum
// and zeroed, so sum = ((0 + split 0) + split 1) + ..., the split reduction's order, and each split's MMA chain starts
// from zeros as in its own item.
template <typename T, int W, int ST, int MT, bool FOLD>
__device__ __forceinline__ void shrink_pipeline(WarpAcc<MT, kWarpNT>& acc, WarpAcc<MT, kWarpNT>& sum,
                                                const ShrinkCopy<T, W, MT>& cp, const T* x, const T* a, T* xs, T* wt,
                                                int kbeg, int kend, int fold_slabs, bool warp_live, bool& waited) {
  using S = ShrinkShape<W, MT>;
  constexpr int BK = kMmaBK, BM = S::bm, BN = S::bn;
  const int KT = kend > kbeg ? (kend - kbeg + BK - 1) / BK : 0;
  const int tid = threadIdx.x, chunk = tid & 7, lane = tid & 31, warp = tid >> 5;
  constexpr int kRowStep = S::row_step;
  auto load_w = [&](int stage, int kt) {
    shrink_load_slab<T, S::w_copies, kRowStep>(wt + stage * BN * BK, cp.w, cp.wok, a, kt * BK,
                                               kbeg + kt * BK + chunk * 8 < kend);
  };
  auto load_x = [&](int stage, int kt) {
    shrink_load_slab<T, S::x_copies, kRowStep>(xs + stage * BM * BK, cp.x, cp.xok, x, kt * BK,
                                               kbeg + kt * BK + chunk * 8 < kend);
  };
  shrink_prologue<ST>(load_w, load_x, KT, waited);
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // slab kt landed for all threads; slab kt-1 is free to overwrite
    const int nk = kt + ST - 1;
    if (nk < KT) {
      load_w(nk % ST, nk);
      load_x(nk % ST, nk);
    }
    cp_async_commit();
    if (warp_live) {
      warp_mma_slab<T, MT, kWarpNT>(acc, xs + (kt % ST) * BM * BK, wt + (kt % ST) * BN * BK, 0, warp * kWarpN, 4,
                                    lane);
      if (FOLD && ((kt + 1) % fold_slabs == 0 || kt + 1 == KT)) add_acc(sum, acc);
    }
  }
  cp_async_wait<0>();
}

// Writes the item's block: v (to_planes false, every column < N) or plane ks of ws.
template <typename V, int MT>
__device__ __forceinline__ void shrink_store(const WarpAcc<MT, kWarpNT>& acc, V* v, float* ws, const ShrinkArgs& p,
                                             const int* rows_sm, int n0, int ks, bool to_planes) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for_each_acc_pair(acc, 0, warp * kWarpN, lane, [&](int r, int c, float lo, float hi) {
    const int64_t row = rows_sm[r];
    const int col = n0 + c;
    if (row < 0 || col >= p.N) return;
    if (!to_planes) {
      V* dst = v + row * p.N + col;
      dst[0] = from_float<V>(lo);
      if (col + 1 < p.N) dst[1] = from_float<V>(hi);
    } else {
      float* dst = ws + ks * p.split_stride + row * p.N + col;
      dst[0] = lo;
      if (col + 1 < p.N) dst[1] = hi;
    }
  });
}

// One block (a run of the item's tiles with one slot, rows_sm filled): its pipeline over the split's K range (FOLD:
// every split in turn) and its store.
template <typename T, typename V, int W, int ST, int MT, bool FOLD>
__device__ __forceinline__ void shrink_block(const T* x, const T* a, V* v, float* ws, const ShrinkArgs& p,
                                             const TileInfo& ti, const int* rows_sm, T* xs, T* wt, int n0, int ks,
                                             bool to_planes, bool& waited) {
  WarpAcc<MT, kWarpNT> acc, sum;
  zero_acc(acc);
  if constexpr (FOLD) zero_acc(sum);
  if (ti.slot >= 0) {
    const int kbeg = FOLD ? 0 : ks * p.k_chunk, kend = FOLD ? p.K : min(p.K, kbeg + p.k_chunk);
    const ShrinkCopy<T, W, MT> cp = shrink_copy_plan<T, W, MT>(x, a, p, ti, rows_sm, n0, kbeg);
    const bool warp_live = n0 + (threadIdx.x >> 5) * kWarpN < p.N;
    shrink_pipeline<T, W, ST, MT, FOLD>(acc, sum, cp, x, a, xs, wt, kbeg, kend, p.k_chunk / kMmaBK, warp_live,
                                        waited);
  }
  wait_once(waited);
  if constexpr (FOLD) shrink_store<V, MT>(sum, v, ws, p, rows_sm, n0, ks, false);
  else shrink_store<V, MT>(acc, v, ws, p, rows_sm, n0, ks, to_planes);
}

template <typename T, typename V, int W, int ST, int MT, bool FOLD>
__global__ void __launch_bounds__(32 * W)
    sgmv_shrink_mma_kernel(const T* __restrict__ x, const T* __restrict__ a, V* __restrict__ v,
                           float* __restrict__ ws, ShrinkArgs p) {
  using S = ShrinkShape<W, MT>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);  // [stages][16 MT * kMmaBK]
  T* wt = xs + ST * S::bm * kMmaBK;        // [stages][16 W * kMmaBK]
  __shared__ int rows_sm[S::bm];
  griddep_launch_dependents();
  bool waited = false;
  const int splits = FOLD ? 1 : p.splits;  // items per (group, column tile)
  const bool to_planes = !FOLD && p.splits > 1;
  const int per_group = p.n_tiles * splits, tiles = num_tiles(p.w);
  const int total = (tiles + MT - 1) / MT * per_group;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const int ks = item % splits, n0 = (item / splits) % p.n_tiles * S::bn, t0 = item / per_group * MT;
    if constexpr (MT == 1) {
      // Decode: the tile's loads go out before the barrier, and no run loop: with a warp or two per CTA and one item
      // each, the instructions before the first weight request are the kernel's latency. The run loop's form of this
      // path (7e289cc) cost r64 bs1 26.1 -> 28.5 us a layer, r16 19.6 -> 20.6 (H100, bench_kernels, one call).
      const TileInfo ti = load_tile(p.w, t0, p.R);
      __syncthreads();  // the previous item is done with rows_sm and the pipeline buffers
      fill_tile_rows(rows_sm, p.w, ti);
      __syncthreads();
      if (ti.slot < 0 && to_planes) continue;  // no partials: the reduction writes the zeros of rows without LoRA
      shrink_block<T, V, W, ST, MT, FOLD>(x, a, v, ws, p, ti, rows_sm, xs, wt, n0, ks, to_planes, waited);
    } else {
      __shared__ TileInfo tis[MT];
      for_each_slot_run<MT>(
          tis, rows_sm, p.w, p.R, tiles, t0,
          // no partials: the reduction writes the zeros of rows without LoRA
          [&](const TileInfo& ti) { return ti.slot < 0 && to_planes; },
          [&](const TileInfo& ti) {
            shrink_block<T, V, W, ST, MT, FOLD>(x, a, v, ws, p, ti, rows_sm, xs, wt, n0, ks, to_planes, waited);
          });
    }
  }
  wait_once(waited);  // every CTA waits before it exits: see sgmv_expand_mma_kernel
}

template <typename T, typename V, int W, int ST, int MT = 1, bool FOLD = false>
cudaError_t launch_shrink_shape(const T* x, const T* a, V* v, float* ws, const ShrinkArgs& p, const LaunchCfg& cfg) {
  return launch_kernel<sgmv_shrink_mma_kernel<T, V, W, ST, MT, FOLD>>(cfg, 32 * W, shrink_smem_bytes<W, ST, MT>(), x,
                                                                      a, v, ws, p);
}

// The CTA shapes ops/sgmv_plan.h picks (plan_shrink): 4 warps x 4 stages, 2 x 4, one warp x 8 stages; at prefill
// 4 warps x 8 stages over groups of 2 tiles, the splits folded in the item wherever there are several.
template <typename T, typename V>
cudaError_t launch_shrink_mma(const T* x, const T* a, V* v, float* ws, const ShrinkArgs& p, const LaunchCfg& cfg,
                              int warps, int stages, int tiles, bool fold) {
  if (tiles == 2 && warps == 4 && stages == 8)
    return fold ? launch_shrink_shape<T, V, 4, 8, 2, true>(x, a, v, ws, p, cfg)
                : launch_shrink_shape<T, V, 4, 8, 2, false>(x, a, v, ws, p, cfg);
  if (tiles != 1 || fold) return cudaErrorInvalidConfiguration;
  if (warps == 1 && stages == 8) return launch_shrink_shape<T, V, 1, 8>(x, a, v, ws, p, cfg);
  if (warps == 1 && stages == 5) return launch_shrink_shape<T, V, 1, 5>(x, a, v, ws, p, cfg);  // LK_SHRINK_FIT
  if (warps == 2 && stages == kShrinkStages) return launch_shrink_shape<T, V, 2, kShrinkStages>(x, a, v, ws, p, cfg);
  if (warps == 4 && stages == kShrinkStages) return launch_shrink_shape<T, V, 4, kShrinkStages>(x, a, v, ws, p, cfg);
  return cudaErrorInvalidConfiguration;
}

}  // namespace lora_kernels
