// CUDA-core SGMV kernels over the work list: any dtype, any shape (the path for fp32 and for shapes or
// pointers the tensor-core kernels cannot take), and the ordered split-K reduction. Every (row, column)
// result is a fixed sequence of fp32 operations that depends on that row's data only, never on how many
// rows share its tile or batch (batch invariance). Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "kernels/planes.cuh"
#include "kernels/ptx.cuh"
#include "kernels/types.cuh"
#include "kernels/work.cuh"

namespace lora_kernels {

constexpr int kSimtThreads = 256;
constexpr int kSimtCols = 8;         // shrink: columns of v per item (ShrinkArgs::n_tiles = ceil(N / 8))
constexpr int kSimtRows = 4;         // shrink: rows computed together (x rows share each weight load)
constexpr int kSimtExpandBN = kSimtThreads;  // expand: output columns per item, one per thread
constexpr int kSimtExpandRows = 8;   // expand: rows of v staged in shared memory at a time

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// acc[r][c] = this thread's share of x[row r] . a[column c]: K in VEC-wide chunks tid, tid + 256, ...
// (VEC > 1 only when K % VEC == 0 and x, a are 16-byte aligned).
template <typename T, int VEC>
__device__ __forceinline__ void simt_dot(float (&acc)[kSimtRows][kSimtCols], const T* x, const T* a_cols,
                                         const int (&rows)[kSimtRows], unsigned live, int K) {
  const int nchunks = K / VEC;
  for (int kc = threadIdx.x; kc < nchunks; kc += kSimtThreads) {
    Pack<T, VEC> xp[kSimtRows], ap[kSimtCols];
#pragma unroll
    for (int r = 0; r < kSimtRows; ++r)
      if (rows[r] >= 0) xp[r] = load_pack<T, VEC>(x + static_cast<int64_t>(rows[r]) * K + kc * VEC);
#pragma unroll
    for (int c = 0; c < kSimtCols; ++c)
      if (live >> c & 1u) ap[c] = load_pack<T, VEC>(a_cols + static_cast<int64_t>(c) * K + kc * VEC);
#pragma unroll
    for (int e = 0; e < VEC; ++e)
#pragma unroll
      for (int c = 0; c < kSimtCols; ++c)
#pragma unroll
        for (int r = 0; r < kSimtRows; ++r)
          if (rows[r] >= 0 && (live >> c & 1u))
            acc[r][c] = fmaf(to_float(xp[r].v[e]), to_float(ap[c].v[e]), acc[r][c]);
  }
}

// v[rows, col0 .. col0 + 8) for kSimtRows rows starting at tile row r0: a fixed-order block reduction
// of the threads' shares (warp shuffles, then the 8 warps in order). Columns not live are written 0.
template <typename T, typename V, int VEC>
__device__ __forceinline__ void shrink_simt_rows(const T* x, const T* a_cols, V* v, const ShrinkArgs& p,
                                                 const TileInfo& ti, int r0, int col0, unsigned live,
                                                 float (*red)[kSimtRows * kSimtCols]) {
  int rows[kSimtRows];
#pragma unroll
  for (int r = 0; r < kSimtRows; ++r) rows[r] = tile_row(p.w, ti, r0 + r);
  float acc[kSimtRows][kSimtCols];
#pragma unroll
  for (int r = 0; r < kSimtRows; ++r)
#pragma unroll
    for (int c = 0; c < kSimtCols; ++c) acc[r][c] = 0.f;
  if (live) simt_dot<T, VEC>(acc, x, a_cols, rows, live, p.K);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < kSimtRows; ++r)
#pragma unroll
    for (int c = 0; c < kSimtCols; ++c) {
      const float s = warp_sum(acc[r][c]);
      if (lane == 0) red[warp][r * kSimtCols + c] = s;
    }
  __syncthreads();
  if (threadIdx.x < kSimtRows * kSimtCols) {
    const int r = threadIdx.x / kSimtCols, c = threadIdx.x % kSimtCols;
    const int row = tile_row(p.w, ti, r0 + r);  // not rows[r]: a run-time index would put rows[] in local memory
    if (row >= 0 && col0 + c < p.N) {
      float s = 0.f;
      if (live >> c & 1u)
#pragma unroll
        for (int w = 0; w < kSimtThreads / 32; ++w) s += red[w][threadIdx.x];
      v[static_cast<int64_t>(row) * p.N + col0 + c] = from_float<V>(s);
    }
  }
  __syncthreads();  // red is reused by the next rows
}

