// The tensor-core expand for decode batches (2 to kTallExpandRows - 1 rows of out, pool rank R <= kStreamMaxR, or up to
// kStreamWideMaxR where every tile is one row; ops/sgmv_plan.h): the same sums as sgmv_expand_mma.cuh, streamed by
// independent warps.
//   out[row, n] += scaling[slot] * sum_{j<rank} v[row, i*R + j] * lora_b[slot, n, j]     n in slice i
// A warp item is one work-list tile (16 rows) x kStreamCols = 64 columns of one slice (KS = 1, 2 or 4 k16 steps of B:
// 2, 4 or 8 KB; KS from R, the CTAs an SM from the shared memory of KS).
// Each warp takes a contiguous run of items (those of one tile follow each other, so v is summed once per tile and
// slice) and keeps the next item's B block and out rows in flight (cp.async into its own shared memory) while it
// computes one; v's loads overlap them; no block barrier. Why: the 16-row kernel runs one 128-column item per
// 256-thread CTA at a time, its loads, MMAs and stores one after the other behind four barriers, and sums v's split
// planes again for every item; ncu found its gate_up expand at decode 64x1 barrier- and latency-bound (50.6 us,
// DRAM 16%); this kernel's first form, 25.2 us (occupancy 16%, latency-bound): more warps per SM then measured
// better each time. Layer µs on an H100 (bench_kernels; 16-row kernel -> three stages and 3 CTAs per SM with padded
// tiles -> two stages, 4 CTAs -> swizzled unpadded tiles, 5 CTAs; 6 CTAs measured slower than 5): r16 64x1 distinct
// 204 -> 116 -> 110 -> 103, 64x1 uniform sorted 90.9 -> 64.2 -> 63.0 -> 58.2, 256x1 distinct 823 -> 409 -> 389 ->
// 362, 16x1 distinct 56.2 -> 42.9 -> 41.5 -> 40.2. Where the 16-row kernel stays: one row (r16 bs1 21.5-22.0 against
// 23.0-25.3 for the first forms: its 256 threads per item) and R of 32 to 64 (first forms with items of 32 / 16
// columns: r64 bs1 32.4 against 28.5, bs16 uniform 85.2 against 77.3, 64x1 uniform 153 against 137), except where
// every tile is one row (64-column items of 4 k16 steps, 2 CTAs an SM: ops/sgmv_plan.h has the figures). Slower here
// too: identical adapters (full tiles: every warp sums the whole tile's v planes; r16 16x1 30.5 against 22.8),
// which rows alone cannot tell apart.
//
// Bits: a row's sum is the same mma.sync m16n8k16 chain over the same k16 steps (those under the rank) of the same
// operands (v summed over its planes in plane order from 0, rounded to T, 0 past the rank) with the same fma
// epilogue as the 16-row and tall kernels; fragments come from 32-bit shared loads instead of ldmatrix, the same
// elements in the same fragment places. So the choice among the three (by rows and R, ops/sgmv_plan.h) keeps batch
// invariance. Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/sgmv_expand_mma.cuh"

