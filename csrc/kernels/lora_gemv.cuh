// A LoRA-targeted linear layer for decode batches (1 to kGemvRows rows of x) in one launch:
//   y[m, n] = x[m] W[n]ᵀ (+ bias[n]) + scaling[slot] · sum_{j<rank} v[m, i*R + j] · B[slot, n, j]    (n in slice i)
//   v[m, c] = x[m] A[slot, c]ᵀ
// Why: at decode the base GEMM streams the weights W at the memory bandwidth and LoRA adds a few percent of bytes,
// but cuBLAS followed by a shrink and an expand costs three launches per module, and the expand re-reads and
// re-writes y. Here W's rows are streamed once, the LoRA rides along, and y is written once.
//
// One persistent grid of co-resident CTAs (at most the occupancy, ops/lora_gemv.cu) walks two lists of items, each
// CTA its shrink items first. Shrink items (work-list tile, 16 columns of v, one of `splits` K ranges: fp32 planes of
// v = x Aᵀ for the tile's rows, summed in plane order where the epilogue stages v) are dealt from the last CTA down
// (first to the CTAs with one W item fewer, where those are many); W items (16 rows of W, i.e. 16 columns of y, over
// the whole K) go to CTA c as c, c + grid, ..., so the last CTAs hold one W item fewer. In every item each of the 8
// warps takes one eighth of the item's K for both n8 groups, with 16-byte loads that feed mma.sync directly (each
// lane loads 8 consecutive k of one weight row and of x rows g and g + 8; A and B fragments use the same k
// permutation, so the dot products are exact sums over k), and the CTA adds the eighths in order. A CTA (a team,
// below) counts itself on sync[0] once its shrink items are written (a release add after the team's barrier: no
// fence); a W item's epilogue waits once for the count to reach the grid (an acquire load, then the barrier; every CTA
// is resident and does its shrink items before any wait, so this never deadlocks), then adds the LoRA and writes y.
// Each team counts itself on sync[1] once it has seen the full count, and the last to do so resets both words for the
// next launch (which reads them only past griddep_wait or in stream order). The fences of an earlier form (a
// __threadfence before the count and after the wait; the count on sync[1] at each team's exit) cost, H100, layer µs
// over the base layer (bench_layer, sorted, two alternating rounds): r16 bs16 +11.4-11.6% against +10.5%, r64 bs16
// +58.1-58.3% against +54.3-54.5%, bs1 -0.4 / +0.1% against -1.5 / -1.1%.
// Past 8 rows (HI) at small ranks, x (16 rows x K, K up to 5120 in 227 KB) is staged once per SM in shared
// memory (XS): one CTA of two teams of 8 warps an SM, each team walking items as a CTA does without XS. x read again
// through L1 by every item cost its L2 traffic twice W's (ncu, gate_up: 377 MB read from L2 against 264 MB).
// Bits: every sum's order is fixed by shapes only (the K ranges and eighths, the MMA chains, j in order), and a
// row's values come from that row's data alone: batch-invariant for any rows <= kGemvRows. Raw pointers; no torch.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "kernels/ptx.cuh"
#include "kernels/types.cuh"
#include "kernels/work.cuh"