// Shrink, item (tile, 8 columns of v); p.splits == 1 (this path writes v directly).
template <typename T, typename V, int VEC>
__global__ void __launch_bounds__(kSimtThreads)
    sgmv_shrink_simt_kernel(const T* __restrict__ x, const T* __restrict__ a, V* __restrict__ v, ShrinkArgs p) {
  __shared__ float red[kSimtThreads / 32][kSimtRows * kSimtCols];
  griddep_launch_dependents();
  bool waited = false;
  const int total = num_tiles(p.w) * p.n_tiles;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const TileInfo ti = load_tile(p.w, item / p.n_tiles, p.R);
    const int col0 = item % p.n_tiles * kSimtCols;
    unsigned live = 0;  // columns computed (the others are written as 0)
    if (ti.slot >= 0) {
#pragma unroll
      for (int c = 0; c < kSimtCols; ++c)
        if (col0 + c < p.N && (col0 + c) % p.R < ti.rank) live |= 1u << c;
    }
    const T* a_cols = a + (static_cast<int64_t>(ti.slot < 0 ? 0 : ti.slot) * p.N + col0) * p.K;
    wait_once(waited);
    for (int r0 = 0; r0 < ti.rows; r0 += kSimtRows)
      shrink_simt_rows<T, V, VEC>(x, a_cols, v, p, ti, r0, col0, live, red);
  }
  wait_once(waited);
}

// out[rows, n] += scale * sum_{j<rank} vs[r][j] * b[n, j] for the staged rows (a fixed-order fma chain).
template <typename T>
__device__ __forceinline__ void expand_simt_column(const float (*vs)[kMaxRank], const int* rows_sm, const T* brow,
                                                   T* out_col, int out_total, int rank, float scale) {
  float acc[kSimtExpandRows];
#pragma unroll
  for (int r = 0; r < kSimtExpandRows; ++r) acc[r] = 0.f;
  for (int j = 0; j < rank; ++j) {
    const float bj = to_float(brow[j]);
#pragma unroll
    for (int r = 0; r < kSimtExpandRows; ++r) acc[r] = fmaf(vs[r][j], bj, acc[r]);
  }
#pragma unroll
  for (int r = 0; r < kSimtExpandRows; ++r)
    if (rows_sm[r] >= 0) {
      T* o = out_col + static_cast<int64_t>(rows_sm[r]) * out_total;
      *o = from_float<T>(to_float(*o) + scale * acc[r]);
    }
}

