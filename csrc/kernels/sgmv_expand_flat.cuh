// The tensor-core expand for prefill at small ranks (R <= kFlatMaxR; ops/sgmv_plan.h): one short CTA per item, no
// pipeline and no persistent loop; the SMs' many resident CTAs keep the loads in flight, as a memcpy's do.
//   out[row, n] += scaling[slot] * sum_{j<rank} v[row, i*R + j] * lora_b[slot, n, j]     n in slice i
// Item (group of kFlatTiles consecutive work-list tiles, column tile of kFlatCols columns of one slice); items are
// numbered column tile first, so the CTAs resident at once sweep whole rows of out together. A CTA first reads the
// group's tiles without their ranks and starts the copy of its out rows into shared memory by whole lines (16 lanes a
// 256-byte row), then the ranks, B (zero-filled past the rank and the slice) and v. Warp w owns the item's columns
// [32 w, 32 w + 32) over all rows, tile by tile: four n8 tiles whose columns are permuted (flat_b_row) so that lane
// quad t's accumulators of a row are one 16-byte chunk of out (columns 8 t .. + 7), read from the staged rows and
// stored to out as such. B rows sit in shared memory in fragment order (each n8 tile's eight columns on consecutive
// rows) so that ldmatrix's eight addresses fall in distinct banks.
//
// Measured (H100, layer µs at prefill 8x1024 r16, bench_kernels, one call each; the register expand 763-765, Triton
// 706-707): out held in registers, 2-tile items, 6 CTAs an SM (80 registers) 780, 8 CTAs (64) 729-730; reading the
// out rows before the ranks (more live registers, spills of 4-28 bytes) 743-784; out staged in shared memory by each
// lane's own chunks, 2-tile items at 8 / 10 / 12 CTAs an SM 733 / 731 / 751, 4-tile items at 6 CTAs 720-721; copied by
// whole lines: 4-tile items at 6 CTAs **702-705**, at 4 CTAs 712, 8-tile items at 3 CTAs 774, 2-tile items at 8 / 10
// CTAs 719 / 713; the stores by whole lines too (the results back to shared memory, a barrier) 708-710; the landed
// steps in another order 721-729 (flat_item). By ncu (each kernel alone, r16 gate_up): the register expand 376 µs at
// 74% of DRAM bandwidth, out in registers 350 at 79%, whole lines 335 at 82%. At r64 these forms were slower than the
// register expand (906-1460 against 892-896): they reload B (16 KB) for every 8-16 KB of out, where a register-expand
// warp keeps B for a run of items. A persistent form that keeps B (CTAs of one column tile over contiguous rows, two
// stages of out lines and v; up to R = 64) was slower at both ranks: r16 694 -> 762, r64 881 -> 1120 (ncu, gate_up r64:
// 551 µs at 51% of DRAM bandwidth, 11% occupancy: 1-2 CTAs of 4 warps an SM; thirtieth session).
//
// Bits: a row's sum is the same mma.sync m16n8k16 chain over the same k16 steps (those under the rank) of the same
// operands (v of T, 0 past the rank; B 0 past the rank) with the same fma epilogue as the register, 16-row, stream
// and tall kernels. Which n8 slot of an MMA holds a column, and which rows share the MMA, do not enter a column's sum;
// v of T is used as it is (as the register expand does), without the `0 + v` round trip of the 16-row, stream and tall
// kernels (it only turns -0 into +0, and the chain starts at +0, so a -0 operand cannot change a sum). So the choice
// among the kernels keeps batch invariance.
// Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "kernels/mma_tile.cuh"