namespace lora_kernels {

constexpr int kGemvRows = 16, kGemvWarps = 8, kGemvThreads = 32 * kGemvWarps, kGemvCols = 16;
constexpr int kGemvStep = 32;                          // K per 16-byte load of a lane group (two k16 MMAs)
constexpr int kGemvKAlign = kGemvWarps * kGemvStep;    // K must be a multiple: every warp gets whole steps
constexpr int kGemvUnroll = 4;                         // steps whose loads are in flight together
constexpr int kGemvMaxR = 64, kGemvMaxSplits = 8;
constexpr int kGemvCarveoutPct = 25;                   // of the SM's shared memory (no XS): 2 CTAs' GemvSmem
constexpr int kGemvVCols = kMaxSlices * kGemvMaxR;     // columns of v a row may have (S * R)
constexpr int kGemvXsPad = 32;   // elements after each x row staged in shared memory: rows g, g+1 hit other banks
constexpr int kGemvXsMaxR = 32;  // XS (x in shared memory) up to this pool rank: measured slower at 64
constexpr int kGemvLightShrink = 8;  // shrink items a team with one W item fewer takes first (kernel, below)

// A team is kGemvWarps warps that walk the items together: the whole CTA, or (XS: x staged in shared memory, one
// CTA an SM) half of it, so that two teams share one copy of x as two CTAs of an SM did x's L1 lines.
__device__ __forceinline__ int gemv_tid() { return threadIdx.x % kGemvThreads; }
template <int TEAMS>
__device__ __forceinline__ void gemv_sync() {
  if constexpr (TEAMS == 1)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + static_cast<int>(threadIdx.x / kGemvThreads)), "n"(kGemvThreads)
                 : "memory");
}

struct GemvArgs {
  WorkArgs w;
  const float* scalings;
  int K, out_total, R, N, num_slices;  // N = num_slices * R: columns of v
  int offsets[kMaxSlices + 1];
  int v_items;                         // 16-column blocks of v: cdiv(N, kGemvCols)
  int splits;                          // K ranges of a shrink (fp32 planes of v, summed in order): shape-only
  int items;                           // W items: cdiv(out_total, kGemvCols)
  int* sync;                           // [2]: teams past their shrink items, teams that have seen them all
};

using GemvRed = float[kGemvWarps][kGemvRows][kGemvCols];
struct alignas(16) GemvSmem {
  GemvRed red;                                  // the warps' partial sums over their eighth of K
  float vs[kGemvRows][kGemvVCols];              // v of every row (staged once per CTA)
  int slot[kGemvRows], rank[kGemvRows];
  float scale[kGemvRows];
  int before;  // teams counted on sync[1] before this one (thread 0's, read at the team's end)
};

// Weights (W, A, B): read once per launch, never written by a kernel: not kept in L1, which holds x for the next
// items of this SM's CTAs (they read the same K ranges of x). L2::128B: a load of 8 rows x 64 bytes fetches each
// row's whole 128-byte line, the next step's half with it (H100, layer A/B: 16 rows r16 194.3 -> 189.2 µs, one row
// r16 167.5 -> 162.8, one row r64 171.4 -> 166.2; cuBLAS 167.0 / 163.1 / 162.9; 256B measured a little slower).
__device__ __forceinline__ uint4 ld_w16(const void* p, bool ok) {
  uint4 r = make_uint4(0, 0, 0, 0);
  if (ok)
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  return r;
}
// x: an earlier kernel's output, read only past griddep_wait (which makes its writes visible), through L1.
__device__ __forceinline__ uint4 ld_x16(const void* p, bool ok) {
  return ok ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
}

// acc += x rows (lo, hi) · w row over one kGemvStep step: lane q = lane % 4 holds k 8q..8q+7 of each operand, the
// first MMA takes k 8q+{0,1,2,3}, the second 8q+{4,5,6,7}, in the fragment places of k 2q,2q+1,2q+8,2q+9.
template <typename T>
__device__ __forceinline__ void mma_step(float (&acc)[4], const uint4& lo, const uint4& hi, const uint4& w) {
  const uint32_t a0[4] = {lo.x, hi.x, lo.y, hi.y}, a1[4] = {lo.z, hi.z, lo.w, hi.w};
  mma_16816<T>(acc, a0, w.x, w.y);
  mma_16816<T>(acc, a1, w.z, w.w);
}

