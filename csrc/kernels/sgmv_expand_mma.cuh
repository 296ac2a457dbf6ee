// Tensor-core expand over the work list (fp16/bf16; R % 8 == 0; every slice offset % 8 == 0; lora_b, out
// 16-byte aligned; v aligned to 4 of its elements):
//   out[row, n] += scaling[slot] * sum_{j<rank} v[row, i*R + j] * lora_b[slot, n, j]     n in slice i
// Item (tile t, column tile ct) of a persistent grid; column tiles of kExpandBN columns are numbered
// over all slices (ExpandArgs::tile_start) and never cross a slice. W warps side by side (8 at one row, else 4), each
// all kTileM rows x kExpandBN / W columns. v is the sum of p.splits planes taken in plane order (the shrink's fp32
// partials inside sgmv_apply), then rounded to T for the MMA. The first weight slab is requested before griddep_wait;
// v and out after it. The epilogue adds scaling * acc to the out tile in shared memory and writes it back with 16-byte
// stores. Rows of slot -1 / rank-0 tiles are not touched. ONE_ROW (one row of out, ops/sgmv_plan.h): the row's
// planes are loaded by every thread row at once (one_row_planes), the same sums. Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "kernels/mma_tile.cuh"
#include "kernels/planes.cuh"

namespace lora_kernels {

constexpr int kExpandBN = 128, kExpandThreads = 256;
// From 2 rows the kernel runs 4-warp CTAs (32 columns a warp), 8 an SM: twice the items, and their B slabs, in flight
// of the 8-warp CTAs (4 an SM by their registers), which one row keeps (one_row_planes takes 256 threads). The same
// MMA chain per column: the same bits. H200, layer µs, sorted (bench_kernels, the same call; 8 warps x 4 CTAs -> 4 x 8
// -> 4 x 6): r64 16x1 uniform 68.8 -> 63.3 -> 61.6, 16x1 distinct 73.8 -> 66.5 -> 65.2, 64x1 uniform 120 -> 109 ->
// 111 (Triton 107), 256x1 uniform 162 -> 151 -> 148 (136), 256x1 identical 89.5 -> 78.6 -> 77.5, 16x1 identical 29.9
// -> 31.8 -> 32.3 (those 4 x 8 ran with 7 CTAs an SM resident, 70 registers, before the register bound).
constexpr int kExpandWarpsRows = 4, kExpandCtasPerSmRows = 8;
constexpr int kExpandOutLd = kExpandBN + 8;  // padded row: epilogue fragment accesses hit distinct banks
constexpr int kExpandSmemBytes = (kTileM * kExpandOutLd + (kTileM + kExpandBN) * kMmaBK) * 2;
static_assert(kExpandBN == kWarpN * (kExpandThreads / 32) && (kTileM * kExpandBN / 8) % kExpandThreads == 0 &&
                  (kTileM * kMmaBK / 4) % kExpandThreads == 0 && (kExpandBN * kMmaBK / 8) % kExpandThreads == 0,
              "copy and warp layouts cover the tiles exactly");

struct ExpandItem {
  TileInfo ti;
  int n0, n_end;  // output columns [n0, min(n0 + kExpandBN, n_end))
  int vcol0;      // first column of the slice in v
};

// Weight slab kt: rows n0.. of lora_b[slot], ranks [kt*64, kt*64 + 64), zero-filled past the rank.
template <typename T, int THREADS>
__device__ __forceinline__ void expand_load_b(T* bs, const T* b, const ExpandArgs& p, const ExpandItem& it, int kt) {
#pragma unroll
  for (int i = 0; i < (kExpandBN * kMmaBK / 8) / THREADS; ++i) {
    const int idx = threadIdx.x + i * THREADS, r = idx >> 3, c = idx & 7;
    const int n = it.n0 + r, j = kt * kMmaBK + c * 8;
    const int bytes = n < it.n_end ? max(0, min(16, (it.ti.rank - j) * 2)) : 0;
    cp_async16(bs + swz(r, c), bytes ? b + (static_cast<int64_t>(it.ti.slot) * p.out_total + n) * p.R + j : b, bytes);
  }
}

// The out tile of M rows (physical rows rows[r], -1: none) x the columns [n0, min(n0 + kExpandBN, n_end)) into
// out_sm (rows of kExpandOutLd), 16 bytes per copy. The 16-row kernel's tile and the tall kernel's 64-row one.
template <typename T, int M, int THREADS = kExpandThreads>
__device__ __forceinline__ void load_out_tile(T* out_sm, const T* out, int out_total, const int* rows, int n0,
                                              int n_end) {
#pragma unroll
  for (int i = 0; i < (M * kExpandBN / 8) / THREADS; ++i) {
    const int idx = threadIdx.x + i * THREADS, r = idx >> 4, c = idx & 15;
    if (rows[r] >= 0 && n0 + c * 8 < n_end)
      cp_async16(out_sm + r * kExpandOutLd + c * 8, out + static_cast<int64_t>(rows[r]) * out_total + n0 + c * 8, 16);
  }
}

// out_sm back to the same rows and columns, 16-byte stores.
template <typename T, int M, int THREADS = kExpandThreads>
__device__ __forceinline__ void store_out_tile(const T* out_sm, T* out, int out_total, const int* rows, int n0,
                                               int n_end) {
#pragma unroll
  for (int i = 0; i < (M * kExpandBN / 8) / THREADS; ++i) {
    const int idx = threadIdx.x + i * THREADS, r = idx >> 4, c = idx & 15;
    if (rows[r] >= 0 && n0 + c * 8 < n_end)
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(rows[r]) * out_total + n0 + c * 8) =
          *reinterpret_cast<const uint4*>(out_sm + r * kExpandOutLd + c * 8);
  }
}