namespace lora_kernels {

constexpr int kStreamWarps = 4, kStreamThreads = 32 * kStreamWarps, kStreamStages = 2, kStreamMaxR = 16;
constexpr int kStreamNT = 8, kStreamCols = 8 * kStreamNT;  // n8 tiles and columns of a warp item

// KS: k16 steps of an item's B block (the pool rank R rounded up: 1, 2 or 4). Unpadded shared tiles with XOR-swizzled
// 16-byte chunks, so that the fragment reads (8 rows x 4 words a warp) hit 32 distinct banks. B and v rows are KS k16
// steps (2 KS chunks of 16 bytes); 4 / KS rows share a 128-byte line, and chunk c of row r lies at
// c ^ ((r / (4 / KS)) % (2 KS)). Out rows are the item's 64 columns (8 chunks): chunk c of row r at c ^ (r % 8).
template <int KS>
__device__ __forceinline__ int stream_kc(int r, int c) {
  return r * 16 * KS + ((c ^ ((r / (4 / KS)) & (2 * KS - 1))) << 3);
}
__device__ __forceinline__ int stream_o64(int r, int c) { return r * kStreamCols + ((c ^ (r & 7)) << 3); }

struct StreamItem {
  int slot, rank;  // slot -1: nothing to do (no tile, slot -1 or rank 0)
  int tile, slice, n0, n_end;
};

// One warp's shared memory: per stage the item, its rows, its B block and its out rows; v of the current tile.
// Stages: three at KS = 1 (4 CTAs an SM) measured slower than two (H100, layer µs, bench A/B in two orders: r16 16x1
// uniform sorted 33.2 -> 36.0, 256x1 unsorted 226 -> 246; only 64x1 identical sorted gained, 36.5 -> 34.4). Three B
// stages with two out stages (5 CTAs an SM; a warp's third B block before griddep_wait) also slower: 16x1 sorted 33.2
// -> 35.0, 64x1 unsorted 68.3 -> 77.0, 256x1 unsorted 231 -> 276. So was issuing the B copies on the tile's slot alone
// (two dependent loads before them instead of four; 64x1 unsorted 68.3 -> 69.6, 16x1 sorted 33.2 -> 33.7).
template <typename T, int KS>
struct alignas(16) StreamWarpSmem {
  T b[kStreamStages][kStreamCols * 16 * KS];
  T out[kStreamStages][kTileM * kStreamCols];
  T vs[kTileM * 16 * KS];
  StreamItem item[kStreamStages];
  int rows[kStreamStages][kTileM];
};

template <int KS>
constexpr int kStreamSmemBytes = kStreamWarps * static_cast<int>(sizeof(StreamWarpSmem<uint16_t, KS>));
// CTAs per SM for KS k16 steps: at KS = 1 the registers are held to them (102 a thread); the shared memory holds them.
constexpr int stream_ctas_per_sm(int ks) { return ks == 1 ? 5 : (ks == 2 ? 4 : 2); }
template <int KS>
constexpr bool stream_ctas_fit = stream_ctas_per_sm(KS) * (kStreamSmemBytes<KS> + 1024) <= 227 * 1024;
static_assert(stream_ctas_fit<1> && stream_ctas_fit<2> && stream_ctas_fit<4>, "the CTAs fit the shared memory");
// The k16 steps of the stream kernel for pool rank R.
inline int stream_ks(int64_t R) { return R <= 16 ? 1 : (R <= 32 ? 2 : 4); }

// A warp's run walks consecutive items (item = tile * n_tiles + column tile), so a tile's metadata and rows stay in
// registers across its items and the column tile advances by a counter: no division and no chain of dependent
// metadata loads (work list, rank, permutation) per item, which measured 2-10% a decode layer (H100). The next tile's
// metadata is loaded as soon as the cursor reaches it, right after the previous item's copies are issued.
struct StreamCursor {
  int tile, ct;  // the next item's work-list tile and column tile
  TileInfo ti;   // tile `tile`'s metadata
  int row;       // lanes 0..15: tile `tile`'s physical row `lane` (-1 where none)
};
__device__ __forceinline__ void stream_cursor_load(StreamCursor& c, const ExpandArgs& p, int lane) {
  c.ti = load_tile(p.w, c.tile, p.R);
  c.row = c.ti.slot >= 0 && lane < kTileM ? tile_row(p.w, c.ti, lane) : -1;
}
__device__ __forceinline__ StreamItem stream_cursor_item(const StreamCursor& c, const ExpandArgs& p, int& row) {
  const int sl = slice_of(p, c.ct);
  row = c.row;
  return StreamItem{c.ti.slot, c.ti.rank, c.tile, sl,
                    tile_col0(p, sl, c.ct, kStreamCols), pick(p.offsets, sl + 1)};
}
// Past the item just issued; loads the next tile's metadata where the column tiles wrap and `more` items follow.
__device__ __forceinline__ void stream_cursor_next(StreamCursor& c, const ExpandArgs& p, int lane, bool more) {
  if (++c.ct < p.n_tiles) return;
  c.ct = 0;
  ++c.tile;
  if (more) stream_cursor_load(c, p, lane);
}

// Stage s <- the item's B block (its 2 KS 16-byte chunks a row; zero-filled past the rank and the slice), with the
// item and its rows. No kernel writes the weights: this may run before griddep_wait. Where the block is whole (rank
// R = 16 KS, all 64 columns in the slice) it is 2 KB KS of contiguous bytes, so chunk i of a lane sits at a fixed
// offset from one base: no bounds, byte counts or per-chunk products. Why: ncu (H100, r16 16x1 uniform, gate_up) found
// 686 instructions an item, 143 of them this block's copies; with the whole-block copies here and in stream_issue_out
// and the stores: 17% fewer in all, 16.4 -> 15.9 us, layer µs (bench A/B, two orders) r16 16x1 sorted 34.6 / 34.2 ->
// 33.8 / 33.6, 256x1 unsorted 281 -> 254, 64x1 unsorted 74.3 -> 70.2, r64 256x1 distinct 999 -> 987; sorted 64x1 and
// 256x1 unchanged (50.2, 79.3).
template <int KS>
__device__ __forceinline__ int stream_b_chunk(int lane, int i) {  // shared offset of chunk lane + 32 i of a B block
  constexpr int kRowsPerPass = 32 / (2 * KS);                     // rows of the block a pass of the warp covers
  return stream_kc<KS>(lane / (2 * KS) + kRowsPerPass * i, lane % (2 * KS));
}
// Stage s <- the item's whole B block (R = 16 KS, rank R, its 64 columns in the slice): one base a lane, chunk i at a
// fixed offset.
template <typename T, int KS>
__device__ __forceinline__ void stream_copy_b_whole(StreamWarpSmem<T, KS>& ws, int s, const T* b, const ExpandArgs& p,
                                                    const StreamItem& it, int lane) {
  const uint32_t sb = smem_addr(ws.b[s]);
  const T* src = b + (static_cast<int64_t>(it.slot) * p.out_total + it.n0) * p.R + 8 * lane;
#pragma unroll
  for (int i = 0; i < kStreamCols * 2 * KS / 32; ++i)
    cp_async16_s(sb + 2 * stream_b_chunk<KS>(lane, i), src + 256 * i, 16);
}
// Stage s <- the item's B block chunk by chunk, zero-filled past its rank and its slice (it.slot >= 0).
template <typename T, int KS>
__device__ __forceinline__ void stream_copy_b_part(StreamWarpSmem<T, KS>& ws, int s, const T* b, const ExpandArgs& p,
                                                   const StreamItem& it, int lane) {
#pragma unroll
  for (int i = 0; i < kStreamCols * 2 * KS / 32; ++i) {
    const int idx = lane + 32 * i, r = idx / (2 * KS), c = idx % (2 * KS);
    const int n = it.n0 + r, j = 8 * c;
    const int bytes = n < it.n_end ? max(0, min(16, (it.rank - j) * 2)) : 0;
    cp_async16(ws.b[s] + stream_kc<KS>(r, c),
               bytes ? b + (static_cast<int64_t>(it.slot) * p.out_total + n) * p.R + j : b, bytes);
  }
}
template <typename T, int KS>
__device__ __forceinline__ void stream_issue_b(StreamWarpSmem<T, KS>& ws, int s, const T* b, const ExpandArgs& p,
                                               const StreamItem& it, int row, int lane) {
  if (lane == 0) ws.item[s] = it;
  if (lane < kTileM) ws.rows[s][lane] = row;
  if (it.slot < 0) return;
  if (p.R == 16 * KS && it.rank == p.R && it.n0 + kStreamCols <= it.n_end)
    stream_copy_b_whole<T, KS>(ws, s, b, p, it, lane);
  else
    stream_copy_b_part<T, KS>(ws, s, b, p, it, lane);
}

// Stage s <- the item's out rows (16-byte chunks of the rows that exist, within the slice). After griddep_wait. An
// item whose 64 columns lie in its slice copies from one base a lane (its chunk column is lane % 8 in every pass).
template <typename T, int KS>
__device__ __forceinline__ void stream_issue_out(StreamWarpSmem<T, KS>& ws, int s, const T* out, const ExpandArgs& p,
                                                 const StreamItem& it, int row, int lane) {
  if (it.slot < 0) return;  // warp-uniform
  if (it.n0 + kStreamCols <= it.n_end) {
    const uint32_t so = smem_addr(ws.out[s]);
    const int c = lane % kStreamNT;
    const T* src = out + it.n0 + 8 * c;
#pragma unroll
    for (int i = 0; i < kTileM * kStreamNT / 32; ++i) {
      const int r = lane / kStreamNT + (32 / kStreamNT) * i;
      const int rr = __shfl_sync(0xffffffffu, row, r);
      if (rr >= 0) cp_async16_s(so + 2 * stream_o64(r, c), src + static_cast<int64_t>(rr) * p.out_total, 16);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kTileM * kStreamNT / 32; ++i) {
    const int idx = lane + 32 * i, r = idx / kStreamNT, c = idx % kStreamNT;
    const int rr = __shfl_sync(0xffffffffu, row, r);
    if (rr >= 0 && it.n0 + 8 * c < it.n_end)
      cp_async16(ws.out[s] + stream_o64(r, c), out + static_cast<int64_t>(rr) * p.out_total + it.n0 + 8 * c, 16);
  }
}

// The warp's A fragments of v for the item's tile and slice: v summed over its planes in plane order from 0, as T,
// 0 past the rank and for rows without LoRA, staged in ws.vs, then a[ks][q] = row g (q even) / g + 8 (q odd) at
// k = 16 ks + 8 (q / 2) + 2 (lane % 4) and the next k (the m16n8k16 layout). Lane i takes quad i % 4 of each k16
// step of rows i / 4 and i / 4 + 8; a single plane (v summed by an earlier kernel, or v itself) is loaded in one batch.
template <typename T, typename V, int KS>
__device__ __forceinline__ void stream_load_v(uint32_t (&a)[KS][4], StreamWarpSmem<T, KS>& ws, int s, const V* v,
                                              const ExpandArgs& p, const StreamItem& it, int lane) {
  float f[2][KS][4];
  const V* src[2];
  bool live[2][KS];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = (lane >> 2) + 8 * i, row = ws.rows[s][r];
    src[i] = v + static_cast<int64_t>(max(row, 0)) * p.N + it.slice * p.R + 4 * (lane & 3);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      live[i][ks] = row >= 0 && 16 * ks + 4 * (lane & 3) < it.rank;
      f[i][ks][0] = f[i][ks][1] = f[i][ks][2] = f[i][ks][3] = 0.f;
    }
  }
  if (p.splits == 1) {
    Pack<V, 4> pk[2][KS];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        if (live[i][ks]) pk[i][ks] = load_cg<V, 4>(src[i] + 16 * ks);
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
#pragma unroll
        for (int e = 0; e < 4; ++e) f[i][ks][e] = live[i][ks] ? 0.f + to_float(pk[i][ks].v[e]) : 0.f;
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        if (live[i][ks]) sum_planes4(f[i][ks], src[i] + 16 * ks, p.split_stride, p.splits);
  }
  const int q = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      const int r = (lane >> 2) + 8 * i;
      Pack<T, 4> t;
#pragma unroll
      for (int e = 0; e < 4; ++e) t.v[e] = from_float<T>(16 * ks + 4 * q + e < it.rank ? f[i][ks][e] : 0.f);
      *reinterpret_cast<Pack<T, 4>*>(ws.vs + stream_kc<KS>(r, 2 * ks + (q >> 1)) + 4 * (q & 1)) = t;
    }
  __syncwarp();
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
#pragma unroll
    for (int u = 0; u < 4; ++u)
      a[ks][u] = *reinterpret_cast<const uint32_t*>(ws.vs + stream_kc<KS>(g + 8 * (u & 1), 2 * ks + (u >> 1)) + 2 * t);
}