// acc[h] += x[rows] · wrow[h] over steps s .. s + n - 1 (n <= N), as one batch: every W load (and x's, unless XS)
// issued first, then the MMAs in step order. Steps past n load nothing and add nothing.
template <typename T, bool HI, bool XS, int N>
__device__ __forceinline__ void gemv_batch(float (&acc)[2][4], const T* const (&wp)[2], const bool (&wok)[2],
                                           const T* xl, bool lok, const T* xh, bool hok, int s, int n) {
  uint4 w[N][2], lo[N], hi[N];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int k = (s + u) * kGemvStep;
    const bool in = u < n;
#pragma unroll
    for (int h = 0; h < 2; ++h) w[u][h] = ld_w16(wp[h] + k, in && wok[h]);
    if (!XS) {
      lo[u] = ld_x16(xl + k, in && lok);
      hi[u] = HI ? ld_x16(xh + k, in && hok) : make_uint4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
    if (u >= n) break;
    if (XS) {
      const int k = (s + u) * kGemvStep;
      lo[u] = ld_x16(xl + k, lok);
      hi[u] = HI ? ld_x16(xh + k, hok) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) mma_step<T>(acc[h], lo[u], hi[u], w[u][h]);
  }
}

// acc[h] += x[rows] · wrow[h] over `steps` steps from the pointers (each already at the lane's first k), in batches
// of kGemvUnroll steps. HI: x rows 8..15 may exist (more than 8 rows); else their fragments are constant zeros,
// without loads. XS: x is in shared memory; only W's loads are batched, x's are read at their MMAs (the same k order
// and MMA chain, so the same bits). Steps past the last whole batch are one more batch, not a round trip each: a
// shrink item's K range may be 2 or 7 steps (H100, 16 rows r16: layer 190.5 -> 187.6 µs; one row r64 167.0 -> 163.8).
template <typename T, bool HI, bool XS>
__device__ __forceinline__ void gemv_steps(float (&acc)[2][4], const T* const (&wp)[2], const bool (&wok)[2],
                                           const T* xl, bool lok, const T* xh, bool hok, int steps) {
  int s = 0;
  for (; s + kGemvUnroll <= steps; s += kGemvUnroll)
    gemv_batch<T, HI, XS, kGemvUnroll>(acc, wp, wok, xl, lok, xh, hok, s, kGemvUnroll);
  if (s < steps) gemv_batch<T, HI, XS, kGemvUnroll - 1>(acc, wp, wok, xl, lok, xh, hok, s, steps - s);
}

// This warp's first k in a K range of `range` elements: the warps take consecutive eighths of it.
__device__ __forceinline__ int64_t gemv_warp_k(int range) { return int64_t{gemv_tid() / 32} * (range / kGemvWarps); }

// Before griddep_wait, each warp prefetches to L2 the first kGemvPrefetchLines 128-byte lines of its eighth of
// each row of its CTA's first W item: W is no kernel's output, so its first reads overlap the previous kernel's tail
// instead of following it (H100, one row: o 17.0 -> 15.0 µs, down 45.9 -> 43.1; 8 or 16 lines were slower).
constexpr int kGemvPrefetchLines = 4;
template <typename T>
__device__ __forceinline__ void gemv_prefetch_item(const T* w, const GemvArgs& p, int item) {
  if (item >= p.items) return;
  const int lane = threadIdx.x % 32;
  const int n = min(item * kGemvCols + lane / 2, p.out_total - 1);  // two lanes a row
  const T* row = w + int64_t{n} * p.K + gemv_warp_k(p.K);
  const int lines = min(kGemvPrefetchLines, p.K / kGemvWarps * int(sizeof(T)) / 128);
  for (int l = lane % 2; l < lines; l += 2)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + l * (128 / sizeof(T))));
}

// The team's partial sums (the 8 warps' eighths of K, in red) of thread (m, c) = gemv_tid() / 16, % 16, in order.
__device__ __forceinline__ void gemv_red_store(GemvRed& red, const float (&acc)[2][4]) {
  const int warp = gemv_tid() / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    *reinterpret_cast<float2*>(&red[warp][g][8 * h + 2 * q]) = make_float2(acc[h][0], acc[h][1]);
    *reinterpret_cast<float2*>(&red[warp][g + 8][8 * h + 2 * q]) = make_float2(acc[h][2], acc[h][3]);
  }
}
__device__ __forceinline__ float gemv_red_sum(const GemvRed& red) {
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kGemvWarps; ++k) s += red[k][gemv_tid() / kGemvCols][gemv_tid() % kGemvCols];
  return s;
}