// One row of out (ONE_ROW): f = the planes of tile row `first` (the batch's row) at this thread's quad, summed in plane
// order from 0 as sum_planes4 does. All 16 thread rows load its planes at once (staged in shared memory): one L2
// round trip instead of one per kPlaneBatch planes (32 planes at o and down, r16). H100, layer µs, same call: r16 bs1
// 22.2 (before) -> 20.3 with the planes in guarded batches; in a later call guarded batches 21.8, this 19.7; r64 bs1
// 27.4 -> 26.4 (batches), then 27.1 (batches) / 27.0 (this). Block-uniform; the caller's barrier orders the reads of
// `stage` before the next slab's writes.
constexpr int kOneRowPlanes = 32;  // max_splits (ops/sgmv_plan.h) at most
template <typename V>
__device__ __forceinline__ bool one_row_planes(float (&f)[4], const V* v, const ExpandArgs& p, const ExpandItem& it,
                                               const int* rows_sm, int j0) {
  __shared__ float4 stage[kOneRowPlanes][kTileM];
  int first = -1;
#pragma unroll
  for (int k = kTileM - 1; k >= 0; --k)
    if (rows_sm[k] >= 0) first = k;
  if (first < 0 || p.splits > kOneRowPlanes) return false;
  const int r = threadIdx.x >> 4, q = threadIdx.x & 15;
  const V* src = v + static_cast<int64_t>(rows_sm[first]) * p.N + it.vcol0 + j0;
  Pack<V, 4> pk[kOneRowPlanes / kTileM];
#pragma unroll
  for (int u = 0; u < kOneRowPlanes / kTileM; ++u)
    if (j0 < it.ti.rank && r + u * kTileM < p.splits) pk[u] = load_cg<V, 4>(src + (r + u * kTileM) * p.split_stride);
#pragma unroll
  for (int u = 0; u < kOneRowPlanes / kTileM; ++u)
    if (j0 < it.ti.rank && r + u * kTileM < p.splits)
      stage[r + u * kTileM][q] = make_float4(to_float(pk[u].v[0]), to_float(pk[u].v[1]), to_float(pk[u].v[2]),
                                             to_float(pk[u].v[3]));
  __syncthreads();
  if (r != first || j0 >= it.ti.rank) return false;  // (past the rank the caller writes zeros either way)
  for (int sp = 0; sp < p.splits; ++sp) {
    const float4 g = stage[sp][q];
    f[0] += g.x;
    f[1] += g.y;
    f[2] += g.z;
    f[3] += g.w;
  }
  return true;
}

// vs = v[rows, slice columns kt*64 .. +64] as T: the planes summed in order, 0 past the rank and for
// rows outside the tile. v is read through L2 only: an earlier grid wrote it.
template <typename T, typename V, bool ONE_ROW, int THREADS>
__device__ __forceinline__ void expand_fill_v(T* vs, const V* v, const ExpandArgs& p, const ExpandItem& it,
                                              const int* rows_sm, int kt) {
  static_assert(kTileM * kMmaBK / 4 % THREADS == 0 && (!ONE_ROW || THREADS == kTileM * kMmaBK / 4),
                "whole passes of one (row, quad) a thread; one row: a single pass");
#pragma unroll
  for (int pass = 0; pass < kTileM * kMmaBK / 4 / THREADS; ++pass) {
    const int r = (threadIdx.x >> 4) + pass * (THREADS >> 4), q = threadIdx.x & 15;
    const int j0 = kt * kMmaBK + q * 4;
    float f[4] = {0.f, 0.f, 0.f, 0.f};
    const int64_t row = rows_sm[r];
    bool done = false;
    if constexpr (ONE_ROW) done = one_row_planes(f, v, p, it, rows_sm, j0);
    if (row >= 0 && j0 < it.ti.rank) {
      if (!done) sum_planes4(f, v + row * p.N + it.vcol0 + j0, p.split_stride, p.splits);
#pragma unroll
      for (int e = 0; e < 4; ++e) f[e] = j0 + e < it.ti.rank ? f[e] : 0.f;
    }
    Pack<T, 4> t;
#pragma unroll
    for (int e = 0; e < 4; ++e) t.v[e] = from_float<T>(f[e]);
    *reinterpret_cast<Pack<T, 4>*>(vs + swz(r, q >> 1) + (q & 1) * 4) = t;
  }
}

