// Tensor-core SGMV kernels (mma.sync m16n8k16, fp32 accumulators) for fp16/bf16 segments of many rows
// (prefill). Requirements checked by the host: 16-bit dtype, in_dim % 8 == 0, R % 8 == 0, every slice
// offset % 8 == 0 and 16-byte aligned base pointers. Raw pointers only; no torch headers.
//
// Both are segmented GEMMs C[rows, n] = X[rows, k] * W[n, k]^T with both operands K-contiguous:
//   shrink: X = x (gathered through the permutation), W = lora_a[slot], K = in_dim
//   expand: X = v (fp32 -> 16-bit on the way into shared memory), W = lora_b[slot], K = rank
// Tiles live in shared memory as rows of 64 elements (8 chunks of 16 bytes) with the chunk index
// XOR-swizzled by (row % 8), so both cp.async stores and ldmatrix reads are bank-conflict free.
//
// Grids cover row windows of the segmented row space, not (segment, row tile) pairs: in graph mode
// max_seg_len is the token capacity and the segment count a capacity too, so a (segment, row tile)
// grid would be mostly empty blocks. A block takes the p.window rows [w0, w1) of its window and runs
// one tile per segment that intersects them (usually one; a few when segments are short).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include "kernels/ptx.cuh"
#include "kernels/sgmv_params.cuh"
#include "kernels/types.cuh"