// Shrink item (tile, 16-column block of v, K range): plane[split][tile rows, c0 .. c0 + 16) = x A[slot, c0 ..]ᵀ
// over the range (8-column groups past the rank skipped: their columns are never read). The K ranges are short, so
// the shrink is spread over every CTA before their W items (a whole-K item measured a tail: 16 of them at down
// beside 256 W items ran two item times on 8 CTAs). CTA-uniform control flow: the tile is the same for every thread.
template <typename T, bool HI, int TEAMS>
__device__ void gemv_shrink_item(const T* x, const T* lora_a, float* v, GemvSmem& sm, const GemvArgs& p, int item) {
  const TileInfo ti = load_tile(p.w, item / (p.v_items * p.splits), p.R);
  const int c0 = item / p.splits % p.v_items * kGemvCols, split = item % p.splits;
  bool wok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) wok[h] = ti.slot >= 0 && c0 + 8 * h < p.N && (c0 + 8 * h) % p.R < ti.rank;
  if (!wok[0] && !wok[1]) return;
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int range = p.K / p.splits, steps = range / kGemvStep / kGemvWarps;
  const int64_t k0 = int64_t{split} * range + gemv_warp_k(range) + 8 * q;
  const T* const wp[2] = {lora_a + (int64_t{ti.slot} * p.N + min(c0 + g, p.N - 1)) * p.K + k0,
                          lora_a + (int64_t{ti.slot} * p.N + min(c0 + 8 + g, p.N - 1)) * p.K + k0};
  const int rlo = tile_row(p.w, ti, g), rhi = tile_row(p.w, ti, g + 8);
  float acc[2][4] = {};
  gemv_steps<T, HI, false>(acc, wp, wok, x + int64_t{max(rlo, 0)} * p.K + k0, rlo >= 0,
                           x + int64_t{max(rhi, 0)} * p.K + k0, rhi >= 0, steps);
  gemv_red_store(sm.red, acc);
  gemv_sync<TEAMS>();
  const int row = tile_row(p.w, ti, gemv_tid() / kGemvCols), c = c0 + gemv_tid() % kGemvCols;
  const float sum = gemv_red_sum(sm.red);
  if (row >= 0 && c < p.N) v[(int64_t{split} * p.w.num_rows + row) * p.N + c] = sum;
  gemv_sync<TEAMS>();  // red is free for the next item
}

// Per row of x: its slot, rank and scaling from the work list (slot -1: the base alone). Batch metadata: no kernel
// writes it, so this runs before griddep_wait.
template <int TEAMS>
__device__ __forceinline__ void gemv_rows(GemvSmem& sm, const GemvArgs& p) {
  if (gemv_tid() < kGemvRows) sm.slot[gemv_tid()] = -1;
  gemv_sync<TEAMS>();
  for (int t = gemv_tid(); t < num_tiles(p.w); t += kGemvThreads) {
    const TileInfo ti = load_tile(p.w, t, p.R);
    if (ti.slot < 0) continue;
    for (int i = 0; i < ti.rows; ++i) {
      const int row = tile_row(p.w, ti, i);
      if (row < 0 || row >= kGemvRows) continue;
      sm.slot[row] = ti.slot;
      sm.rank[row] = ti.rank;
      sm.scale[row] = p.scalings[ti.slot];
    }
  }
  gemv_sync<TEAMS>();
}

