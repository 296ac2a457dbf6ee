// The prefill expand on Hopper's warpgroup MMA (sm_90a), for the register expand's batches (R 17-64) where v is of
// out's dtype (ops/sgmv_expand.cu launches it in the regs plan's place; fp32 v and builds without sm_90a code keep the
// register expand):
//   out[row, n] += scaling[slot] * sum_{j<rank} v[row, i*R + j] * lora_b[slot, n, j]     n in slice i
// One CTA (one warpgroup) per item of kWxTiles work-list tiles (64 rows) x kWxBlocks column blocks of kRegsCols (64)
// columns of one slice (the register expand's column tiles, so the plan's tile_start serves both, in pairs), items
// numbered column item first. Per run of the item's tiles with one slot: B's 64 x 64 slab of each block (zero-filled
// past the rank and the slice) before griddep_wait, then the out rows (16-byte copies into a padded tile) and v's
// 64 x 64 slab (zero-filled past the rank, rows -1 skipped), then per block ceil(rank / 16) m64n64k16 wgmma from a
// zeroed accumulator, out = fma(scale, acc, out) in shared memory, and 16-byte stores of the tile. Why: the register
// expand spends ~900 instructions an item (16 rows) on fragments and copies, and sits at 52-56% of DRAM bandwidth on
// qkv, o and down at r64; wgmma reads both operands from shared memory itself.
// Layer µs at r64 prefill 8x1024 (bench A/B, H100, two orders in one call, 2026-11-28): register expand 871-872 ->
// this 807-808 (Triton 886); r16 unchanged (the flat expand). Bits equal to the register expand's in every module.
// Two column blocks an item (one v slab under two B slabs; 96 registers, 5 CTAs an SM; H200, thirty-fifth session,
// bench A/B in two orders): r64 prefill 687-688 -> 674-676 µs a layer; the expand alone (expand_rate_probe.py, 8192
// rows) gate_up 341 -> 323 µs (2.75 -> 2.90 TB/s of out read + written; a copy 220); four blocks (155 registers, 3
// CTAs) 721-725 (gate_up 348).
// Bits: each k16 step is an m64n64k16 wgmma, whose per-element sum is an m16n8k16 mma.sync's (the wgmma shrink's
// argument), over the k16 steps under the rank from +0 as the register expand's chain, and the same fma epilogue.
// Raw pointers only; no torch headers.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/sgmv_expand_regs.cuh"
#include "kernels/sgmv_shrink_mma.cuh"
#include "kernels/wgmma.cuh"

namespace lora_kernels {

constexpr int kWxTiles = 4, kWxRows = kTileM * kWxTiles, kWxCols = kRegsCols, kWxThreads = 128;
static_assert(kWxRows == 64 && kWxCols == 64 && kMmaBK == 64, "one m64n64 block, one 64-wide rank slab");
constexpr int kWxBlocks = 2;  // column blocks of kWxCols an item
// Padded out row (272 bytes): the epilogue's 4-byte accesses hit distinct banks.
constexpr int kWxOutLd = kWxBlocks * kWxCols + 8;
// v's slab, the B slabs (all 1024-byte aligned for the swizzle), the out tile; plus room to align.
constexpr int kWxSmemBytes = (1 + kWxBlocks) * 64 * kMmaBK * 2 + kWxRows * kWxOutLd * 2 + 1024;

// The slab of 64 rows x 64 ranks at dst (swizzled, K-major): row r from src_row(r) (nullptr: zero-filled), ranks
// past `rank` zero-filled. 4 copies a thread.
template <typename T, typename SrcRow>
__device__ __forceinline__ void wx_load_slab(T* dst, const T* fallback, int rank, SrcRow&& src_row) {
  const int chunk = threadIdx.x & 7;
#pragma unroll
  for (int i = 0; i < 64 * 8 / kWxThreads; ++i) {
    const int r = (threadIdx.x >> 3) + i * (kWxThreads / 8);
    const T* src = src_row(r);
    const int bytes = src ? max(0, min(16, (rank - chunk * 8) * 2)) : 0;
    cp_async16(dst + swz(r, chunk), bytes ? src + chunk * 8 : fallback, bytes);
  }
}

// acc (the warp's 16 rows x 64 columns, wgmma's layout) into column block `cb` of the out tile:
// out = fma(scale, acc, out) in shared memory.
template <typename T>
__device__ __forceinline__ void wx_epilogue(const float (&d)[32], T* os, int cb, float scale) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 16 * warp + (lane >> 2) + 8 * h, c = cb * kWxCols + 8 * j + 2 * (lane & 3);
      T* o = os + r * kWxOutLd + c;
      const Pack<T, 2> old = *reinterpret_cast<const Pack<T, 2>*>(o);
      store_pair(o, expand_out(to_float(old.v[0]), scale, d[4 * j + 2 * h]),
                 expand_out(to_float(old.v[1]), scale, d[4 * j + 2 * h + 1]));
    }
}

