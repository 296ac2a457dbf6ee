// Every launch decision of the SGMV ops, in one place. Each reduction order (the kernel family, the split-K count,
// the MMA chains) comes from shapes only: dtype size, in_dim, the S*R width of v, the pool rank R, the slice
// offsets, and whether the operands' pointers and rows are 16-byte aligned (else the CUDA-core path); never from
// segments or the work list, so a row's bits do not depend on its batch (batch invariance). The rows of x (and whether
// the work list has one tile a row) pick only among kernels and CTA shapes that compute the same bits (the expand's
// kernel, the shrink's CTA width and item height, its warpgroup-MMA form at prefill), and batch capacities size the
// persistent grids (and, with the SM count, that form's pipeline depth).
#pragma once
#include <algorithm>
#include <cstdint>

#include "kernels/sgmv_expand_mma.cuh"
#include "kernels/sgmv_expand_flat.cuh"
#include "kernels/sgmv_expand_regs.cuh"
#include "kernels/sgmv_expand_stream.cuh"
#include "kernels/sgmv_expand_tall.cuh"
#include "kernels/sgmv_expand_wgmma.cuh"
#include "kernels/sgmv_fused_cluster.cuh"
#include "kernels/sgmv_shrink_mma.cuh"
#include "kernels/sgmv_shrink_wgmma.cuh"
#include "kernels/sgmv_simt.cuh"
#include "ops/limits.h"