// Waits until every team of the grid has written its shrink items (one thread spins, acquire; the barrier orders the
// rest), then counts this team on sync[1].
template <int TEAMS>
__device__ __forceinline__ void gemv_wait_shrink(const GemvArgs& p, bool& ready, GemvSmem& sm) {
  if (ready) return;
  if (gemv_tid() == 0) {
    const int teams = static_cast<int>(gridDim.x) * TEAMS;
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(seen) : "l"(p.sync) : "memory");
      if (seen < teams) __nanosleep(64);
    } while (seen < teams);
    sm.before = atomicAdd(p.sync + 1, 1);  // its result is read at the team's end, off the item's path
  }
  gemv_sync<TEAMS>();
  ready = true;
}

// sm.vs = v summed over its planes in plane order, for the columns under each row's rank. A thread's entries are
// loaded together (kGemvStageBatch of them, every plane), so staging costs a few L2 round trips, not one an entry.
constexpr int kGemvStageBatch = 4;
__device__ __forceinline__ void gemv_stage_v(GemvSmem& sm, const GemvArgs& p, const float* v) {
  const int total = p.w.num_rows * p.N;
  const int64_t stride = int64_t{p.w.num_rows} * p.N;
  for (int i0 = gemv_tid(); i0 < total; i0 += kGemvStageBatch * kGemvThreads) {
    float f[kGemvStageBatch][kGemvMaxSplits];
    bool use[kGemvStageBatch];
#pragma unroll
    for (int u = 0; u < kGemvStageBatch; ++u) {
      const int i = i0 + u * kGemvThreads, mm = i / p.N;
      use[u] = i < total && sm.slot[mm] >= 0 && i % p.N % p.R < sm.rank[mm];
#pragma unroll
      for (int sp = 0; sp < kGemvMaxSplits; ++sp)
        f[u][sp] = use[u] && sp < p.splits ? __ldcg(v + sp * stride + i) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kGemvStageBatch; ++u) {
      float sum = 0.f;
#pragma unroll
      for (int sp = 0; sp < kGemvMaxSplits; ++sp)
        if (sp < p.splits) sum += f[u][sp];
      const int i = i0 + u * kGemvThreads;
      if (use[u]) sm.vs[i / p.N][i % p.N] = sum;
    }
  }
}

// XS: x in shared memory (row stride xstride), and red one of the team's two buffers (used in turn by its items, so
// an item ends without a barrier: H100, 16 rows r16, layer -0.2 to -0.6 µs); else x in global memory, one red.
template <typename T, bool HI, bool XS>
__device__ __forceinline__ void gemv_item(const T* x, int64_t xstride, const T* w, const T* bias, const T* lora_b,
                                          const float* v, T* y, GemvSmem& sm, GemvRed& red, const GemvArgs& p,
                                          int item, bool& ready) {
  constexpr int TEAMS = XS ? 2 : 1;
  const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4, M = p.w.num_rows;
  const int n0 = item * kGemvCols, steps = p.K / kGemvStep / kGemvWarps;
  const int64_t k0 = gemv_warp_k(p.K) + 8 * q;
  const T* const wp[2] = {w + int64_t{min(n0 + g, p.out_total - 1)} * p.K + k0,
                          w + int64_t{min(n0 + 8 + g, p.out_total - 1)} * p.K + k0};
  const bool wok[2] = {n0 + g < p.out_total, n0 + 8 + g < p.out_total};
  const int m = gemv_tid() / kGemvCols, n = n0 + gemv_tid() % kGemvCols;
  const bool mine = m < M && n < p.out_total;
  const int slot = mine ? sm.slot[m] : -1, rank = slot >= 0 ? sm.rank[m] : 0;
  const T* brow = lora_b + (int64_t{max(slot, 0)} * p.out_total + min(n, p.out_total - 1)) * p.R;
  if (rank > 0) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(brow));  // a row of B: at most 128 bytes
  float acc[2][4] = {};
  gemv_steps<T, HI, XS>(acc, wp, wok, x + min(g, M - 1) * xstride + k0, g < M, x + min(g + 8, M - 1) * xstride + k0,
                        g + 8 < M, steps);
  gemv_red_store(red, acc);
  constexpr int kB8 = (XS ? kGemvXsMaxR : kGemvMaxR) / 8;  // XS runs at pool ranks up to kGemvXsMaxR only
  uint4 b[kB8];  // B[slot, n, :rank] (L2 hits: prefetched at the item's start)