// Expand, item (tile, column tile of 256 columns inside one slice): thread = output column; v rows
// staged 8 at a time in shared memory (the planes summed in order); acc = fixed-order fma chain over j.
template <typename T, typename V>
__global__ void __launch_bounds__(kSimtThreads)
    sgmv_expand_simt_kernel(const V* __restrict__ v, const T* __restrict__ b, T* __restrict__ out, ExpandArgs p) {
  __shared__ float vs[kSimtExpandRows][kMaxRank];
  __shared__ int rows_sm[kSimtExpandRows];
  griddep_launch_dependents();
  bool waited = false;
  const int total = num_tiles(p.w) * p.n_tiles;
  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    const TileInfo ti = load_tile(p.w, item / p.n_tiles, p.R);
    if (ti.slot < 0) continue;  // block-uniform
    const int ct = item % p.n_tiles, sl = slice_of(p, ct);
    const int n = tile_col0(p, sl, ct, kSimtExpandBN) + threadIdx.x;
    const bool col_ok = n < pick(p.offsets, sl + 1);
    const T* brow = b + (static_cast<int64_t>(ti.slot) * p.out_total + (col_ok ? n : 0)) * p.R;
    const float scale = p.scalings[ti.slot];
    wait_once(waited);
    for (int r0 = 0; r0 < ti.rows; r0 += kSimtExpandRows) {
      __syncthreads();  // the previous rows are done with vs and rows_sm
      if (threadIdx.x < kSimtExpandRows) rows_sm[threadIdx.x] = tile_row(p.w, ti, r0 + threadIdx.x);
      __syncthreads();
      for (int i = threadIdx.x; i < kSimtExpandRows * ti.rank; i += kSimtThreads) {
        const int r = i / ti.rank, j = i % ti.rank;
        const int64_t row = rows_sm[r];
        float s = 0.f;
        if (row >= 0) s = sum_planes(v + row * p.N + sl * p.R + j, p.split_stride, p.splits);
        vs[r][j] = s;
      }
      __syncthreads();
      if (col_ok) expand_simt_column(vs, rows_sm, brow, out + n, p.out_total, ti.rank, scale);
    }
  }
  wait_once(waited);
}

// v[row, c] = sum over the planes of ws, in plane order, for live columns; 0 for the other columns and
// for rows of tiles without LoRA. Item = tile.
// Every plane's load in flight at once (32 registers; the adds in order) measured no faster where it runs at decode
// (from 128 rows, R <= 16): r16 256x1 uniform sorted 86.4 -> 86.5 us a layer, identical 58.8 -> 60.7 (H100).
template <typename V>
__global__ void __launch_bounds__(kSimtThreads)
    sgmv_split_reduce_kernel(const float* __restrict__ ws, V* __restrict__ v, ShrinkArgs p) {
  griddep_launch_dependents();
  bool waited = false;
  const int total = num_tiles(p.w);
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const TileInfo ti = load_tile(p.w, t, p.R);
    wait_once(waited);
    for (int i = threadIdx.x; i < ti.rows * p.N; i += kSimtThreads) {
      const int r = i / p.N, c = i % p.N;
      const int64_t row = tile_row(p.w, ti, r);
      if (row < 0) continue;
      float s = 0.f;
      if (ti.slot >= 0 && c % p.R < ti.rank) s = sum_planes(ws + row * p.N + c, p.split_stride, p.splits);
      v[row * p.N + c] = from_float<V>(s);
    }
  }
  wait_once(waited);
}

template <typename T, typename V>
cudaError_t launch_shrink_simt(const T* x, const T* a, V* v, const ShrinkArgs& p, bool vec16, const LaunchCfg& cfg) {
  constexpr int kVec = 16 / sizeof(T);
  if (vec16) return launch_kernel<sgmv_shrink_simt_kernel<T, V, kVec>>(cfg, kSimtThreads, 0, x, a, v, p);
  return launch_kernel<sgmv_shrink_simt_kernel<T, V, 1>>(cfg, kSimtThreads, 0, x, a, v, p);
}

template <typename T, typename V>
cudaError_t launch_expand_simt(const V* v, const T* b, T* out, const ExpandArgs& p, const LaunchCfg& cfg) {
  return launch_kernel<sgmv_expand_simt_kernel<T, V>>(cfg, kSimtThreads, 0, v, b, out, p);
}

template <typename V>
cudaError_t launch_split_reduce(const float* ws, V* v, const ShrinkArgs& p, const LaunchCfg& cfg) {
  return launch_kernel<sgmv_split_reduce_kernel<V>>(cfg, kSimtThreads, 0, ws, v, p);
}

}  // namespace lora_kernels