// The out tile's covered rows and columns, by 16-byte copies: into shared memory (cp.async) or back to out.
template <typename T, bool LOAD>
__device__ __forceinline__ void wx_out_copy(T* os, T* out, const ExpandArgs& p, const int* rows_sm, int n0,
                                            int n_end) {
  constexpr int kChunks = kWxBlocks * kWxCols / 8;
#pragma unroll
  for (int i = 0; i < kWxRows * kChunks / kWxThreads; ++i) {
    const int idx = threadIdx.x + i * kWxThreads, r = idx / kChunks, c = idx % kChunks;
    if (rows_sm[r] >= 0 && n0 + 8 * c < n_end) {
      T* g = out + static_cast<int64_t>(rows_sm[r]) * p.out_total + n0 + 8 * c;
      T* sm = os + r * kWxOutLd + 8 * c;
      if constexpr (LOAD)
        cp_async16(sm, g, 16);
      else
        *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(sm);
    }
  }
}

// One run of the item's tiles with one slot.
template <typename T>
__device__ __forceinline__ void wx_block(const T* v, const T* b, T* out, const ExpandArgs& p, const TileInfo& ti,
                                         const int* rows_sm, T* vs, T* bs, T* os, int sl, int n0, int n_end,
                                         bool& waited) {
#pragma unroll
  for (int cb = 0; cb < kWxBlocks; ++cb)
    wx_load_slab(bs + cb * 64 * kMmaBK, b, ti.rank, [&](int r) -> const T* {
      const int n = n0 + cb * kWxCols + r;
      return n < n_end ? b + (static_cast<int64_t>(ti.slot) * p.out_total + n) * p.R : nullptr;
    });
  cp_async_commit();
  wait_once(waited);  // v and out are written by earlier kernels
  wx_out_copy<T, true>(os, out, p, rows_sm, n0, n_end);
  wx_load_slab(vs, v, ti.rank, [&](int r) -> const T* {
    return rows_sm[r] >= 0 ? v + static_cast<int64_t>(rows_sm[r]) * p.N + sl * p.R : nullptr;
  });
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async();  // this thread's cp.async writes, before wgmma reads them
  __syncthreads();
  const int ksteps = (ti.rank + 15) / 16;
#pragma unroll
  for (int cb = 0; cb < kWxBlocks; ++cb) {
    if (cb * kWxCols + n0 >= n_end) break;
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    wgmma_fence_regs(acc);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kMmaBK / 16; ++ks)
      if (ks < ksteps) wgmma_64x64x16<T>(acc, wgmma_desc(vs + 16 * ks), wgmma_desc(bs + cb * 64 * kMmaBK + 16 * ks));
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_regs(acc);
    wx_epilogue<T>(acc, os, cb, p.scalings[ti.slot]);
  }
  __syncthreads();
  wx_out_copy<T, false>(os, out, p, rows_sm, n0, n_end);
}

