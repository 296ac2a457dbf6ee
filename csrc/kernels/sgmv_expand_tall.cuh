// The tensor-core expand for many rows (prefill): the same sums as sgmv_expand_mma.cuh, over taller items.
//   out[row, n] += scaling[slot] * sum_{j<rank} v[row, i*R + j] * lora_b[slot, n, j]     n in slice i
// Item (group of kTallTiles consecutive work-list tiles, column tile of kExpandBN columns), one CTA each. At 16 rows
// an item's fixed work (its tile, a 64-wide B slab, four barriers) outweighs its 4 KB of out, and ncu found the
// 16-row kernel issue-bound at prefill (SM 64%, DRAM 28-35%, `not_selected` the top stall). Here one B slab serves
// a run of tiles of the same slot (a prefill segment is 64 tiles), only the k16 steps under the rank are loaded,
// and the out tile is 64 rows. 8 warps: warp w owns tile w / 2 of the group, 64 columns (w % 2) of the item.
// Measured on an H100 (gate_up expand at prefill r16 by ncu / layers r16 and r64 by bench_kernels, µs): the 16-row
// kernel 797 / 1550 / 1910. This kernel's first form 647 / 1330 / 1630: ALU-bound (ncu against Triton's tall expand
// on the same module: 284M executed instructions against 106M, 25% occupancy against 50%, DRAM 41% against 87%).
// This form (the B and v fills one pass per k16 step, lanes on whole sectors; the epilogue's row checks once per lane
// row) 487 (176M instructions, every lane active) / 1100 / 1810: better up to rank 16, worse at 64, where the first
// form's 8- and 16-lane row layouts were faster (using those beyond one k16 step is the next form to measure).
// Slower forms: a persistent grid of two CTAs per SM with a double-buffered out tile 752; 4-warp CTAs of two tiles
// held to 80 registers (stack frame in use) 823; warps keeping out, v and B fragments in registers, no shared memory
// (each k16 step waits on its own loads) 864, 2233 at r64; a two-pass epilogue through an fp32 tile 709.
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
constexpr int kTallSmemBytes = (kTallM * kExpandOutLd + (kTallM + kExpandBN) * kMmaBK) * 2;
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
// zero-filled past the rank and past the slice. Pass i copies k16 step i's two chunks of every row, so a rank of 16
// takes one pass and no lane idles; two lanes take a row's two chunks (32 contiguous bytes: whole sectors).
template <typename T>
__device__ __forceinline__ void tall_load_b(T* bs, const T* b, const ExpandArgs& p, int slot, int rank, int n0,
                                            int n_end, int kt, int ksteps) {
  static_assert(kExpandBN * 2 == kExpandThreads, "a pass is two chunks of every row");
#pragma unroll
  for (int i = 0; i < kMmaBK / 16; ++i) {
    if (i >= ksteps) break;
    const int r = threadIdx.x >> 1, c = 2 * i + (threadIdx.x & 1);
    const int n = n0 + r, j = kt * kMmaBK + c * 8;
    const int bytes = n < n_end ? max(0, min(16, (rank - j) * 2)) : 0;
    cp_async16(bs + swz(r, c), bytes ? b + (static_cast<int64_t>(slot) * p.out_total + n) * p.R + j : b, bytes);
  }
}

// vs rows of tiles [t_lo, t_hi) = v (planes summed in order) for the slab's first `ksteps` k16 steps, as T, 0 past
// the rank and for rows outside x. Pass i fills k16 step i's four quads of every row (a rank of 16: one pass); four
// lanes take a row's four quads (64 contiguous bytes of fp32 v: whole sectors; v is read once per column tile).
template <typename T, typename V>
__device__ __forceinline__ void tall_fill_v(T* vs, const V* v, const ExpandArgs& p, const int* rows, int vcol0,
                                            int rank, int t_lo, int t_hi, int kt, int ksteps) {
  static_assert(kTallM * 4 == kExpandThreads, "a pass is four quads of every row");
#pragma unroll
  for (int i = 0; i < kMmaBK / 16; ++i) {
    if (i >= ksteps) break;
    const int r = threadIdx.x >> 2, q = 4 * i + (threadIdx.x & 3);
    if (r / kTileM < t_lo || r / kTileM >= t_hi) continue;
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
// A lane's accumulators lie on two rows (g and g + 8 of its tile): their checks are made once, not per pair.
template <typename T>
__device__ __forceinline__ void tall_epilogue(const WarpAcc<1, 8>& acc, T* out_sm, T* out, const ExpandArgs& p,
                                              const TallGroup& g, int n0, int n_end) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tile = warp >> 1;
  if (g.slot[tile] >= 0) {
    const float scale = p.scalings[g.slot[tile]];
    const int c0 = (warp & 1) * 64 + (lane & 3) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = tile * kTileM + (lane >> 2) + h * 8;
      if (g.rows[r] < 0) continue;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int c = c0 + nt * 8;
        if (n0 + c >= n_end) break;  // the slice ends inside this warp's columns
        T* o = out_sm + r * kExpandOutLd + c;
        const Pack<T, 2> old = *reinterpret_cast<const Pack<T, 2>*>(o);
        store_pair(o, expand_out(to_float(old.v[0]), scale, acc[0][nt][2 * h]),
                   expand_out(to_float(old.v[1]), scale, acc[0][nt][2 * h + 1]));
      }
    }
  }
  __syncthreads();
  store_out_tile<T, kTallM>(out_sm, out, p.out_total, g.rows, n0, n_end);
}

