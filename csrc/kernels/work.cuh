// The batch as every SGMV kernel reads it: the builder's work list (lora_kernels/batch_info.py) and
// the per-op arguments. Raw pointers only; no torch headers.
//
// work = int32[1 + 3 * max_tiles]: work[0] = tiles in use n; for t < n: slot = work[1 + t], first
// segmented row = work[1 + m + t], segment end = work[1 + 2m + t] (m = max_tiles). Tile t covers the
// segmented rows [row0, min(row0 + kTileM, end)); segmented row i is physical row perm[i] (or i).
#pragma once
#include <cstdint>

#include "ops/limits.h"

namespace lora_kernels {

struct WorkArgs {
  const int32_t* work;        // [1 + 3 * max_tiles]
  const int32_t* lora_ranks;  // [num_slots]
  const int32_t* perm;        // [perm_len] or nullptr (identity)
  int max_tiles;
  int num_slots;
  int perm_len;  // entries of perm (unused without one)
  int num_rows;  // rows of x / v / out: a row index at or past it is never touched
};

struct ShrinkArgs {
  WorkArgs w;
  int K;        // in_dim
  int R;        // max rank (lora_a rows per slice)
  int N;        // S * R: columns of v
  int n_tiles;  // column tiles of the N axis
  int splits;   // K splits; > 1: fp32 partials go to ws[split][row][N], reduced in split order later
  int k_chunk;  // K elements per split
  int64_t split_stride;  // elements between two planes of ws (num_rows * N)
};

struct ExpandArgs {
  WorkArgs w;
  const float* scalings;  // [num_slots]
  int R;                  // max rank (lora_b columns)
  int N;                  // columns of v (S * R)
  int out_total;          // columns of out
  int num_slices;
  int offsets[kMaxSlices + 1];     // slice_offsets
  int tile_start[kMaxSlices + 1];  // first column tile of each slice; [num_slices] = total tiles
  int n_tiles;                     // column tiles of all slices
  int splits;                      // planes of v to sum (in order): the shrink's fp32 partials, or 1
  int64_t split_stride;
};

struct TileInfo {
  int slot;  // -1: no LoRA (slot -1, out of range or rank 0)
  int rank;  // min(lora_ranks[slot], R); 0 when slot is -1
  int row0;  // first segmented row
  int rows;  // rows of the tile (0..kTileM)
};

__device__ __forceinline__ int num_tiles(const WorkArgs& w) {
  const int n = w.work[0];
  return n < w.max_tiles ? (n > 0 ? n : 0) : w.max_tiles;
}

// Tile t of the list without its rank (rank -1): its slot (-1 outside [0, num_slots), which the builder rejects) and
// rows. Enough to address the tile's rows before the rank arrives (tile_rank).
__device__ __forceinline__ TileInfo load_tile_rows(const WorkArgs& w, int t) {
  const int m = w.max_tiles;
  TileInfo ti;
  ti.slot = w.work[1 + t];
  ti.row0 = w.work[1 + m + t];
  const int end = w.work[1 + 2 * m + t];
  const int rows = end - ti.row0;
  ti.rows = rows < 0 ? 0 : (rows < kTileM ? rows : kTileM);
  ti.rank = -1;
  if (ti.slot < 0 || ti.slot >= w.num_slots) ti.slot = -1;
  return ti;
}

// The tile's rank, min(lora_ranks[slot], R), clamped to [0, R]; slot -1 where it is 0 (no LoRA).
__device__ __forceinline__ TileInfo tile_rank(const WorkArgs& w, TileInfo ti, int R) {
  ti.rank = 0;
  if (ti.slot >= 0) {
    const int r = w.lora_ranks[ti.slot];
    ti.rank = r < R ? (r > 0 ? r : 0) : R;
  }
  if (ti.rank == 0) ti.slot = -1;
  return ti;
}

// Tile t of the list; a slot outside [0, num_slots) (which the builder rejects) counts as no LoRA, and
// a rank above R is clamped, so no kernel ever indexes out of bounds with bad metadata.
__device__ __forceinline__ TileInfo load_tile(const WorkArgs& w, int t, int R) {
  return tile_rank(w, load_tile_rows(w, t), R);
}

// Physical row of row i (< ti.rows) of the tile, or -1 if it lies outside x (bad metadata).
__device__ __forceinline__ int tile_row(const WorkArgs& w, const TileInfo& ti, int i) {
  const int seg_row = ti.row0 + i;
  if (i >= ti.rows || seg_row < 0) return -1;
  int row = seg_row;
  if (w.perm) {
    if (seg_row >= w.perm_len) return -1;
    row = w.perm[seg_row];
  }
  return row >= 0 && row < w.num_rows ? row : -1;
}

// a[i] for a run-time i without indexing the kernel-parameter array at run time (that would copy the
// array to local memory).
__device__ __forceinline__ int pick(const int (&a)[kMaxSlices + 1], int i) {
  int r = a[0];
#pragma unroll
  for (int k = 1; k <= kMaxSlices; ++k)
    if (i == k) r = a[k];
  return r;
}

// The slice holding position i, given each slice's first position (start[k], k < num_slices): the largest such k
// with start[k] <= i (an empty slice starts where the next one does, so it is never the answer).
__device__ __forceinline__ int slice_at(const int (&start)[kMaxSlices + 1], int num_slices, int i) {
  int s = 0;
#pragma unroll
  for (int k = 1; k < kMaxSlices; ++k)
    if (k < num_slices && i >= start[k]) s = k;
  return s;
}

// The slice holding column tile ct.
__device__ __forceinline__ int slice_of(const ExpandArgs& p, int ct) {
  return slice_at(p.tile_start, p.num_slices, ct);
}

// The first output column of column tile ct (of `cols` columns) of slice sl (slice_of(p, ct)).
__device__ __forceinline__ int tile_col0(const ExpandArgs& p, int sl, int ct, int cols) {
  return pick(p.offsets, sl) + (ct - pick(p.tile_start, sl)) * cols;
}

}  // namespace lora_kernels