// A lane's v fragments and the (tile, slice) they belong to.
template <int KS>
struct StreamA {
  int tile = -1, slice = -1;
  uint32_t frag[KS][4];
};

// Item of stage s (its loads complete, a.frag its v): the MMAs (the k16 steps under the rank, in order), out rows +=
// scale * acc in shared memory, 16-byte stores.
template <typename T, int KS>
__device__ __forceinline__ void stream_compute(StreamWarpSmem<T, KS>& ws, int s, T* out, const ExpandArgs& p,
                                               const StreamA<KS>& a, int lane) {
  const StreamItem it = ws.item[s];
  if (it.slot < 0) return;
  const int g = lane >> 2, t = lane & 3;
  const int row_lo = ws.rows[s][g], row_hi = ws.rows[s][g + 8];
  WarpAcc<1, kStreamNT> acc;
  zero_acc(acc);
  const T* bs = ws.b[s];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    if (ks > 0 && 16 * ks >= it.rank) break;  // the steps under the rank, as the 16-row kernel (rank > 0 here)
#pragma unroll
    for (int nt = 0; nt < kStreamNT; ++nt)
      mma_16816<T>(acc[0][nt], a.frag[ks],
                   *reinterpret_cast<const uint32_t*>(bs + stream_kc<KS>(8 * nt + g, 2 * ks) + 2 * t),
                   *reinterpret_cast<const uint32_t*>(bs + stream_kc<KS>(8 * nt + g, 2 * ks + 1) + 2 * t));
  }
  T* os = ws.out[s];
  const float scale = p.scalings[it.slot];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if ((h ? row_hi : row_lo) < 0) continue;