// out tile += scale * acc in shared memory, then 16-byte stores of the covered rows.
template <typename T, int W>
__device__ __forceinline__ void expand_epilogue(const WarpAcc<1, kExpandBN / 8 / W>& acc, T* out_sm, T* out,
                                                const ExpandArgs& p, const ExpandItem& it, const int* rows_sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = p.scalings[it.ti.slot];
  for_each_acc_pair(acc, 0, warp * (kExpandBN / W), lane, [&](int r, int c, float lo, float hi) {
    if (rows_sm[r] < 0 || it.n0 + c >= it.n_end) return;
    T* o = out_sm + r * kExpandOutLd + c;
    const Pack<T, 2> old = *reinterpret_cast<const Pack<T, 2>*>(o);
    store_pair(o, expand_out(to_float(old.v[0]), scale, lo), expand_out(to_float(old.v[1]), scale, hi));
  });
  __syncthreads();
  store_out_tile<T, kTileM, 32 * W>(out_sm, out, p.out_total, rows_sm, it.n0, it.n_end);
}

template <typename T, typename V, bool ONE_ROW, int W>
__device__ __forceinline__ void expand_item_mma(const V* v, const T* b, T* out, const ExpandArgs& p,
                                                const ExpandItem& it, const int* rows_sm, T* out_sm, bool& waited) {
  constexpr int kWN = kExpandBN / W;  // columns of a warp
  T* vs = out_sm + kTileM * kExpandOutLd;  // [kTileM * kMmaBK]
  T* bs = vs + kTileM * kMmaBK;            // [kExpandBN * kMmaBK]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool warp_live = it.n0 + warp * kWN < it.n_end;
  const int KT = (it.ti.rank + kMmaBK - 1) / kMmaBK;
  WarpAcc<1, kWN / 8> acc;
  zero_acc(acc);
  for (int kt = 0; kt < KT; ++kt) {
    expand_load_b<T, 32 * W>(bs, b, p, it, kt);
    cp_async_commit();
    if (kt == 0) {
      wait_once(waited);  // v and out are written by earlier kernels
      load_out_tile<T, kTileM, 32 * W>(out_sm, out, p.out_total, rows_sm, it.n0, it.n_end);
      cp_async_commit();
    }
    expand_fill_v<T, V, ONE_ROW, 32 * W>(vs, v, p, it, rows_sm, kt);
    cp_async_wait<0>();
    __syncthreads();  // vs, bs (and the out tile) are complete
    if (warp_live)
      warp_mma_slab<T, 1, kWN / 8>(acc, vs, bs, 0, warp * kWN, min(4, (it.ti.rank - kt * kMmaBK + 15) / 16), lane);
    __syncthreads();  // vs and bs are refilled by the next slab
  }
  expand_epilogue<T, W>(acc, out_sm, out, p, it, rows_sm);
}

// W warps of kExpandBN / W columns each; the 4-warp form is held to 64 registers, so that kExpandCtasPerSmRows CTAs
// fit an SM (a minimum of 0 leaves the 8-warp form's code as it was).
template <typename T, typename V, bool ONE_ROW, int W>
__global__ void __launch_bounds__(32 * W, W == kExpandWarpsRows ? kExpandCtasPerSmRows : 0)
    sgmv_expand_mma_kernel(const V* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* out_sm = reinterpret_cast<T*>(smem_raw);  // [kTileM][kExpandOutLd], then vs and bs
  __shared__ int rows_sm[kTileM];
  griddep_launch_dependents();
  bool waited = false;
  const int total = num_tiles(p.w) * p.n_tiles;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    ExpandItem it;
    it.ti = load_tile(p.w, item / p.n_tiles, p.R);
    if (it.ti.slot < 0) continue;  // block-uniform
    const int ct = item % p.n_tiles, sl = slice_of(p, ct);
    it.n0 = tile_col0(p, sl, ct, kExpandBN);
    it.n_end = pick(p.offsets, sl + 1);
    it.vcol0 = sl * p.R;
    __syncthreads();  // the previous item is done with rows_sm and out_sm
    fill_tile_rows(rows_sm, p.w, it.ti);
    __syncthreads();
    expand_item_mma<T, V, ONE_ROW, W>(v, b, out, p, it, rows_sm, out_sm, waited);
  }
  // Every CTA waits on the producer before it exits: the stream's next kernel is ordered after this
  // grid only, so a grid that finished early (no LoRA rows) could otherwise let it overtake the shrink.
  wait_once(waited);
}

template <typename T, typename V>
cudaError_t launch_expand_mma(const V* v, const T* b, T* out, const ExpandArgs& p, const LaunchCfg& cfg,
                              bool one_row) {
  if (one_row)
    return launch_kernel<sgmv_expand_mma_kernel<T, V, true, kExpandThreads / 32>>(cfg, kExpandThreads,
                                                                                   kExpandSmemBytes, v, b, out, p);
  return launch_kernel<sgmv_expand_mma_kernel<T, V, false, kExpandWarpsRows>>(cfg, 32 * kExpandWarpsRows,
                                                                              kExpandSmemBytes, v, b, out, p);
}

}  // namespace lora_kernels