#pragma unroll
  for (int c8 = 0; c8 < kB8; ++c8) b[c8] = ld_w16(brow + 8 * c8, 8 * c8 < rank);
  if (!ready) {  // v of every row, once per CTA: the shrink items' output
    gemv_wait_shrink<TEAMS>(p, ready, sm);
    gemv_stage_v(sm, p, v);
  }
  gemv_sync<TEAMS>();  // red (and vs) complete
  float acc_y = gemv_red_sum(red);
  if (mine && bias) acc_y += to_float(bias[n]);
  if (slot >= 0) {
    const float* vrow = &sm.vs[m][slice_at(p.offsets, p.num_slices, n) * p.R];
    float delta = 0.f;
#pragma unroll
    for (int c8 = 0; c8 < kB8; ++c8) {
      const Pack<T, 8> bt = *reinterpret_cast<const Pack<T, 8>*>(&b[c8]);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (8 * c8 + e < rank) delta = fmaf(vrow[8 * c8 + e], to_float(bt.v[e]), delta);
    }
    acc_y = fmaf(sm.scale[m], delta, acc_y);
  }
  if (mine) y[int64_t{m} * p.out_total + n] = from_float<T>(acc_y);
  if (!XS) gemv_sync<TEAMS>();  // red is free for the next item
}

// This team's shrink items are written: count it. The release add is cumulative over the team's v stores, which the
// barrier ordered before it.
template <int TEAMS>
__device__ __forceinline__ void gemv_arrive(const GemvArgs& p) {
  gemv_sync<TEAMS>();
  if (gemv_tid() == 0) asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(p.sync) : "memory");
}

// Issues the copies of x rows 0 .. rows-1 into shared memory (row stride K + kGemvXsPad), by every thread of the CTA.
template <typename T>
__device__ __forceinline__ void gemv_stage_x(T* xs, const T* x, const GemvArgs& p) {
  const int chunks = p.K / 8, stride = p.K + kGemvXsPad;  // 16-byte chunks a row
  for (int i = threadIdx.x; i < p.w.num_rows * chunks; i += blockDim.x)
    cp_async16(xs + (i / chunks) * stride + 8 * (i % chunks), x + int64_t{i / chunks} * p.K + 8 * (i % chunks), 16);
  cp_async_commit();
}

// Shared memory of a launch: each team's GemvSmem, then (XS) each team's second red and x.
template <typename T, bool XS>
constexpr int64_t gemv_smem_bytes(int64_t K) {
  return XS ? 2 * int64_t{sizeof(GemvSmem) + sizeof(GemvRed)} + kGemvRows * (K + kGemvXsPad) * int64_t{sizeof(T)}
            : int64_t{sizeof(GemvSmem)};
}