namespace lora_kernels {

constexpr int kFlatWarps = 4, kFlatThreads = 32 * kFlatWarps, kFlatCols = 32 * kFlatWarps;
// 7 CTAs an SM (72 registers, no spills; the launch asks for the largest shared-memory carveout, which 7 CTAs need):
// r16 prefill 8x1024 538-539 -> 533 µs a layer against 6 CTAs (77 registers; H200, two orders, thirty-third session);
// on the H100 7 measured level, 695-697 against 696-697 (thirty-first session). 8 do not fit in shared memory.
constexpr int kFlatTiles = 4, kFlatRows = kFlatTiles * kTileM, kFlatMinCtas = 7;
constexpr int kFlatMaxR = 16;                     // one k16 step (the measured form; see above for r64)
constexpr int kFlatLd = 48;                       // bytes per row of B and v in shared memory: 32 + 16 of padding
constexpr int kFlatOutLd = 2 * kFlatCols + 64;    // bytes per staged out row: 64 of padding, no bank conflicts
constexpr int kFlatLineLanes = kFlatCols / 8;     // lanes copying one out row (16-byte chunks)
constexpr int kFlatLines = kFlatRows * kFlatLineLanes / kFlatThreads;  // out rows a thread copies
constexpr int kFlatSmemBytes = (kFlatCols + kFlatRows) * kFlatLd + kFlatRows * kFlatOutLd;
static_assert(kFlatRows * 2 == kFlatThreads && kFlatCols == kFlatThreads, "a lane: one v chunk, one B column");

// Shared-memory row of column c (0..31) of a warp's slab. n8 tile nt's fragment column j (0..7) is slab column
// 8 (j / 2) + 2 nt + j % 2, so that lane quad t's accumulators are columns 8 t .. + 7; its eight columns sit on rows
// 8 nt .. + 7.
__device__ __forceinline__ int flat_b_row(int c) { return 8 * ((c >> 1) & 3) + (((c >> 3) << 1) | (c & 1)); }

// Eight elements of v (k0 .. k0 + 7 of a row, `live` of them under the rank: the rest 0; src valid when live <= 0)
// into shared memory as T: by cp.async where v is T; fp32 v (a standalone sgmv_expand's) is loaded and rounded to T,
// as the other kernels round it.
template <typename T, typename V>
__device__ __forceinline__ void flat_fill_v(unsigned char* dst, const V* src, int live) {
  if constexpr (sizeof(V) == 2) {
    cp_async16(dst, src, max(0, min(16, live * 2)));
  } else {
    Pack<T, 8> pk;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const Pack<float, 4> f = live > 4 * h ? load_cg<float, 4>(src + 4 * h) : Pack<float, 4>{};
#pragma unroll
      for (int e = 0; e < 4; ++e) pk.v[4 * h + e] = from_float<T>(4 * h + e < live ? 0.f + f.v[e] : 0.f);
    }
    *reinterpret_cast<Pack<T, 8>*>(dst) = pk;
  }
}

// B of `slot` for the item's kFlatCols columns from n0, k 0..15 (0 past the rank, the slice end n_end, and for slot
// -1): column c on row flat_b_row(c) of its warp's 32 rows. Two chunks a lane, a column's two chunks by neighbouring
// lanes (a warp copies 512 contiguous bytes, whole sectors).
template <typename T>
__device__ __forceinline__ void flat_fill_b(unsigned char* bs, const T* b, const ExpandArgs& p, int slot, int rank,
                                            int n0, int n_end) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = static_cast<int>(threadIdx.x) + kFlatThreads * j, c = i >> 1, k0 = 8 * (i & 1), n = n0 + c;
    const int bytes = slot >= 0 && n < n_end ? max(0, min(16, (rank - k0) * 2)) : 0;
    const T* src = bytes ? b + (static_cast<int64_t>(slot) * p.out_total + n) * p.R + k0 : b;
    cp_async16(bs + ((c & ~31) + flat_b_row(c & 31)) * kFlatLd + 2 * k0, src, bytes);
  }
}

