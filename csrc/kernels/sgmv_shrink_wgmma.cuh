// The prefill shrink on Hopper's warpgroup MMA (sm_90a; ops/sgmv_plan.h picks it from kPrefillRows rows):
//   v[row, c] = sum_k x[row, k] * lora_a[slot, c, k]   for c % R < rank, else 0      (c < N = S*R)
// An item is a group of kWgTiles work-list tiles (64 rows) x 64 columns of v, one warpgroup (4 warps) a CTA, numbered
// column tile first (the column tiles of a group run side by side and share x's reads in L2). It runs every K split
// of the block in turn through one ST-stage cp.async pipeline over the whole K axis, once per run of tiles with one
// slot (the other rows zero-filled), and adds each split's chain to a running sum in split order: the split
// reduction's sums, as the mma.sync kernel's FOLD form makes them (kernels/sgmv_shrink_mma.cuh).
// Why: the mma.sync kernel moves every operand through ldmatrix, 3 shared-memory reads of 512 bytes a warp per 4 MMAs;
// ncu had the r64 prefill shrinks at half of Triton's throughput a CTA (qkv 101 us against 67). wgmma reads both
// operands from the swizzled stages itself: qkv 48 us, the r64 layer 970 -> 894 us, r16 765 -> 762 (ops/sgmv_plan.h
// and bench/RESULTS.md have the figures).
// Bits: each k16 step is one m64n64k16 wgmma, whose per-element sum is that of an m16n8k16 mma.sync (the GPU tests
// compare these rows with those of the decode kernels bit for bit), over the same k16 steps in the same order (zero
// rows past the tile, the rank and K add exact zeros), the splits folded in order from 0.
// Raw pointers only; no torch headers.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/sgmv_shrink_mma.cuh"
#include "kernels/wgmma.cuh"

namespace lora_kernels {

constexpr int kWgTiles = 4, kWgRows = kTileM * kWgTiles, kWgCols = 64, kWgThreads = 128;
static_assert(kWgRows == 64 && ShrinkShape<4, kWgTiles>::bn == kWgCols, "one warpgroup: 64 x 64 blocks");
constexpr int kWgStageBytes = (kWgRows + kWgCols) * kMmaBK * 2;

// Dynamic shared memory of ST stages, with room to align them to 1024 bytes (the swizzle's period).
template <int ST>
constexpr int shrink_wgmma_smem_bytes() { return ST * kWgStageBytes + 1024; }

// The warp's accumulators of one block to v: d[4 j + e] is row 16 warp + lane / 4 + 8 (e / 2), column
// n0 + 8 j + 2 (lane % 4) + e % 2.
template <typename V>
__device__ __forceinline__ void shrink_wgmma_store(const float (&d)[32], V* v, const ShrinkArgs& p, const int* rows_sm,
                                                   int n0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = rows_sm[16 * warp + (lane >> 2) + 8 * h];
      const int col = n0 + 8 * j + 2 * (lane & 3);
      if (row < 0 || col >= p.N) continue;
      V* dst = v + row * p.N + col;
      dst[0] = from_float<V>(d[4 * j + 2 * h]);
      if (col + 1 < p.N) dst[1] = from_float<V>(d[4 * j + 2 * h + 1]);
    }
}

// Slab kt's turn in a K loop whose copies run AHEAD slabs ahead: wait until slab kt landed (AHEAD - 1 copy groups
// may stay in flight), make the copies visible to wgmma and every thread past the barrier, then issue slab
// kt + AHEAD's copies into its stage (one commit group a slab, empty past KT).
template <int ST, int AHEAD, typename LoadW, typename LoadX>
__device__ __forceinline__ void wgmma_slab_turn(int kt, int KT, LoadW& load_w, LoadX& load_x) {
  cp_async_wait<AHEAD - 1>();
  fence_proxy_async();  // this thread's cp.async writes, before wgmma reads them
  __syncthreads();      // slab kt landed for all threads; the MMAs that read slab kt + AHEAD's stage are done
  const int nk = kt + AHEAD;
  if (nk < KT) {
    load_w(nk % ST, nk);
    load_x(nk % ST, nk);
  }
  cp_async_commit();
}