namespace lora_kernels {

constexpr int kMmaBK = 64;  // K elements per shared-memory slab (128 bytes per row)

constexpr int kShrinkBM = 64, kShrinkBN = 64, kShrinkStages = 4, kShrinkThreads = 128;
constexpr int kShrinkSmemBytes = kShrinkStages * (kShrinkBM + kShrinkBN) * kMmaBK * 2;

constexpr int kExpandBM = 64, kExpandBN = 128, kExpandThreads = 256;
constexpr int kExpandOutLd = kExpandBN + 8;  // padded row: epilogue fragment accesses hit distinct banks
constexpr int kExpandSmemBytes = (kExpandBM * kExpandOutLd + (kExpandBM + kExpandBN) * kMmaBK) * 2;

__device__ __forceinline__ int swz(int row, int chunk) { return row * kMmaBK + ((chunk ^ (row & 7)) << 3); }

// Finds the segments holding the first and the last row of [w0, w1) (seg_sm[0], seg_sm[1]; an empty
// range [0, -1] if the metadata has no such segment). All threads scan seg_indptr with independent
// loads (no chain of dependent loads, as a binary search would be). Block-wide; syncs inside.
__device__ __forceinline__ void window_segments(const SgmvParams& p, int w0, int w1, int* seg_sm) {
  __syncthreads();  // readers of the previous window's seg_sm are done
  if (threadIdx.x == 0) {
    seg_sm[0] = 0;
    seg_sm[1] = -1;
  }
  __syncthreads();
  for (int s = threadIdx.x; s < p.num_segments; s += blockDim.x) {
    const int b = p.seg_indptr[s], e = p.seg_indptr[s + 1];
    if (b <= w0 && w0 < e) seg_sm[0] = s;  // at most one segment holds a given row
    if (b < w1 && w1 <= e) seg_sm[1] = s;
  }
  __syncthreads();
}

// One warp's MMAs over a 64-wide K slab: rows [m_off, m_off + 16*MT) of xs times rows
// [n_off, n_off + 8*NT) of ws, the first `ksteps` (<= 4) k16 steps only.
template <typename T, int MT, int NT>
__device__ __forceinline__ void warp_mma_slab(float (&acc)[MT][NT][4], const T* xs, const T* ws, int m_off, int n_off,
                                              int ksteps, int lane) {
  static_assert(NT % 2 == 0, "B fragments are loaded two n8 tiles at a time");
#pragma unroll
  for (int ks = 0; ks < kMmaBK / 16; ++ks) {
    if (ks < ksteps) {
      uint32_t a[MT][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], xs + swz(m_off + mt * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        uint32_t r[4];
        ldmatrix_x4(r, ws + swz(n_off + nt * 8 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1)));
        b[nt][0] = r[0];
        b[nt][1] = r[1];
        b[nt + 1][0] = r[2];
        b[nt + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_16816<T>(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  }
}

template <typename V>
__device__ __forceinline__ void store_pair(V* dst, float a, float b) {
  Pack<V, 2> pk;
  pk.v[0] = from_float<V>(a);
  pk.v[1] = from_float<V>(b);
  *reinterpret_cast<Pack<V, 2>*>(dst) = pk;
}

// Shrink. grid: (column tiles x K splits, row windows); 4 warps in 2x2, 32x32 each; a 4-stage
// cp.async pipeline over the split's K range. Columns at or beyond the rank (and slot -1 rows) come
// out 0 because their weight rows are zero-filled. With p.splits > 1 each split writes its fp32
// partial sums to its plane of ws instead of v (few rows: the K splits fill the GPU).
template <typename T, typename V>
__global__ void __launch_bounds__(kShrinkThreads)
    sgmv_shrink_mma_kernel(const T* __restrict__ x, const T* __restrict__ lora_a, V* __restrict__ v,
                           float* __restrict__ ws, SgmvParams p) {
  constexpr int BM = kShrinkBM, BN = kShrinkBN, BK = kMmaBK, ST = kShrinkStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);  // [ST][BM * BK]
  T* wt = xs + ST * BM * BK;               // [ST][BN * BK]
  __shared__ int rows_sm[BM];              // physical row, -1 past the segment
  __shared__ int seg_sm[2];
  griddep_launch_dependents();

  const int R = p.max_rank, N = p.num_slices * R, K = p.in_dim;
  const int n_tiles = (N + BN - 1) / BN;
  const int split = blockIdx.x / n_tiles;
  const int n0 = (blockIdx.x - split * n_tiles) * BN;
  const int kbeg = split * p.k_chunk, kend = min(K, kbeg + p.k_chunk);
  const int KT = kend > kbeg ? (kend - kbeg + BK - 1) / BK : 0;
  float* part = p.splits > 1 ? ws + split * p.split_stride : nullptr;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  const int chunk = tid & 7;  // each thread copies the same 16-byte chunk of 4 rows of each tile
  const int total = p.seg_indptr[p.num_segments];

  for (int w0 = blockIdx.y * p.window; w0 < total; w0 += gridDim.y * p.window) {
    window_segments(p, w0, min(w0 + p.window, total), seg_sm);
    const int s_last = seg_sm[1];
    for (int seg = seg_sm[0]; seg <= s_last; ++seg) {
      const int row0 = max(p.seg_indptr[seg], w0), end = min(p.seg_indptr[seg + 1], w0 + p.window);
      if (row0 >= end) continue;  // an empty segment between two others
      int rank;
      const int slot = active_slot(p, seg, &rank);
      __syncthreads();  // the previous tile's epilogue has read rows_sm
      if (tid < BM) rows_sm[tid] = row0 + tid < end ? static_cast<int>(physical_row(p, row0 + tid)) : -1;
      __syncthreads();
      if (slot < 0) {
        for (int i = tid; i < BM * BN; i += kShrinkThreads) {
          const int r = i / BN, c = n0 + i % BN;
          if (rows_sm[r] >= 0 && c < N) {
            if (part)
              part[static_cast<int64_t>(rows_sm[r]) * N + c] = 0.f;
            else
              v[static_cast<int64_t>(rows_sm[r]) * N + c] = from_float<V>(0.f);
          }
        }
        continue;
      }
      const T* xsrc[4];
      const T* wsrc[4];
      bool xok[4], wok[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = (tid >> 3) + i * 16;
        xok[i] = rows_sm[r] >= 0;
        xsrc[i] = x + static_cast<int64_t>(xok[i] ? rows_sm[r] : 0) * K + kbeg + chunk * 8;
        const int n = n0 + r;
        wok[i] = n < N && n % R < rank;
        wsrc[i] = lora_a + (static_cast<int64_t>(slot) * N + (wok[i] ? n : 0)) * K + kbeg + chunk * 8;
      }
      auto load_stage = [&](int stage, int kt) {
        const bool kok = kbeg + kt * BK + chunk * 8 < kend;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = (tid >> 3) + i * 16;
          const bool xo = xok[i] && kok, wo = wok[i] && kok;
          cp_async16(xs + stage * BM * BK + swz(r, chunk), xo ? xsrc[i] + kt * BK : x, xo ? 16 : 0);
          cp_async16(wt + stage * BN * BK + swz(r, chunk), wo ? wsrc[i] + kt * BK : lora_a, wo ? 16 : 0);
        }
      };

      float acc[2][4][4];
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
      const bool warp_live = n0 + wn * 32 < N && row0 + wm * 32 < end;

#pragma unroll
      for (int s = 0; s < ST - 1; ++s) {
        if (s < KT) load_stage(s, s);
        cp_async_commit();
      }
      for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<ST - 2>();
        __syncthreads();  // slab kt landed for all threads; slab kt-1 is free to overwrite
        const int nk = kt + ST - 1;
        if (nk < KT) load_stage(nk % ST, nk);
        cp_async_commit();
        if (warp_live)
          warp_mma_slab<T, 2, 4>(acc, xs + (kt % ST) * BM * BK, wt + (kt % ST) * BN * BK, wm * 32, wn * 32, 4, lane);
      }
      cp_async_wait<0>();

#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t pr = rows_sm[wm * 32 + mt * 16 + (lane >> 2) + h * 8];
            const int c = n0 + wn * 32 + nt * 8 + (lane & 3) * 2;
            if (pr >= 0 && c < N) {
              if (part)
                store_pair(part + pr * N + c, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
              else
                store_pair(v + pr * N + c, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
            }
          }
    }
  }
}

// Expand. grid: (column tiles of all slices, row windows); 8 warps in 2x4, 32x32 each. A column tile
// never crosses a slice boundary (p.tile_start), so one slice of v feeds it. The out tile and the
// first weight slab are requested before griddep_wait, so under programmatic dependent launch they
// stream in while the shrink kernel finishes; the epilogue adds scaling * acc to the out tile in
// shared memory and writes it back with coalesced 16-byte stores. Slot -1 / rank-0 rows: untouched.
template <typename T, typename V>
__global__ void __launch_bounds__(kExpandThreads)
    sgmv_expand_mma_kernel(const V* __restrict__ v, const T* __restrict__ lora_b, T* __restrict__ out, SgmvParams p) {
  constexpr int BM = kExpandBM, BN = kExpandBN, BK = kMmaBK, LD = kExpandOutLd;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* out_sm = reinterpret_cast<T*>(smem_raw);  // [BM][LD]
  T* vs = out_sm + BM * LD;                     // [BM * BK]
  T* bs = vs + BM * BK;                         // [BN * BK]
  __shared__ int rows_sm[BM];                   // physical row, -1 past the segment
  __shared__ int seg_sm[2];

  const int tile = blockIdx.x;
  const int sl = slice_of(p.tile_start, p.num_slices, tile);
  const int n0 = pick(p.slice_offsets, sl) + (tile - pick(p.tile_start, sl)) * BN;
  const int n_end = pick(p.slice_offsets, sl + 1);
  const int R = p.max_rank, cols = p.num_slices * R, N = p.out_total;
  const int vcol0 = sl * R;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps
  const int total = p.seg_indptr[p.num_segments];
  bool waited = false;

  for (int w0 = blockIdx.y * p.window; w0 < total; w0 += gridDim.y * p.window) {
    window_segments(p, w0, min(w0 + p.window, total), seg_sm);
    const int s_last = seg_sm[1];
    for (int seg = seg_sm[0]; seg <= s_last; ++seg) {
      const int row0 = max(p.seg_indptr[seg], w0), end = min(p.seg_indptr[seg + 1], w0 + p.window);
      int rank;
      const int slot = active_slot(p, seg, &rank);
      if (row0 >= end || slot < 0) continue;
      const float scale = p.scalings[slot];
      const int KT = (rank + BK - 1) / BK;
      __syncthreads();  // the previous tile's epilogue is done with rows_sm and out_sm
      if (tid < BM) rows_sm[tid] = row0 + tid < end ? static_cast<int>(physical_row(p, row0 + tid)) : -1;
      __syncthreads();
#pragma unroll
      for (int i = 0; i < (BM * BN / 8) / kExpandThreads; ++i) {
        const int idx = tid + i * kExpandThreads, r = idx >> 4, c = idx & 15;
        if (rows_sm[r] >= 0 && n0 + c * 8 < n_end)
          cp_async16(out_sm + r * LD + c * 8, out + static_cast<int64_t>(rows_sm[r]) * N + n0 + c * 8, 16);
      }
      cp_async_commit();

      float acc[2][4][4];
#pragma unroll
      for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.f;
      const bool warp_live = n0 + wn * 32 < n_end && row0 + wm * 32 < end;

      for (int kt = 0; kt < KT; ++kt) {
#pragma unroll
        for (int i = 0; i < (BN * BK / 8) / kExpandThreads; ++i) {
          const int idx = tid + i * kExpandThreads, r = idx >> 3, c = idx & 7;
          const int n = n0 + r, j = kt * BK + c * 8;
          const int bytes = n < n_end ? max(0, min(16, (rank - j) * 2)) : 0;  // zero-fill past the rank
          cp_async16(bs + swz(r, c), bytes ? lora_b + (static_cast<int64_t>(slot) * N + n) * R + j : lora_b, bytes);
        }
        cp_async_commit();
        if (!waited) {
          griddep_wait();  // v is written by the preceding (shrink) kernel
          waited = true;
        }
#pragma unroll
        for (int i = 0; i < (BM * BK / 4) / kExpandThreads; ++i) {
          const int idx = tid + i * kExpandThreads, r = idx >> 4, q = idx & 15;
          const int j0 = kt * BK + q * 4;
          float f[4] = {0.f, 0.f, 0.f, 0.f};
          const int64_t pr = rows_sm[r];
          if (pr >= 0 && j0 < rank) {
            const V* src = v + pr * cols + vcol0 + j0;
            for (int sp = 0; sp < p.splits; ++sp) {  // split-K partials of the shrink, in plane order
              const Pack<V, 4> pk = load_cg<V, 4>(src + sp * p.split_stride);
#pragma unroll
              for (int e = 0; e < 4; ++e) f[e] += to_float(pk.v[e]);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) f[e] = j0 + e < rank ? f[e] : 0.f;
          }
          Pack<T, 4> t;
#pragma unroll
          for (int e = 0; e < 4; ++e) t.v[e] = from_float<T>(f[e]);
          *reinterpret_cast<Pack<T, 4>*>(vs + swz(r, q >> 1) + (q & 1) * 4) = t;
        }
        cp_async_wait<0>();
        __syncthreads();
        if (warp_live) warp_mma_slab<T, 2, 4>(acc, vs, bs, wm * 32, wn * 32, min(4, (rank - kt * BK + 15) / 16), lane);
        __syncthreads();  // vs / bs are refilled by the next slab
      }

#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = wm * 32 + mt * 16 + (lane >> 2) + h * 8;
            const int c = wn * 32 + nt * 8 + (lane & 3) * 2;
            if (rows_sm[r] >= 0 && n0 + c < n_end) {
              const Pack<T, 2> old = *reinterpret_cast<const Pack<T, 2>*>(out_sm + r * LD + c);
              store_pair(out_sm + r * LD + c, to_float(old.v[0]) + scale * acc[mt][nt][2 * h],
                         to_float(old.v[1]) + scale * acc[mt][nt][2 * h + 1]);
            }
          }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < (BM * BN / 8) / kExpandThreads; ++i) {
        const int idx = tid + i * kExpandThreads, r = idx >> 4, c = idx & 15;
        if (rows_sm[r] >= 0 && n0 + c * 8 < n_end)
          *reinterpret_cast<uint4*>(out + static_cast<int64_t>(rows_sm[r]) * N + n0 + c * 8) =
              *reinterpret_cast<const uint4*>(out_sm + r * LD + c * 8);
      }
    }
  }
  // Every block waits on the producer before it exits (see sgmv_expand_small_kernel).
  if (!waited) griddep_wait();
}

// v[row] = sum of the split-K planes of ws for every row covered by a segment, in plane order (the
// standalone shrink's second pass; the fused op lets the expand sum the planes instead).
// grid: capacity rows (strided); one block per row.
template <typename V>
__global__ void __launch_bounds__(128)
    sgmv_split_reduce_kernel(const float* __restrict__ ws, V* __restrict__ v, SgmvParams p, int rows) {
  const int total = min(p.seg_indptr[p.num_segments], rows);
  const int N = p.num_slices * p.max_rank;
  for (int idx = blockIdx.x; idx < total; idx += gridDim.x) {
    const int64_t row = physical_row(p, idx);
    for (int c = threadIdx.x; c < N; c += blockDim.x) {
      float s = 0.f;
      for (int sp = 0; sp < p.splits; ++sp) s += ws[sp * p.split_stride + row * N + c];
      v[row * N + c] = from_float<V>(s);
    }
  }
}

}  // namespace lora_kernels