// Tile q of the item, a warp's 16 rows x 32 columns: the MMAs (one k16 step), then out = fma(scale, acc, out) from the
// staged rows, stored as 16-byte chunks (the lane's: rows orow, columns nw .. + 7).
template <typename T>
__device__ __forceinline__ void flat_tile(const unsigned char* bs, const unsigned char* vs, const unsigned char* os,
                                          T* out, const ExpandArgs& p, int q, float scale, const int (&orow)[2], int nw,
                                          int n_end, int ocol) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  WarpAcc<1, 4> acc;
  zero_acc(acc);
  {
    uint32_t bf[4][2], a[4];
#pragma unroll
    for (int np = 0; np < 2; ++np) {  // n8 tiles 2 np, 2 np + 1: k halves 0, 1 each
      const int m = lane >> 3;
      uint32_t r[4];
      ldmatrix_x4(r, bs + (32 * warp + 8 * (2 * np + (m >> 1)) + (lane & 7)) * kFlatLd + 16 * (m & 1));
      bf[2 * np][0] = r[0];
      bf[2 * np][1] = r[1];
      bf[2 * np + 1][0] = r[2];
      bf[2 * np + 1][1] = r[3];
    }
    ldmatrix_x4(a, vs + (q * kTileM + (lane & 15)) * kFlatLd + 16 * (lane >> 4));
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) mma_16816<T>(acc[0][nt], a, bf[nt][0], bf[nt][1]);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (orow[h] < 0 || nw >= n_end) continue;
    Pack<T, 8> pk = *reinterpret_cast<const Pack<T, 8>*>(os + (q * kTileM + g + 8 * h) * kFlatOutLd + ocol);
#pragma unroll
    for (int e = 0; e < 8; ++e)  // column 8 t + e: n8 tile e / 2, accumulator 2 h + e % 2
      pk.v[e] = from_float<T>(expand_out(to_float(pk.v[e]), scale, acc[0][e >> 1][2 * h + (e & 1)]));
    *reinterpret_cast<Pack<T, 8>*>(out + static_cast<int64_t>(orow[h]) * p.out_total + nw) = pk;
  }
}

// The lane's v chunk (group row threadIdx.x / 2, elements 8 (threadIdx.x % 2) .. + 7): its source, live elements and
// place in shared memory.
template <typename V>
__device__ __forceinline__ void flat_v_task(const V* v, const ExpandArgs& p, const TileInfo (&ti)[kFlatTiles], int sl,
                                            const V*& src, int& live, int& dst) {
  const int i = static_cast<int>(threadIdx.x), r = i / 2, k0 = 8 * (i % 2);
  TileInfo tq = ti[0];
#pragma unroll
  for (int k = 1; k < kFlatTiles; ++k)
    if (r >= k * kTileM) tq = ti[k];
  const int row = tq.slot >= 0 && i < kFlatRows * 2 ? tile_row(p.w, tq, r % kTileM) : -1;
  // i < kFlatRows * 2 always holds (static_assert above); the check stays because the measured SASS has it (flat_item).
  live = i < kFlatRows * 2 ? (row >= 0 ? tq.rank - k0 : 0) : -kFlatCols;  // -kFlatCols: no chunk
  src = live > 0 ? v + static_cast<int64_t>(row) * p.N + sl * p.R + k0 : v;
  dst = r * kFlatLd + 2 * k0;
}