// The K loop with one wgmma group in flight (from kWgAsyncStages stages): slab kt's MMAs overlap slab kt + 1's wait,
// barrier and copies. A stage is refilled once every warp has passed the wait that retired its MMAs (the next
// iteration's barrier), so the copies run ST - 2 slabs ahead instead of ST - 1. Each split's chain is a loop of its
// own whose first MMA has the accumulator's input off: no other instruction writes acc while a wgmma on it may be in
// flight and every back edge sees one state (a zeroing of acc, or a fold inside the loop, made ptxas wait for the MMAs
// at the merge: warning C7517). The same MMAs in the same order, the same bits (a chain that starts from an ignored
// accumulator differs from one that starts at +0 only by the sign of a zero, and the fold adds it to a sum from +0).
// H100, layer us at prefill 8x1024 (bench_kernels, two orders in each of two calls): r16 701-703 -> 695-696, r64
// 872-874 -> 870-872; at 4 stages (3 CTAs an SM: two slabs ahead) r64 877 against 874, hence not there; 10 or 12
// stages for one CTA an SM: 694-696 / 870-871 (no gain).
constexpr int kWgAsyncStages = 6;
template <typename T, int ST, typename LoadW, typename LoadX>
__device__ __forceinline__ void wgmma_async_chains(float (&acc)[32], float (&sum)[32], const T* xs, const T* wt,
                                                   LoadW&& load_w, LoadX&& load_x, int KT, int fold_slabs) {
  for (int k0 = 0; k0 < KT; k0 += fold_slabs) {
    const int k1 = min(k0 + fold_slabs, KT);
    for (int kt = k0; kt < k1; ++kt) {
      wgmma_slab_turn<ST, ST - 2>(kt, KT, load_w, load_x);  // slab kt - 2's MMAs are done (every warp waited)
      const T* xst = xs + (kt % ST) * kWgRows * kMmaBK;
      const T* wst = wt + (kt % ST) * kWgCols * kMmaBK;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kMmaBK / 16; ++ks)
        wgmma_64x64x16_scaled<T>(acc, wgmma_desc(xst + 16 * ks), wgmma_desc(wst + 16 * ks), ks > 0 || kt > k0);
      wgmma_commit();
      wgmma_wait<1>();  // slab kt - 1's MMAs
    }
    wgmma_wait<0>();
    wgmma_fence_regs(acc);
#pragma unroll
    for (int i = 0; i < 32; ++i) sum[i] += acc[i];
  }
}

// The K loop below kWgAsyncStages stages: each slab's MMAs waited for before the next slab's wait, barrier and copies.
template <typename T, int ST, typename LoadW, typename LoadX>
__device__ __forceinline__ void wgmma_sync_chains(float (&acc)[32], float (&sum)[32], const T* xs, const T* wt,
                                                  LoadW&& load_w, LoadX&& load_x, int KT, int fold_slabs) {
  for (int kt = 0; kt < KT; ++kt) {
    wgmma_slab_turn<ST, ST - 1>(kt, KT, load_w, load_x);  // slab kt - 1's MMAs are done (waited below)
    const T* xst = xs + (kt % ST) * kWgRows * kMmaBK;
    const T* wst = wt + (kt % ST) * kWgCols * kMmaBK;
    wgmma_fence_regs(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kMmaBK / 16; ++ks)
      wgmma_64x64x16<T>(acc, wgmma_desc(xst + 16 * ks), wgmma_desc(wst + 16 * ks));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_regs(acc);
    if ((kt + 1) % fold_slabs == 0 || kt + 1 == KT) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        sum[i] += acc[i];
        acc[i] = 0.f;
      }
    }
  }
}

