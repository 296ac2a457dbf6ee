// CUDA-core SGMV kernels for segments of a few rows (decode), any dtype and any shape.
//
// Decode is bound by reading each segment's adapter weights from HBM once, so both kernels stream
// the weights with VEC-wide (16-byte) loads, keep many loads in flight per thread and accumulate in
// fp32; x, v and out are small and come from L2. VEC = 1 is the path for dims whose rows are not
// 16-byte aligned. Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/ptx.cuh"
#include "kernels/sgmv_params.cuh"
#include "kernels/types.cuh"

namespace lora_kernels {

constexpr int kSmallThreads = 256;
constexpr int kShrinkMaxCols = 8;  // upper bound of p.cols_per_block
constexpr int kExpandUnroll = 4;   // output-column passes whose weights one thread loads up front
constexpr int kMaxVCols = 4 * 256;  // S * R at most

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> zero_pack() {
  Pack<T, VEC> z;
#pragma unroll
  for (int e = 0; e < VEC; ++e) z.v[e] = from_float<T>(0.f);
  return z;
}

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// Shrink: v[row, c] = sum_k x[row, k] * A[slot, c, k] for c % R < rank, else 0.
// grid: (num_segments, ceil(S*R / cols_per_block), row chunks of ROWS). Each block computes
// cols_per_block columns of v for ROWS rows: all its threads split K (16-byte chunks, two chunks per
// thread in flight per column), then a fixed-order block reduction (deterministic, no atomics).
// Rows of slot -1 / rank-0 segments and columns at or beyond the rank are written as 0.
template <typename T, typename V, int VEC, int ROWS>
__global__ void __launch_bounds__(kSmallThreads)
    sgmv_shrink_small_kernel(const T* __restrict__ x, const T* __restrict__ lora_a, V* __restrict__ v,
                             SgmvParams p) {
  constexpr int C = kShrinkMaxCols;
  constexpr int kWarps = kSmallThreads / 32;
  constexpr int kUnroll = 2;
  __shared__ float red[kWarps][ROWS * C];
  griddep_launch_dependents();

  const int seg = blockIdx.x;
  const int begin = p.seg_indptr[seg], end = p.seg_indptr[seg + 1];
  const int first = begin + blockIdx.z * ROWS;
  if (first >= end) return;
  int rank;
  const int slot = active_slot(p, seg, &rank);
  const int R = p.max_rank, cols = p.num_slices * R, K = p.in_dim;
  const int col0 = blockIdx.y * p.cols_per_block;
  const int ncols = min(p.cols_per_block, cols - col0);
  unsigned live = 0;  // columns this block must compute (the others are written as 0)
  if (slot >= 0) {
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (c < ncols && (col0 + c) % R < rank) live |= 1u << c;
  }
  const T* a_base = lora_a + (static_cast<int64_t>(slot < 0 ? 0 : slot) * cols + col0) * K;
  const int nchunks = K / VEC;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  for (int r0 = first; r0 < end; r0 += gridDim.z * ROWS) {
    const int nrows = min(ROWS, end - r0);
    int64_t prow[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) prow[r] = physical_row(p, r0 + (r < nrows ? r : 0));
    float acc[ROWS][C];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) acc[r][c] = 0.f;

    if (live) {
      for (int kc0 = tid; kc0 < nchunks; kc0 += kUnroll * kSmallThreads) {
        Pack<T, VEC> xp[kUnroll][ROWS], ap[kUnroll][C];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {  // issue every load before the first use
          const int kc = kc0 + u * kSmallThreads;
          const bool ok = kc < nchunks;
#pragma unroll
          for (int r = 0; r < ROWS; ++r)
            xp[u][r] = ok && r < nrows ? load_pack<T, VEC>(x + prow[r] * K + kc * VEC) : zero_pack<T, VEC>();
#pragma unroll
          for (int c = 0; c < C; ++c)
            ap[u][c] = ok && (live >> c & 1u) ? load_pack<T, VEC>(a_base + static_cast<int64_t>(c) * K + kc * VEC)
                                              : zero_pack<T, VEC>();
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            float xf[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) xf[r] = to_float(xp[u][r].v[e]);
#pragma unroll
            for (int c = 0; c < C; ++c) {
              const float af = to_float(ap[u][c].v[e]);
#pragma unroll
              for (int r = 0; r < ROWS; ++r) acc[r][c] = fmaf(xf[r], af, acc[r][c]);
            }
          }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int c = 0; c < C; ++c)
          if (r < nrows && (live >> c & 1u)) {  // block-uniform
            const float s = warp_sum(acc[r][c]);
            if (lane == 0) red[warp][r * C + c] = s;
          }
      __syncthreads();
    }
    if (tid < ROWS * C) {
      const int r = tid / C, c = tid % C;
      if (r < nrows && c < ncols) {
        float s = 0.f;
        if (live >> c & 1u)
#pragma unroll
          for (int w = 0; w < kWarps; ++w) s += red[w][tid];
        v[physical_row(p, r0 + r) * cols + col0 + c] = from_float<V>(s);  // prow[r]: run-time index
      }
    }
    __syncthreads();  // red is reused by the next row chunk
  }
}