// One item: its tiles' rows, the out rows' copy by lines (16 lanes a row), then the ranks, B and v; then tile by tile
// (one tile's accumulators live at a time). The order of these steps is the measured one (its SASS is the A/B form's,
// instruction for instruction): the same steps with the line rows found after griddep_wait and the v chunk without its
// bound check (72 registers against 77) measured 729 µs at r16 prefill (e6cf823,
// B copied a column a lane), 721-724 with B by whole sectors (29aa84c), against 703-705 for this form (H100,
// bench_kernels; the last two in one A/B call, bit-equal).
template <typename T, typename V>
__device__ __forceinline__ void flat_item(const V* v, const T* b, T* out, const ExpandArgs& p, unsigned char* smem,
                                          int item, int tiles, bool& waited) {
  unsigned char* const bs = smem;                      // [kFlatCols][kFlatLd], fragment order
  unsigned char* const vs = bs + kFlatCols * kFlatLd;  // [kFlatRows][kFlatLd]
  unsigned char* const os = vs + kFlatRows * kFlatLd;  // [kFlatRows][kFlatOutLd]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int ct = item % p.n_tiles, t0 = item / p.n_tiles * kFlatTiles, sl = slice_of(p, ct);
  const int n0 = tile_col0(p, sl, ct, kFlatCols), n_end = pick(p.offsets, sl + 1);
  TileInfo ti[kFlatTiles];  // rows first: the out copy starts before the ranks arrive
#pragma unroll
  for (int q = 0; q < kFlatTiles; ++q) ti[q] = t0 + q >= tiles ? TileInfo{-1, 0, 0, 0} : load_tile_rows(p.w, t0 + q);
  int orow[kFlatTiles][2];  // physical rows of the lane's chunks in tile q: rows g and g + 8 (-1: none)
#pragma unroll
  for (int q = 0; q < kFlatTiles; ++q)
#pragma unroll
    for (int h = 0; h < 2; ++h) orow[q][h] = ti[q].slot >= 0 ? tile_row(p.w, ti[q], g + 8 * h) : -1;
  const int nw = n0 + 32 * warp + 8 * t, ocol = 2 * (32 * warp + 8 * t);  // the lane's chunk
  // Line copies: group row 16 (j / 2) + lr + 8 (j % 2), chunk lc, for j < kFlatLines.
  const int lc = threadIdx.x % kFlatLineLanes, lr = threadIdx.x / kFlatLineLanes;
  int lrow[kFlatLines];
#pragma unroll
  for (int j = 0; j < kFlatLines; ++j)
    lrow[j] = ti[j >> 1].slot >= 0 ? tile_row(p.w, ti[j >> 1], lr + 8 * (j & 1)) : -1;
  wait_once(waited);  // out and v are written by earlier kernels
#pragma unroll
  for (int j = 0; j < kFlatLines; ++j)
    if (lrow[j] >= 0 && n0 + 8 * lc < n_end)
      cp_async16(os + (16 * (j >> 1) + lr + 8 * (j & 1)) * kFlatOutLd + 16 * lc,
                 out + static_cast<int64_t>(lrow[j]) * p.out_total + n0 + 8 * lc, 16);
#pragma unroll
  for (int q = 0; q < kFlatTiles; ++q) ti[q] = tile_rank(p.w, ti[q], p.R);
  flat_fill_b<T>(bs, b, p, ti[0].slot, ti[0].rank, n0, n_end);
  float scale[kFlatTiles];
#pragma unroll
  for (int q = 0; q < kFlatTiles; ++q) scale[q] = ti[q].slot >= 0 ? p.scalings[ti[q].slot] : 0.f;
  const V* vsrc;
  int vlive, vdst;
  flat_v_task(v, p, ti, sl, vsrc, vlive, vdst);
  if (vlive > -kFlatCols) flat_fill_v<T>(vs + vdst, vsrc, vlive);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kFlatTiles; ++q) {
    if (q > 0 && ti[q].slot != ti[q - 1].slot && ti[q].slot >= 0) {  // CTA-uniform: another slot's B
      __syncthreads();
      flat_fill_b<T>(bs, b, p, ti[q].slot, ti[q].rank, n0, n_end);
      cp_async_commit();
      cp_async_wait<0>();
      __syncthreads();
    }
    if (ti[q].slot < 0) continue;
    flat_tile<T>(bs, vs, os, out, p, q, scale[q], orow[q], nw, n_end, ocol);
  }
}

template <typename T, typename V>
__global__ void __launch_bounds__(kFlatThreads, kFlatMinCtas)
    sgmv_expand_flat_kernel(const V* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  griddep_launch_dependents();
  const int tiles = num_tiles(p.w), items = (tiles + kFlatTiles - 1) / kFlatTiles * p.n_tiles;
  bool waited = false;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    flat_item<T, V>(v, b, out, p, smem_raw, item, tiles, waited);
    __syncthreads();  // the next item refills the shared memory
  }
  wait_once(waited);  // as sgmv_expand_mma_kernel: the stream's next kernel must not overtake the producer
}

template <typename T, typename V>
cudaError_t launch_expand_flat(const V* v, const T* b, T* out, const ExpandArgs& p, const LaunchCfg& cfg) {
  const cudaError_t err = prefer_max_smem<sgmv_expand_flat_kernel<T, V>>();
  if (err != cudaSuccess) return err;
  return launch_kernel<sgmv_expand_flat_kernel<T, V>>(cfg, kFlatThreads, kFlatSmemBytes, v, b, out, p);
}

}  // namespace lora_kernels