// One block: the pipeline over the whole K axis, the splits folded (fold_slabs slabs each), then the store.
template <typename T, typename V, int ST>
__device__ __forceinline__ void shrink_wgmma_block(const T* x, const T* a, V* v, const ShrinkArgs& p,
                                                   const TileInfo& ti, const int* rows_sm, T* xs, T* wt, int n0,
                                                   bool& waited) {
  using S = ShrinkShape<4, kWgTiles>;
  float acc[32], sum[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = sum[i] = 0.f;
  if (ti.slot >= 0) {
    const ShrinkCopy<T, 4, kWgTiles> cp = shrink_copy_plan<T, 4, kWgTiles>(x, a, p, ti, rows_sm, n0, 0);
    const int chunk = threadIdx.x & 7, K = p.K, KT = (K + kMmaBK - 1) / kMmaBK;
    const int fold_slabs = p.k_chunk / kMmaBK;
    auto load_w = [&](int stage, int kt) {
      shrink_load_slab<T, S::w_copies, S::row_step>(wt + stage * kWgCols * kMmaBK, cp.w, cp.wok, a, kt * kMmaBK,
                                                    kt * kMmaBK + chunk * 8 < K);
    };
    auto load_x = [&](int stage, int kt) {
      shrink_load_slab<T, S::x_copies, S::row_step>(xs + stage * kWgRows * kMmaBK, cp.x, cp.xok, x, kt * kMmaBK,
                                                    kt * kMmaBK + chunk * 8 < K);
    };
    constexpr bool async = ST >= kWgAsyncStages;
    shrink_prologue<async ? ST - 1 : ST>(load_w, load_x, KT, waited);  // ST - 2 or ST - 1 slabs ahead
    if constexpr (async) {
      wgmma_async_chains<T, ST>(acc, sum, xs, wt, load_w, load_x, KT, fold_slabs);
      cp_async_wait<0>();
      wait_once(waited);
      shrink_wgmma_store<V>(sum, v, p, rows_sm, n0);
      return;
    } else {
      wgmma_sync_chains<T, ST>(acc, sum, xs, wt, load_w, load_x, KT, fold_slabs);
      cp_async_wait<0>();
    }
  }
  wait_once(waited);
  shrink_wgmma_store<V>(sum, v, p, rows_sm, n0);
}

template <typename T, typename V, int ST>
__global__ void __launch_bounds__(kWgThreads)
    sgmv_shrink_wgmma_kernel(const T* __restrict__ x, const T* __restrict__ a, V* __restrict__ v, ShrinkArgs p) {
#if WGMMA_ENABLED
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw + swizzle_pad(smem_raw));  // [stages][64 * kMmaBK]
  T* wt = xs + ST * kWgRows * kMmaBK;                               // [stages][64 * kMmaBK]
  __shared__ int rows_sm[kWgRows];
  __shared__ TileInfo tis[kWgTiles];
  griddep_launch_dependents();
  bool waited = false;
  const int tiles = num_tiles(p.w);
  const int total = (tiles + kWgTiles - 1) / kWgTiles * p.n_tiles;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const int n0 = item % p.n_tiles * kWgCols, t0 = item / p.n_tiles * kWgTiles;
    for_each_slot_run<kWgTiles>(
        tis, rows_sm, p.w, p.R, tiles, t0, [](const TileInfo&) { return false; },
        [&](const TileInfo& ti) { shrink_wgmma_block<T, V, ST>(x, a, v, p, ti, rows_sm, xs, wt, n0, waited); });
  }
  wait_once(waited);  // every CTA waits before it exits: see sgmv_expand_mma_kernel
#endif
}

// items: the item count the work list's capacity makes; sms: the device's SMs. The grid is what the SMs hold at once
// (the occupancy API), never more than the items.
template <typename T, typename V, int ST>
cudaError_t launch_shrink_wgmma(const T* x, const T* a, V* v, const ShrinkArgs& p, LaunchCfg cfg, int64_t items,
                                int sms) {
  constexpr int smem = shrink_wgmma_smem_bytes<ST>();
  const int per_sm = resident_ctas_per_sm<sgmv_shrink_wgmma_kernel<T, V, ST>>(kWgThreads, smem);
  if (per_sm <= 0) return cudaErrorInvalidConfiguration;
  cfg.grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, int64_t{per_sm} * sms)));
  return launch_kernel<sgmv_shrink_wgmma_kernel<T, V, ST>>(cfg, kWgThreads, smem, x, a, v, p);
}

}  // namespace lora_kernels