// Column items per 64-row group: per slice ceil(column tiles / kWxBlocks), never crossing a slice.
__host__ __device__ __forceinline__ int wx_items_per_group(const int (&tile_start)[kMaxSlices + 1], int slices) {
  int n = 0;
#pragma unroll
  for (int s = 0; s < kMaxSlices; ++s)
    if (s < slices) n += (tile_start[s + 1] - tile_start[s] + kWxBlocks - 1) / kWxBlocks;
  return n;
}

// Slice and first column of column item wct.
__device__ __forceinline__ void wx_column_item(const ExpandArgs& p, int wct, int& sl, int& n0) {
  int start = 0;
  sl = 0;
  n0 = 0;
#pragma unroll
  for (int s = 0; s < kMaxSlices; ++s) {
    const int cnt = s < p.num_slices ? (pick(p.tile_start, s + 1) - pick(p.tile_start, s) + kWxBlocks - 1) / kWxBlocks
                                     : 0;
    if (wct >= start && wct < start + cnt) {
      sl = s;
      n0 = pick(p.offsets, s) + (wct - start) * kWxBlocks * kWxCols;
    }
    start += cnt;
  }
}

// 5 CTAs an SM (their shared memory; 96 registers, no spills). With one column block an item, 8 CTAs (64 registers)
// measured 682-684 µs a layer at r64 prefill 8x1024 against 7 (690-692; H200, thirty-third session).
constexpr int kWxMinCtas = 5;

template <typename T>
__global__ void __launch_bounds__(kWxThreads, kWxMinCtas)
    sgmv_expand_wgmma_kernel(const T* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
#if WGMMA_ENABLED
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* vs = reinterpret_cast<T*>(smem_raw + swizzle_pad(smem_raw));  // [64][kMmaBK], swizzled
  T* bs = vs + 64 * kMmaBK;                                         // kWxBlocks x [64][kMmaBK], swizzled
  T* os = bs + kWxBlocks * 64 * kMmaBK;                             // [kWxRows][kWxOutLd]
  __shared__ int rows_sm[kWxRows];
  __shared__ TileInfo tis[kWxTiles];
  griddep_launch_dependents();
  bool waited = false;
  const int tiles = num_tiles(p.w);
  const int n_items = wx_items_per_group(p.tile_start, p.num_slices);
  const int total = (tiles + kWxTiles - 1) / kWxTiles * n_items;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const int t0 = item / n_items * kWxTiles;
    int sl, n0;
    wx_column_item(p, item % n_items, sl, n0);
    const int n_end = pick(p.offsets, sl + 1);
    for_each_slot_run<kWxTiles>(
        tis, rows_sm, p.w, p.R, tiles, t0, [](const TileInfo& ti) { return ti.slot < 0; },
        [&](const TileInfo& ti) { wx_block<T>(v, b, out, p, ti, rows_sm, vs, bs, os, sl, n0, n_end, waited); });
  }
  wait_once(waited);  // every CTA waits before it exits: see sgmv_expand_mma_kernel
#endif
}

// One CTA per item of the capacity (bounded as the flat expand's grid); the caller checks that this build has the
// sm_90a code (has_sm90_code), as for the wgmma shrink.
template <typename T>
cudaError_t launch_expand_wgmma(const T* v, const T* b, T* out, const ExpandArgs& p, LaunchCfg cfg, int sms) {
  const int64_t items = (p.w.max_tiles + kWxTiles - 1) / kWxTiles * int64_t{wx_items_per_group(p.tile_start,
                                                                                               p.num_slices)};
  cfg.grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, int64_t{4096} * sms)));
  const cudaError_t err = prefer_max_smem<sgmv_expand_wgmma_kernel<T>>();
  if (err != cudaSuccess) return err;
  return launch_kernel<sgmv_expand_wgmma_kernel<T>>(cfg, kWxThreads, kWxSmemBytes, v, b, out, p);
}

}  // namespace lora_kernels
