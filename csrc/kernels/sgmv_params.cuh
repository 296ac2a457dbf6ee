// Launch parameters shared by every SGMV kernel (simple, CUDA-core and tensor-core paths).
// Raw pointers only; no torch headers.
#pragma once
#include <cstdint>

namespace lora_kernels {

struct SgmvParams {
  const int32_t* seg_indptr;      // [num_segments + 1]
  const int32_t* weight_indices;  // [num_segments], -1 (or >= num_slots) = no LoRA
  const int32_t* lora_ranks;      // [num_slots]
  const float* scalings;          // [num_slots] (expand only)
  const int32_t* permutation;     // [rows] or nullptr
  int num_segments;
  int num_slots;
  int num_slices;
  int max_rank;   // R: lora_a rows per slice, lora_b columns
  int in_dim;     // shrink: K; expand: unused
  int out_total;  // expand: output columns; shrink: unused
  int slice_offsets[5];
  // Geometry chosen on the host from capacities only (graph-safe):
  int cols_per_block;  // CUDA-core shrink: output columns of v per block (1..8)
  int lanes_per_col;   // CUDA-core expand: lanes sharing one output column (power of 2, <= 32)
  int tile_start[5];   // tensor-core expand: first column tile of each slice (prefix sum, [S] = total)
  // Split-K of the tensor-core shrink: `splits` fp32 planes of partial sums, `split_stride` elements
  // apart ([splits, T, S*R]); the shrink writes them, the expand (or a reduce kernel) sums them in
  // plane order, so the result does not depend on scheduling. splits == 1: v itself, no planes.
  int splits;
  int k_chunk;  // K elements per split (a multiple of 64)
  int64_t split_stride;
  int window;   // tensor-core kernels: segmented rows per row window (<= the tile's rows)
};

// Slot of segment `seg` if it carries an adapter of rank > 0, else -1 (also for slot >= num_slots,
// which the host-side builder rejects; the kernels must still never index out of bounds with it).
__device__ __forceinline__ int active_slot(const SgmvParams& p, int seg, int* rank) {
  const int slot = p.weight_indices[seg];
  if (slot < 0 || slot >= p.num_slots) {
    *rank = 0;
    return -1;
  }
  const int r = p.lora_ranks[slot];
  *rank = r < p.max_rank ? r : p.max_rank;  // a rank above the pool's R would read past the slice
  return *rank > 0 ? slot : -1;
}

// a[i] for a run-time i without indexing the kernel-parameter array at run time (that would copy the
// array to local memory).
__device__ __forceinline__ int pick(const int (&a)[5], int i) {
  int r = a[0];
#pragma unroll
  for (int k = 1; k < 5; ++k)
    if (i == k) r = a[k];
  return r;
}

// Largest k < num_slices with starts[k] <= n: the slice holding n when starts are non-decreasing
// slice starts (empty slices are skipped because the next one starts at the same place).
__device__ __forceinline__ int slice_of(const int (&starts)[5], int num_slices, int n) {
  int s = 0;
#pragma unroll
  for (int k = 1; k < 4; ++k)
    if (k < num_slices && n >= starts[k]) s = k;
  return s;
}

__device__ __forceinline__ int64_t physical_row(const SgmvParams& p, int idx) {
  return p.permutation ? static_cast<int64_t>(p.permutation[idx]) : static_cast<int64_t>(idx);
}

}  // namespace lora_kernels
