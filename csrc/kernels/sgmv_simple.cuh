// First, simple SGMV kernels: correct for every shape, not tuned (the fast paths live beside them).
// Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/types.cuh"

namespace lora_kernels {

struct SgmvParams {
  const int32_t* seg_indptr;      // [num_segments + 1]
  const int32_t* weight_indices;  // [num_segments], -1 = no LoRA
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
};

// v[row, i*R + j] = sum_k x[row, k] * A[slot, i*R + j, k]  (j < rank, else 0; slot -1 rows are 0).
// grid: (num_segments, row tiles); one warp per (row, output column).
template <typename T, typename V>
__global__ void sgmv_shrink_simple_kernel(const T* __restrict__ x, const T* __restrict__ lora_a,
                                          V* __restrict__ v, SgmvParams p) {
  const int seg = blockIdx.x;
  const int begin = p.seg_indptr[seg], end = p.seg_indptr[seg + 1];
  const int slot = p.weight_indices[seg];
  const bool active = slot >= 0 && slot < p.num_slots;
  const int rank = active ? p.lora_ranks[slot] : 0;
  const int cols = p.num_slices * p.max_rank;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int idx = begin + blockIdx.y; idx < end; idx += gridDim.y) {
    const int64_t row = p.permutation ? p.permutation[idx] : idx;
    const T* xr = x + row * p.in_dim;
    for (int c = warp; c < cols; c += warps) {
      float acc = 0.f;
      if (c % p.max_rank < rank) {
        const T* ar = lora_a + (int64_t(slot) * cols + c) * p.in_dim;
        for (int k = lane; k < p.in_dim; k += 32) acc += to_float(xr[k]) * to_float(ar[k]);
        for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
      }
      if (lane == 0) v[row * cols + c] = from_float<V>(acc);
    }
  }
}

// out[row, off[i] + n] += scaling[slot] * sum_{j < rank} v[row, i*R + j] * B[slot, off[i] + n, j].
// grid: (num_segments, row tiles); one thread per output column.
template <typename T, typename V>
__global__ void sgmv_expand_simple_kernel(const V* __restrict__ v, const T* __restrict__ lora_b,
                                          T* __restrict__ out, SgmvParams p) {
  const int seg = blockIdx.x;
  const int slot = p.weight_indices[seg];
  if (slot < 0 || slot >= p.num_slots) return;
  const int rank = p.lora_ranks[slot];
  if (rank == 0) return;
  const float scale = p.scalings[slot];
  const int begin = p.seg_indptr[seg], end = p.seg_indptr[seg + 1];
  const int cols = p.num_slices * p.max_rank;
  for (int idx = begin + blockIdx.y; idx < end; idx += gridDim.y) {
    const int64_t row = p.permutation ? p.permutation[idx] : idx;
    for (int n = threadIdx.x; n < p.out_total; n += blockDim.x) {
      int i = 0;
      while (n >= p.slice_offsets[i + 1]) ++i;
      const V* vr = v + row * cols + i * p.max_rank;
      const T* br = lora_b + (int64_t(slot) * p.out_total + n) * p.max_rank;
      float acc = 0.f;
      for (int j = 0; j < rank; ++j) acc += to_float(vr[j]) * to_float(br[j]);
      T* o = out + row * p.out_total + n;
      *o = from_float<T>(to_float(*o) + scale * acc);
    }
  }
}

}  // namespace lora_kernels