template <typename T, bool HI, bool XS>
__global__ void __launch_bounds__(kGemvThreads * (XS ? 2 : 1), XS ? 1 : 2)
    lora_gemv_kernel(const T* x, const T* w, const T* bias, const T* lora_a, const T* lora_b, float* v, T* y,
                     const GemvArgs p) {
  constexpr int TEAMS = XS ? 2 : 1;
  extern __shared__ __align__(16) unsigned char gemv_shared[];
  GemvSmem& sm = reinterpret_cast<GemvSmem*>(gemv_shared)[threadIdx.x / kGemvThreads];
  const int team = blockIdx.x * TEAMS + threadIdx.x / kGemvThreads, teams = gridDim.x * TEAMS;
  gemv_rows<TEAMS>(sm, p);
  const int shrink_items = num_tiles(p.w) * p.v_items * p.splits;
  gemv_prefetch_item(w, p, team);
  griddep_launch_dependents();
  griddep_wait();  // x and the sync words: the previous kernel's
  GemvRed* red2 = reinterpret_cast<GemvRed*>(gemv_shared + TEAMS * sizeof(GemvSmem));  // XS only
  T* xs = reinterpret_cast<T*>(gemv_shared + TEAMS * (sizeof(GemvSmem) + sizeof(GemvRed)));
  if constexpr (XS) gemv_stage_x(xs, x, p);
  // W items go t, t + teams, ..., so the last `light` teams hold one W item fewer. Where they are at least half the
  // teams (qkv: 384 items on 264), the first shrink items go to them, up to kGemvLightShrink each, so that no team
  // holds both; the rest are dealt from the last team down.
  const int extra = p.items % teams, light = extra ? teams - extra : 0;
  const int first = 2 * light >= teams ? min(shrink_items, light * kGemvLightShrink) : 0;
  if (team >= extra)
    for (int j = team - extra; j < first; j += light) gemv_shrink_item<T, HI, TEAMS>(x, lora_a, v, sm, p, j);
  for (int j = first + teams - 1 - team; j < shrink_items; j += teams)
    gemv_shrink_item<T, HI, TEAMS>(x, lora_a, v, sm, p, j);
  gemv_arrive<TEAMS>(p);
  if constexpr (XS) {  // x, staged during the shrink items, is complete past the wait and the CTA barrier
    cp_async_wait<0>();
    __syncthreads();
  }
  bool ready = false;
  int local = 0;
  for (int item = team; item < p.items; item += teams, ++local) {
    GemvRed& red = XS && (local & 1) ? red2[threadIdx.x / kGemvThreads] : sm.red;
    gemv_item<T, HI, XS>(XS ? xs : x, XS ? p.K + kGemvXsPad : p.K, w, bias, lora_b, v, y, sm, red, p, item,
                         ready);
  }
  gemv_wait_shrink<TEAMS>(p, ready, sm);  // a team without W items: it too sees the full count before counting
  if (gemv_tid() == 0 && sm.before == teams - 1) {
    atomicExch(p.sync, 0);  // every team has seen the full count: nobody reads the words until the next launch
    atomicExch(p.sync + 1, 0);
  }
}

// CTAs per SM (0: none fits). Without XS the shared-memory carveout is asked to be small (2 CTAs' 26 KB) so that L1
// keeps the x rows that every item of an SM reads again (ncu, 16 rows, gate_up: L1 hit rate 12% with the default
// carveout, x's re-reads then went to L2). With XS one CTA of two teams holds x itself.
template <typename T, bool HI, bool XS>
int gemv_ctas_per_sm(int smem, int smem_optin) {
  constexpr auto kernel = lora_gemv_kernel<T, HI, XS>;
  if constexpr (XS) {  // one CTA an SM by its registers (__launch_bounds__), if its shared memory fits
    return smem <= smem_optin && allow_dynamic_smem<kernel>(smem_optin) == cudaSuccess ? 1 : 0;
  } else {
    static const int n = [smem] {  // smem is sizeof(GemvSmem) here: the same on every call
      int blocks = 0;
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, kGemvCarveoutPct);
      return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kGemvThreads, smem) == cudaSuccess
                 ? blocks
                 : 0;
    }();
    return n;
  }
}

template <typename T, bool HI, bool XS>
cudaError_t launch_lora_gemv(const T* x, const T* w, const T* bias, const T* lora_a, const T* lora_b, float* v, T* y,
                             const GemvArgs& p, const LaunchCfg& cfg, int smem) {
  return launch_kernel<lora_gemv_kernel<T, HI, XS>>(cfg, kGemvThreads * (XS ? 2 : 1), smem, x, w, bias, lora_a,
                                                    lora_b, v, y, p);
}

}  // namespace lora_kernels