namespace lora_kernels {

constexpr int64_t kSplitMinK = 256;  // tensor-core shrink: at least this many K elements (4 slabs) per split
// At most this many splits, by the width N = S*R of v. At decode a split's weight reads are a chain of
// dependent pipeline stages, and a narrow v fills few rows of each 64-row weight slab, so narrow shapes
// need more splits to keep enough bytes in flight; at prefill the planes cost splits * N * 8 bytes of
// traffic per row (written, then read once), which stays small while N is.
inline int64_t max_splits(int64_t N) { return N <= 16 ? 32 : (N <= 32 ? 16 : 8); }
// Prefill, from this many rows of x on: the shrink's items sum their own splits in order and write v (ShrinkPlan.fold),
// so no planes are written, re-read and summed by a kernel of their own. The same sums in the same order: no bit
// changes.
constexpr int64_t kPrefillRows = 1024;
// Below it, sgmv_apply sums the split-K planes in a kernel of their own (instead of in every column tile of the
// expand) from this many rows where the expand is the streaming warps' (kernels/sgmv_expand_stream.cuh), which read a
// single plane without summing. H100, layer µs, sorted: r16 256x1 uniform 86.5 -> 84.0, 256x1 identical 64.2 -> 57.8;
// 64x1 uniform measured 54.6 -> 57.1 from 32 rows. Not for the 16-row kernel: r64 256x1 uniform 187 -> 190.
constexpr int64_t kReduceFirstRowsStream = 128;
// The 16-row kernel (kernels/sgmv_expand_mma.cuh) sums the planes in each of its column tiles: where v's planes feed it
// in kReduceFirstTilesMma column tiles or more (gate_up: 224) from kReduceFirstRowsMma rows, sgmv_apply sums them once
// first too. H100, layer µs (bench A/B in two orders, 2026-11-28, r64): chunked step 1024+63x1 uniform sorted 354-357
// -> 338-339, unsorted 414-418 -> 398-400 (Triton 304-307 / 375-381); at 256 rows 256x1 identical sorted 75.9-76.0 ->
// 77.5-77.7, uniform sorted 165-166 -> 166-167, hence from 512 rows.
constexpr int64_t kReduceFirstRowsMma = 512;
constexpr int kReduceFirstTilesMma = 64;
// The tensor-core expand's kernel by the rows of out and the pool rank R (all compute a row's bits alike, so the
// choice keeps batch invariance): where prefill_plan holds from kTallExpandRows rows and v is 16-byte aligned, one
// short CTA per 64-row x 128-column item up to R = kFlatMaxR (kernels/sgmv_expand_flat.cuh), up to R = kRegsMaxR one
// warpgroup-MMA CTA per 64-row x 128-column item where v is of out's dtype and the build has sm_90a code
// (kernels/sgmv_expand_wgmma.cuh; the regs plan, tried first by ops/sgmv_expand.cu), else warps holding B in
// registers (kernels/sgmv_expand_regs.cuh), beyond kRegsMaxR 64-row items
// (kernels/sgmv_expand_tall.cuh: the 16-row kernel is issue-bound there); below, from 2 rows and up to
// R = kStreamMaxR (kStreamWideMaxR for one-row tiles, below), warps streaming 16-row items
// (kernels/sgmv_expand_stream.cuh); else the 16-row kernel
// (kernels/sgmv_expand_mma.cuh). The header of each says where it measured faster. The tall grid is one CTA per item
// up to kTallCtasPerSm per SM (CTAs that come and go overlap one item's stores with the next one's loads; a
// persistent double-buffered form measured slower, and 256 CTAs 2% slower than 64). The register expand's grid is
// what the SMs hold at once (its launcher asks the occupancy API; kRegsCtasPerSm bounds it); the flat grid is every
// item of the capacity.
constexpr int64_t kTallExpandRows = 1024;
static_assert(kTallExpandRows >= kPrefillRows, "the register expand reads one plane: the shrink folds where it runs");
// The streaming warps also take R up to kStreamWideMaxR (items of 2 or 4 k16 steps) where every tile is one row,
// from kStreamWideRows rows (where v's planes are summed first, kReduceFirstRowsStream). H200, layer µs
// (bench_kernels, the same call), r64, against the 16-row kernel of 8-warp CTAs: 64x1 distinct 266 -> 234 (Triton
// 230), 256x1 distinct 1010 -> 789 (781), unsorted 64x1 / 256x1 uniform 228 -> 196 / 881 -> 672, unsorted identical
// 219 -> 192 / 853 -> 675; against its 4-warp CTAs (kernels/sgmv_expand_mma.cuh, a later call): 256x1 distinct 789 ->
// 783, unsorted uniform 710 -> 675, but 64x1 distinct 213 -> 233 and unsorted uniform 176 -> 197, hence 128 rows. Not
// at 16 rows (16x1 distinct 73.9 -> 78.9), nor with rows sharing tiles, where each warp sums a whole tile's v: sorted
// r64 64x1 / 256x1 uniform 120 -> 124 / 160 -> 166, sorted identical 16x1 / 64x1 / 256x1 30.0 -> 49.6 / 40.0 -> 58.8 /
// 89.2 -> 110. For R <= kStreamMaxR the stream kernel stays (16-row kernel of 4-warp CTAs: r16 16x1 / 64x1 / 256x1
// uniform sorted 36.5 -> 41.1 / 52.6 -> 64.5 / 77.0 -> 95.5). One adapter in full tiles is where the 16-row kernel
// wins (H100, thirtieth session, sorted): identical 16x1 / 64x1 31.8 -> 25.7 / 40.8 -> 33.0 (Triton 20.8 / 27.8), but
// 256x1 identical 59.3 -> 62.5 and uniform 37.1 -> 41.2 / 55.4 -> 65.7, and rows and the capacity cannot tell these
// batches apart; `auto` sends one-segment batches to Triton. Summing the planes first from 2 rows (instead of
// kReduceFirstRowsStream): identical 64x1 40.8 -> 38.8, but 16x1 31.8 -> 34.2, uniform 16x1 37.1 -> 42.2, 64x1 55.4
// -> 58.6.
constexpr int64_t kStreamWideMaxR = 64, kStreamWideRows = 128;
static_assert(kStreamWideRows >= kReduceFirstRowsStream, "the wide streaming warps read one plane of v");
constexpr int kTallCtasPerSm = 64;
constexpr int kRegsCtasPerSm = 8;
constexpr int kFlatCtasPerSm = 1 << 12;  // bounds the grid; past it (batches of ~10^5 rows and more) CTAs loop

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether the prefill plans (the folded shrink; the register and tall expands) run, for rows of x, a work list of
// max_tiles tiles (its capacity) and v of width N: from min_rows rows, with a dense list (at most one tile in
// kDenseTiles beyond those the rows fill: the graph capacity's segments, or an eager list's partial tiles) and at
// least kPrefillMinItems folded items (64-row x 64-column items over the filled tiles). A folded item spans four tiles
// and runs its tiles' adapters one after another and its K splits in turn, so a chunked-prefill step (its decode rows
// one tile each) serializes adapters in a few items, and a short chunk leaves SMs idle. Elsewhere the decode plans
// (split-K items writing planes; the streaming or 16-row expand) run: every plan computes the same bits. H100, layer
// µs (bench_kernels, one call), prefill plans -> decode plans: a 1024 / 2048 / 4096-row chunk + 63 decode rows
// (uniform over 32 slots, unsorted / sorted): r16 809 / 776 -> 219 / 187, 938 / 895 -> 336 / 296, 1230 / 1110 -> 549 /
// 524; r64 1250 / 1050 -> 419 / 358, 1580 / 1320 -> 648 / 597, 2260 / 1770 -> 1100 / 1090. Dense prefill (1024-row
// segments; a later call): 1x1024 r16 240 -> 139, r64 297 -> 235; 2x1024 r16 313 -> 254 (32 items), r64 376 -> 471
// (32-96 items); 4x1024 r16 439 -> 469 (64 items), r64 528 -> 925; 8x1024 r16 764 -> 944, r64 895 -> 1830. With this
// rule at r64 2x1024 (qkv and gate_up fold, o and down do not), 347 against 377 all folded (a third call).
constexpr int64_t kDenseTiles = 16, kPrefillMinItems = 64;
inline bool prefill_plan(int64_t rows, int64_t max_tiles, int64_t N, int64_t min_rows) {
  const int64_t filled = cdiv(rows, kTileM);
  return rows >= min_rows && (max_tiles - filled) * kDenseTiles <= filled &&
         cdiv(filled, kWgTiles) * cdiv(N, kWgCols) >= kPrefillMinItems;
}

struct ShrinkPlan {
  bool mma;         // tensor-core kernel; else the CUDA-core one
  bool vec16;       // CUDA-core kernel: 16-byte loads of x and lora_a
  int splits;       // K splits (fp32 partial planes summed in plane order); 1 = straight into v
  int k_chunk;      // K elements per split
  int n_tiles;      // column tiles of v per work-list tile
  int ctas_per_sm;  // persistent CTAs per SM
  int warps;        // tensor-core kernel: warps of a CTA, 16 columns of v each (its column tile: 16 * warps)
  int stages;       // tensor-core kernel: cp.async pipeline stages
  int tiles;        // tensor-core kernel: work-list tiles of an item (16 rows each)
  bool fold;        // tensor-core kernel: an item runs every split in turn and writes v (no planes)
  bool wgmma;       // prefill: the warpgroup-MMA kernel (kernels/sgmv_shrink_wgmma.cuh) where the device has its
                    // sm_90a code (else the fields above: the mma.sync kernel, the same bits)
};

// The tensor-core shrink's CTA width (warps) and pipeline stages by the rows of x and the width N of v. Every warp
// computes its 16 columns alone (the same MMA chain over its split's K range whatever the CTA), so this choice, unlike
// the splits, may follow the batch: bits do not change. Narrower CTAs spread a decode batch's few items over more
// SMs. H100, layer µs (bench_kernels, the best order; 4 warps x 4 stages before -> this):
// - up to 16 rows with few rows x columns (rows * N <= kShrinkNarrowWork: one warp, 8 stages): r64 bs1 28.7 -> 26.7,
//   r16 16x1 uniform 39.4 -> 36.5, r16 bs1 21.7 -> 21.9 (noise); not at 64 rows (r16 64x1 sorted 60.0, where o and
//   down, N = 16, are within the bound);
// - other batches up to 16 rows: 4 warps (r64 16x1: 77.0 against 78.5 with 2 warps, 80.5 with one x 8 stages);
// - 17 rows up to kPrefillRows: 2 warps: r16 64x1 uniform 57.6 -> 54.4, 256x1 90.1 -> 87.3; r64 64x1 136 -> 136,
//   256x1 188 -> 186 (one warp: as fast sorted, but r64 unsorted 260 against 232 at 64x1);
// - prefill (from kPrefillRows rows): 4 warps, as measured before.
// Deeper pipelines did not help otherwise (9 stages of 4 warps: r16 bs1 21.9, 64x1 sorted 68.3).
constexpr int64_t kShrinkNarrowWork = 1024;
// Prefill (from kPrefillRows rows): items of this many work-list tiles (32 rows), one weight slab per run of tiles of
// one slot, through kShrinkPrefillStages stages, each item running all its splits in turn (ShrinkPlan.fold). H100,
// layer µs at prefill 8x1024 (bench_kernels, the same call): 16-row items with planes and a reduction kernel r16 963,
// r64 1250; 64-row items 875 / 1110 (840 / 1090 in a later call); folded, 64 rows x 4 stages 866 / 1050, 64 x 8
// stages 860 / 1130, 32 x 4 796 / 1020, **32 x 8 777 / 1010** (again: 784 against 845 with planes, 1010 against
// 1090); 32 x 6 793 / 1060; 16 x 8 922 / 1240. 8-warp CTAs (128 columns of v) where N > 64: no gain (r64 1030-1080);
// warps of 32 columns (128-column CTAs) where N > 64, 4 / 6 stages: r64 1010 / 1090 against 1010; 64-row items only
// where N >= 64 (r64, where a 32-row item reads twice its x bytes in weights), 3 / 4 / 6 stages: 1020 / 996 / 1030
// against 973 (the twenty-third session).
constexpr int kShrinkPrefillTiles = 2;
constexpr int kShrinkPrefillStages = 8;
// On sm_90a the prefill shrink is the warpgroup-MMA kernel (64-row x 64-column items, kernels/sgmv_shrink_wgmma.cuh),
// its stages by the items (64-row groups of the work list's capacity x 64-column tiles of v) and the SMs: the deepest
// pipeline whose CTAs an SM (one at 8 stages, 2 at 6, 3 at 4) take every item at once. H100, layer µs at prefill
// 8x1024 (bench_kernels, the same call; mma.sync 976 / 771 at r64 / r16): 6 stages where v has several column tiles,
// else 8: 910 / 770; 6 / 12: 913 / 770; 6 / the mma.sync kernel for one tile: 920 / 772; 4 everywhere 917 / 795, 6 913
// / 770, 8 939 / 763 (an earlier call). ncu, r64, each kernel alone: qkv (390 items) 48 us at 4 stages, 71 at 6 (1.5
// waves; mma.sync 101, Triton 67); gate_up (256) 41 / 39 (mma.sync 67, Triton 40); o, down (128) at 8 stages 34 / 94,
// at 4 38 / 108 (mma.sync 36 / 111). With this rule (45f3651, bench_kernels every case): 894 / 762, Triton 887 / 705.
inline int shrink_wgmma_stages(int64_t items, int sms) {
  return items <= sms ? 8 : (items <= 2 * int64_t{sms} ? 6 : 4);
}

// elem: bytes per element of x; aligned: x and lora_a start 16-byte aligned; rows: rows of x; max_tiles: the work
// list's tile capacity.
inline ShrinkPlan plan_shrink(int elem, int64_t K, int64_t N, bool aligned, int64_t rows, int64_t max_tiles) {
  ShrinkPlan s{};
  s.mma = elem == 2 && K % 8 == 0 && aligned;
  if (s.mma) {
    const int64_t splits = std::clamp<int64_t>(cdiv(K, kSplitMinK), 1, max_splits(N));
    const int64_t chunk = std::max<int64_t>(cdiv(cdiv(K, splits), kMmaBK) * kMmaBK, kMmaBK);
    s.k_chunk = static_cast<int>(chunk);
    s.splits = static_cast<int>(std::max<int64_t>(1, cdiv(K, chunk)));
    const bool narrow = rows <= kTileM && rows * N <= kShrinkNarrowWork;
    const bool prefill = prefill_plan(rows, max_tiles, N, kPrefillRows);
    s.warps = narrow ? 1 : (rows <= kTileM || prefill ? 4 : 2);
    s.stages = narrow ? 8 : (prefill ? kShrinkPrefillStages : kShrinkStages);
    s.n_tiles = static_cast<int>(cdiv(N, int64_t{kWarpN} * s.warps));
    s.ctas_per_sm = narrow ? 16 : 16 / s.warps;  // 40 KB of pipeline per 4-warp CTA; 32 KB per one-warp CTA
    s.tiles = prefill ? kShrinkPrefillTiles : 1;
    s.fold = prefill && s.splits > 1;
    if (prefill) s.ctas_per_sm = 2;  // 96 KB of pipeline per CTA
    s.wgmma = prefill;
  } else {
    s.vec16 = (K * elem) % 16 == 0 && aligned;
    s.splits = 1;
    s.k_chunk = static_cast<int>(K);
    s.n_tiles = static_cast<int>(cdiv(N, kSimtCols));
    s.ctas_per_sm = 4;
    s.tiles = 1;
  }
  return s;
}

// Most CTAs the shrink's grid can use for max_tiles work-list tiles: one per item.
inline int64_t shrink_items_upper(const ShrinkPlan& s, int64_t max_tiles) {
  return cdiv(max_tiles, s.tiles) * s.n_tiles * (s.fold ? 1 : s.splits);
}

enum class ExpandKernel { simt, mma, stream, tall, regs, flat };

struct ExpandPlan {
  ExpandKernel kernel;
  int cols;                        // output columns of an item's column tile
  int n_tiles;                     // column tiles over all slices
  int tile_start[kMaxSlices + 1];  // first column tile of each slice
  int ctas_per_sm;
  bool one_row;  // one row of out: the mma kernel loads the row's planes all at once (kernels/sgmv_expand_mma.cuh)
};

// aligned: lora_b and out start 16-byte aligned and v is aligned to 4 of its elements; v16: v starts 16-byte aligned
// (the register expand copies v's rows in 16-byte chunks); rows: rows of out; max_tiles: the work list's tile capacity
// (as many tiles as rows: every tile one row, as in an unsorted decode batch).
inline ExpandPlan plan_expand(int elem, int64_t R, const int64_t* offsets, int num_slices, bool aligned, bool v16,
                              int64_t rows, int64_t max_tiles) {
  const bool one_row_tiles = max_tiles == rows;
  const bool prefill = prefill_plan(rows, max_tiles, num_slices * R, kTallExpandRows);
  ExpandPlan e{};
  bool offsets8 = true;
  for (int i = 0; i <= num_slices; ++i) offsets8 = offsets8 && offsets[i] % 8 == 0;
  const bool mma = elem == 2 && R % 8 == 0 && offsets8 && aligned;
  e.one_row = rows == 1;
  const auto pick_kernel = [&e](ExpandKernel kernel, int cols, int ctas_per_sm) {
    e.kernel = kernel;
    e.cols = cols;
    e.ctas_per_sm = ctas_per_sm;
  };
  if (!mma)
    pick_kernel(ExpandKernel::simt, kSimtExpandBN, 4);
  else if (prefill && R <= kFlatMaxR && v16)
    pick_kernel(ExpandKernel::flat, kFlatCols, kFlatCtasPerSm);
  else if (prefill && R <= kRegsMaxR && v16)
    pick_kernel(ExpandKernel::regs, kRegsCols, kRegsCtasPerSm);
  else if (prefill)
    pick_kernel(ExpandKernel::tall, kExpandBN, kTallCtasPerSm);
  else if (rows >= 2 && (R <= kStreamMaxR || (R <= kStreamWideMaxR && one_row_tiles && rows >= kStreamWideRows)))
    pick_kernel(ExpandKernel::stream, kStreamCols, stream_ctas_per_sm(stream_ks(R)));
  else  // 8-warp CTAs at one row, 4 an SM; else 4-warp CTAs (kernels/sgmv_expand_mma.cuh)
    pick_kernel(ExpandKernel::mma, kExpandBN, e.one_row ? 4 : kExpandCtasPerSmRows);
  e.tile_start[0] = 0;
  for (int i = 0; i < kMaxSlices; ++i) {
    const int64_t width = i < num_slices ? offsets[i + 1] - offsets[i] : 0;
    e.tile_start[i + 1] = e.tile_start[i] + static_cast<int>(cdiv(width, e.cols));
  }
  e.n_tiles = e.tile_start[num_slices];
  return e;
}

// Most CTAs the expand's grid can use for max_tiles work-list tiles: one per item (a tall or flat item takes
// kTallTiles / kFlatTiles tiles; a stream or register CTA takes kStreamWarps / kRegsWarps items at once).
inline int64_t expand_items_upper(const ExpandPlan& e, int64_t max_tiles) {
  if (e.kernel == ExpandKernel::tall) return cdiv(max_tiles, kTallTiles) * e.n_tiles;
  if (e.kernel == ExpandKernel::flat) return cdiv(max_tiles, kFlatTiles) * e.n_tiles;
  if (e.kernel == ExpandKernel::regs) return cdiv(max_tiles * e.n_tiles, kRegsWarps);
  if (e.kernel == ExpandKernel::stream) return cdiv(max_tiles * e.n_tiles, kStreamWarps);
  return max_tiles * e.n_tiles;
}

// sgmv_apply's one-launch path (kernels/sgmv_fused_cluster.cuh; opt-in, LORA_KERNELS_CUDA_FUSED=1, sm_90+) up to
// this many rows of x: beyond it a cluster runs a tile's whole expand alone (tiles outnumber clusters / 2), which
// measured 2-3x slower than the two launches at 16 rows. It computes the two launches' bits, so the choice by rows
// keeps batch invariance.
constexpr int64_t kFusedMaxRows = 8;
// sgmv_linear's bound on the same path, where its caller asks (one_launch). Its eager callers (the HF decode step)
// are host-bound: one launch instead of two saves host time there, and the cluster kernel's longer GPU time hides
// behind the host's.
constexpr int64_t kFusedMaxRowsLinear = 64;

// Whether the one-launch kernel covers these plans: both tensor-core paths, R a multiple of 16 up to
// kFusedMaxR (one rank slab), and the partial blocks of an owner CTA within its shared memory.
inline bool fused_fits(const ShrinkPlan& s, const ExpandPlan& e, int64_t R, int64_t N) {
  if (!s.mma || e.kernel == ExpandKernel::simt || R % 16 != 0 || R > kFusedMaxR || N % 16 != 0) return false;
  return s.splits * fused_groups_per_owner(static_cast<int>(N)) <= kFusedMaxParts;
}

// Persistent grid: ctas_per_sm CTAs on every SM, never more than the work list's capacity can use.
inline int persistent_grid(int64_t items_upper, int ctas_per_sm, int num_sms) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items_upper, int64_t{ctas_per_sm} * num_sms)));
}

}  // namespace lora_kernels