// One item: for each run of tiles with one slot, its rank slabs (B slab, v rows of the run, the run's warps' MMAs);
// the out tile is requested once, after the first B slab, then the epilogue.
template <typename T, typename V>
__device__ __forceinline__ void tall_item(const V* v, const T* b, T* out, const ExpandArgs& p, const TallGroup& g,
                                          int n0, int n_end, int vcol0, T* out_sm, bool& waited) {
  T* vs = out_sm + kTallM * kExpandOutLd;  // [kTallM * kMmaBK]
  T* bs = vs + kTallM * kMmaBK;            // [kExpandBN * kMmaBK]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tile = warp >> 1;
  const bool warp_live = n0 + (warp & 1) * 64 < n_end;
  WarpAcc<1, 8> acc;
  zero_acc(acc);
  bool out_requested = false;
  for (int lo = 0; lo < kTallTiles;) {  // block-uniform: g is in shared memory
    int hi = lo + 1;
    while (hi < kTallTiles && g.slot[hi] == g.slot[lo]) ++hi;
    const int slot = g.slot[lo], rank = g.rank[lo];
    for (int kt = 0; slot >= 0 && kt * kMmaBK < rank; ++kt) {
      const int ksteps = min(4, (rank - kt * kMmaBK + 15) / 16);
      tall_load_b(bs, b, p, slot, rank, n0, n_end, kt, ksteps);
      cp_async_commit();
      if (!out_requested) {
        wait_once(waited);  // v and out are written by earlier kernels
        load_out_tile<T, kTallM>(out_sm, out, p.out_total, g.rows, n0, n_end);
        cp_async_commit();
        out_requested = true;
      }
      tall_fill_v(vs, v, p, g.rows, vcol0, rank, lo, hi, kt, ksteps);
      cp_async_wait<0>();
      __syncthreads();  // vs, bs (and the out tile) are complete
      if (warp_live && tile >= lo && tile < hi)
        warp_mma_slab<T, 1, 8>(acc, vs, bs, tile * kTileM, (warp & 1) * 64, ksteps, lane);
      __syncthreads();  // vs and bs are refilled by the next slab or run
    }
    lo = hi;
  }
  if (out_requested) tall_epilogue(acc, out_sm, out, p, g, n0, n_end);
}

template <typename T, typename V>
__global__ void __launch_bounds__(kExpandThreads, 2)
    sgmv_expand_tall_kernel(const V* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* out_sm = reinterpret_cast<T*>(smem_raw);  // [kTallM][kExpandOutLd], then vs and bs
  __shared__ TallGroup g;
  griddep_launch_dependents();
  bool waited = false;
  const int n = num_tiles(p.w);
  const int total = (n + kTallTiles - 1) / kTallTiles * p.n_tiles;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const int ct = item % p.n_tiles, sl = slice_of(p, ct);
    const int n0 = tile_col0(p, sl, ct, kExpandBN);
    __syncthreads();  // the previous item is done with g and out_sm
    tall_fill_group(g, p.w, item / p.n_tiles * kTallTiles, n, p.R);
    __syncthreads();
    tall_item<T, V>(v, b, out, p, g, n0, pick(p.offsets, sl + 1), sl * p.R, out_sm, waited);
  }
  wait_once(waited);  // as sgmv_expand_mma_kernel: the stream's next kernel must not overtake the producer
}

template <typename T, typename V>
cudaError_t launch_expand_tall(const V* v, const T* b, T* out, const ExpandArgs& p, const LaunchCfg& cfg) {
  return launch_kernel<sgmv_expand_tall_kernel<T, V>>(cfg, kExpandThreads, kTallSmemBytes, v, b, out, p);
}

}  // namespace lora_kernels