// Expand: out[row, n] += scaling * sum_{j<rank} v[row, i*R + j] * B[slot, n, j], n in slice i.
// grid: (num_segments, column tiles, row chunks of ROWS). G = p.lanes_per_col lanes share one output
// column, each loading VEC-wide chunks of its B row (B rows are contiguous in the rank dimension, so
// a warp reads one contiguous stretch), then reduce with shuffles. A thread loads the weights of its
// kExpandUnroll columns before waiting on the producer of v (griddep_wait), so under programmatic
// dependent launch the weight reads overlap the shrink kernel. Slot -1 / rank-0 rows are untouched.
template <typename T, typename V, int VEC, int ROWS>
__global__ void __launch_bounds__(kSmallThreads)
    sgmv_expand_small_kernel(const V* __restrict__ v, const T* __restrict__ lora_b, T* __restrict__ out,
                             SgmvParams p) {
  constexpr int U = kExpandUnroll;
  constexpr int M = (8 / VEC) > 0 ? 8 / VEC : 1;  // chunks per lane per column: ceil(256 / VEC / 32)
  __shared__ float vs[ROWS][kMaxVCols];

  const int seg = blockIdx.x;
  int rank;
  const int slot = active_slot(p, seg, &rank);
  const int begin = p.seg_indptr[seg], end = p.seg_indptr[seg + 1];
  const int first = begin + blockIdx.z * ROWS;
  if (slot < 0 || first >= end) {
    // Every block waits on the producer before it exits: the stream's next kernel is ordered
    // after this grid only, so a grid that finished early could let it overtake the shrink.
    griddep_wait();
    return;
  }

  const int tid = threadIdx.x;
  const int G = p.lanes_per_col;
  const int per_pass = kSmallThreads / G;  // output columns per pass of the block
  const int gi = tid / G, gl = tid % G;
  const int R = p.max_rank, cols = p.num_slices * R, N = p.out_total;
  const int n_base = blockIdx.y * (U * per_pass) + gi;
  const int nch = (rank + VEC - 1) / VEC;  // chunks holding the first `rank` entries of a B row

  Pack<T, VEC> bp[U][M];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int n = n_base + u * per_pass;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int c = gl + m * G;
      bp[u][m] = n < N && c < nch
                     ? load_pack<T, VEC>(lora_b + (static_cast<int64_t>(slot) * N + n) * R + c * VEC)
                     : zero_pack<T, VEC>();
    }
  }
  int vcol[U];  // v column of the start of each column's slice
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int n = n_base + u * per_pass;
    vcol[u] = slice_of(p.slice_offsets, p.num_slices, n) * R;
  }
  const float scale = p.scalings[slot];
  griddep_wait();  // v is written by the preceding (shrink) kernel

  for (int r0 = first; r0 < end; r0 += gridDim.z * ROWS) {
    const int nrows = min(ROWS, end - r0);
    int64_t prow[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) prow[r] = physical_row(p, r0 + (r < nrows ? r : 0));
    __syncthreads();  // readers of the previous chunk's vs are done
    for (int i = tid; i < nrows * cols; i += kSmallThreads) {
      const int r = i / cols, col = i % cols;
      float s = 0.f;
      if (col % R < rank) {
        const V* src = v + physical_row(p, r0 + r) * cols + col;
        s = to_float(__ldcg(src));
#pragma unroll 1
        for (int sp = 1; sp < p.splits; ++sp) s += to_float(__ldcg(src + sp * p.split_stride));  // K-split planes
      }
      vs[r][col] = s;
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int n = n_base + u * per_pass;
      float acc[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int c = gl + m * G;
        if (c < nch) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            const int j = c * VEC + e;
            const float b = j < rank ? to_float(bp[u][m].v[e]) : 0.f;  // stale columns may hold anything
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(vs[r][vcol[u] + j], b, acc[r]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        for (int o = G >> 1; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        if (r < nrows && n < N && gl == (r & (G - 1))) {
          T* o = out + prow[r] * N + n;
          *o = from_float<T>(to_float(*o) + scale * acc[r]);
        }
      }
    }
  }
}

}  // namespace lora_kernels