#pragma unroll
    for (int nt = 0; nt < kStreamNT; ++nt) {
      if (it.n0 + 8 * nt >= it.n_end) break;  // the slice ends inside the item
      T* o = os + stream_o64(g + 8 * h, nt) + 2 * t;
      const Pack<T, 2> old = *reinterpret_cast<const Pack<T, 2>*>(o);
      store_pair(o, expand_out(to_float(old.v[0]), scale, acc[0][nt][2 * h]),
                 expand_out(to_float(old.v[1]), scale, acc[0][nt][2 * h + 1]));
    }
  }
  __syncwarp();
  if (it.n0 + kStreamCols <= it.n_end) {  // one base a lane, as stream_issue_out
    const int c = lane % kStreamNT;
    T* dst = out + it.n0 + 8 * c;
#pragma unroll
    for (int i = 0; i < kTileM * kStreamNT / 32; ++i) {
      const int r = lane / kStreamNT + (32 / kStreamNT) * i, row = ws.rows[s][r];
      if (row >= 0)
        *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(row) * p.out_total) =
            *reinterpret_cast<const uint4*>(os + stream_o64(r, c));
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kTileM * kStreamNT / 32; ++i) {
    const int idx = lane + 32 * i, r = idx / kStreamNT, c = idx % kStreamNT, row = ws.rows[s][r];
    if (row >= 0 && it.n0 + 8 * c < it.n_end)
      *reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * p.out_total + it.n0 + 8 * c) =
          *reinterpret_cast<const uint4*>(os + stream_o64(r, c));
  }
}

// Both stages' B blocks are requested before griddep_wait (with the cursor's steps and the next tile's metadata), both
// out rows after it, from the stages; then each stage is refilled (item k + 2) once item k is computed, so a warp keeps
// one item in flight while it computes one. cp.async groups: B0, B1, out0, out1, then one an item: item k's data are
// complete with one group pending, for every k. Layer µs on an H100 against the form that issued item k + 1 before
// computing item k, with one B block before the wait and the cursor stepped after it: that order -> the cursor and
// metadata before the wait (two calls, not interleaved): r16 256x1 unsorted 254 -> 226, 16x1 sorted 33.8 -> 33.2; ->
// this (bench A/B, two orders, bit-equal, 278 CUDA tests): 64x1 unsorted 69.5 / 69.4 -> 67.7 / 67.7, 256x1 sorted
// 78.2 / 78.2 -> 77.8 / 77.7, 16x1 sorted 33.8 / 33.5 -> 33.2 / 33.4, 64x1 sorted 49.9 / 49.8 -> 50.0 / 50.0.
template <typename T, typename V, int KS>
__global__ void __launch_bounds__(kStreamThreads, stream_ctas_per_sm(KS))
    sgmv_expand_stream_kernel(const V* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  StreamWarpSmem<T, KS>& ws = reinterpret_cast<StreamWarpSmem<T, KS>*>(smem_raw)[warp];
  griddep_launch_dependents();
  const int total = num_tiles(p.w) * p.n_tiles, warps = gridDim.x * kStreamWarps;
  const int per = (total + warps - 1) / warps;
  const int i0 = (blockIdx.x * kStreamWarps + warp) * per, i1 = min(i0 + per, total);
  int row;
  StreamCursor cur{};  // the next item to issue
  static_assert(kStreamStages == 2, "one group pending: the wait depths below assume two stages");
  if (i0 < i1) {
    cur.tile = i0 / p.n_tiles;
    cur.ct = i0 - cur.tile * p.n_tiles;
    stream_cursor_load(cur, p, lane);
  }
  for (int s = 0; s < kStreamStages; ++s) {
    if (i0 + s < i1) {
      const StreamItem it = stream_cursor_item(cur, p, row);
      stream_issue_b<T, KS>(ws, s, b, p, it, row, lane);
      stream_cursor_next(cur, p, lane, i0 + s + 1 < i1);
    }
    cp_async_commit();
  }
  griddep_wait();  // v and out are written by earlier kernels; every CTA waits (see sgmv_expand_mma_kernel)
  __syncwarp();    // the stages' items and rows
  for (int s = 0; s < kStreamStages; ++s) {
    if (i0 + s < i1) stream_issue_out<T, KS>(ws, s, out, p, ws.item[s], lane < kTileM ? ws.rows[s][lane] : -1, lane);
    cp_async_commit();
  }
  StreamA<KS> a;
  for (int k = 0, s = 0; i0 + k < i1; ++k) {
    const StreamItem it = ws.item[s];
    if (it.slot >= 0 && (it.tile != a.tile || it.slice != a.slice)) {  // v's loads overlap the stage's
      stream_load_v<T, V, KS>(a.frag, ws, s, v, p, it, lane);
      a.tile = it.tile;
      a.slice = it.slice;
    }
    cp_async_wait<1>();  // item k's groups
    __syncwarp();
    stream_compute<T, KS>(ws, s, out, p, a, lane);
    __syncwarp();  // the stage is refilled now
    if (i0 + k + kStreamStages < i1) {
      const StreamItem nx = stream_cursor_item(cur, p, row);
      stream_issue_b<T, KS>(ws, s, b, p, nx, row, lane);
      stream_issue_out<T, KS>(ws, s, out, p, nx, row, lane);
      stream_cursor_next(cur, p, lane, i0 + k + kStreamStages + 1 < i1);
    }
    cp_async_commit();
    s = s + 1 == kStreamStages ? 0 : s + 1;
  }
}

template <typename T, typename V>
cudaError_t launch_expand_stream(const V* v, const T* b, T* out, const ExpandArgs& p, const LaunchCfg& cfg) {
  static_assert(sizeof(T) == 2, "16-bit T");
  switch (stream_ks(p.R)) {
    case 1:
      return launch_kernel<sgmv_expand_stream_kernel<T, V, 1>>(cfg, kStreamThreads, kStreamSmemBytes<1>, v, b, out, p);
    case 2:
      return launch_kernel<sgmv_expand_stream_kernel<T, V, 2>>(cfg, kStreamThreads, kStreamSmemBytes<2>, v, b, out, p);
    default:
      return launch_kernel<sgmv_expand_stream_kernel<T, V, 4>>(cfg, kStreamThreads, kStreamSmemBytes<4>, v, b, out, p);
  }
}

}  // namespace lora_kernels
