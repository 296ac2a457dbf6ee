// One launch per module for decode-sized batches (sm_90+): shrink and expand in one kernel, a thread-block
// cluster of kFusedCluster CTAs per work item, the split-K partials exchanged through distributed shared
// memory instead of an fp32 round trip through HBM and a second launch.
//
// Item (tile t, column group g of G): the cluster computes the tile's v (every K split), then the output
// columns of group g. G = max(1, clusters / tiles) is computed on the device from the tile count, so at
// decode every cluster works on the few tiles there are (each recomputes the tile's small shrink, reading
// A from L2) and a captured graph stays valid for any batch.
//
// Bits: the same as the two launches of sgmv_apply (shrink into fp32 planes, expand summing them), so
// sgmv_apply may choose this path by the number of rows without breaking batch invariance:
//   - a shrink job (split ks, 16 columns of v) is one warp's chain over the split's 64-wide K slabs, 4 k16
//     MMAs per slab, as the warp of sgmv_shrink_mma_kernel that owns those columns computes it;
//   - the owner CTA of a column group adds the splits' partials in split order starting from 0.f, zeroes
//     the columns past the rank and rounds to T, as expand_fill_v does;
//   - an expand job (16 output columns) is one warp's MMAs over the rank (one 64-wide slab, ceil(rank/16)
//     k16 steps), then out = T(fma(scaling, acc, out)), as expand_item_mma does.
// Limits (ops/sgmv_plan.h checks them): fp16/bf16, R % 16 == 0, R <= kFusedMaxR, and at most
// kFusedMaxParts partial blocks per owner CTA. Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#endif

#include "kernels/launch.cuh"
#include "kernels/mma_tile.cuh"

namespace lora_kernels {

constexpr int kFusedCluster = 8;  // CTAs per cluster: the portable maximum
constexpr int kFusedWarps = 4, kFusedThreads = 32 * kFusedWarps;
constexpr int kFusedStages = 3;     // per-warp shrink ring: (x slab, A slab) per stage
constexpr int kFusedMaxR = 64;      // one 64-wide rank slab per slice
constexpr int kFusedMaxParts = 32;  // 16 x 16 fp32 partial blocks an owner CTA holds: splits * ceil(NG / cluster)
constexpr int kSlab = kTileM * kMmaBK;  // elements of a 16 x 64 slab
constexpr int kFusedRingElems = kFusedWarps * kFusedStages * 2 * kSlab;
constexpr int kFusedBElems = kFusedWarps * 2 * kSlab;  // two B slabs per warp (double buffer)
constexpr int kFusedVElems = kMaxSlices * kSlab;
// Shared memory: the rings, B and v slabs, then the owner's partial blocks (1 KB each), as many as the shape
// needs. Small enough that the next module's CTAs fit beside this one's (one CTA per SM in the grid), so that
// under PDL they start and read their weights while this kernel still runs.
constexpr int kFusedBaseBytes = (kFusedRingElems + kFusedBElems + kFusedVElems) * 2;
constexpr int kFusedSmemBytes = kFusedBaseBytes + kFusedMaxParts * 256 * 4;
inline int fused_smem_bytes(int parts) { return kFusedBaseBytes + parts * 256 * 4; }
// 16-column groups of v an owner CTA holds: group g belongs to CTA g % kFusedCluster, block g / kFusedCluster.
__host__ __device__ constexpr int fused_groups_per_owner(int N) { return (N / 16 + kFusedCluster - 1) / kFusedCluster; }

// Where lane `lane` copies from for the 16 x 64 slabs of one shrink job: rows (lane >> 3) + 4 i, chunk lane & 7.
template <typename T>
struct JobCopy {
  const T* x[4];
  const T* a[4];
  bool xok[4], aok[4];
};

template <typename T>
__device__ __forceinline__ JobCopy<T> job_copy(const T* x, const T* a, const ShrinkArgs& p, const TileInfo& ti,
                                               const int* rows_sm, int n0, int kbeg, int lane) {
  JobCopy<T> c;
  const int chunk = lane & 7;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = (lane >> 3) + 4 * i, n = n0 + r;
    c.xok[i] = rows_sm[r] >= 0;
    c.x[i] = x + static_cast<int64_t>(c.xok[i] ? rows_sm[r] : 0) * p.K + kbeg + chunk * 8;
    c.aok[i] = n < p.N && n % p.R < ti.rank;
    c.a[i] = a + (static_cast<int64_t>(ti.slot) * p.N + (c.aok[i] ? n : 0)) * p.K + kbeg + chunk * 8;
  }
  return c;
}

// acc = x[tile rows, kbeg:kend] * A[slot, n0:n0+16, kbeg:kend]^T, one warp, through its own ring of
// kFusedStages stages. A slabs of the first stages are requested before griddep_wait; x only after it.
template <typename T>
__device__ __forceinline__ void warp_shrink_chain(TileAcc& acc, const JobCopy<T>& cp, const T* x, const T* a,
                                                  int kbeg, int kend, T* ring, bool& waited, int lane) {
  constexpr int ST = kFusedStages, BK = kMmaBK;
  const int KT = kend > kbeg ? (kend - kbeg + BK - 1) / BK : 0, chunk = lane & 7;
  auto load = [&](int stage, int kt, bool is_x) {
    const bool kok = kbeg + kt * BK + chunk * 8 < kend;
    T* dst = ring + (stage * 2 + (is_x ? 0 : 1)) * kSlab;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool ok = (is_x ? cp.xok[i] : cp.aok[i]) && kok;
      const T* src = is_x ? cp.x[i] : cp.a[i];
      cp_async16(dst + swz((lane >> 3) + 4 * i, chunk), ok ? src + kt * BK : (is_x ? x : a), ok ? 16 : 0);
    }
  };
#pragma unroll
  for (int s = 0; s < ST - 1; ++s)
    if (s < KT) load(s, s, false);
  wait_once(waited);
#pragma unroll
  for (int s = 0; s < ST - 1; ++s) {
    if (s < KT) load(s, s, true);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<ST - 2>();
    __syncwarp();  // slab kt landed for every lane; slab kt - 1 is free
    const int nk = kt + ST - 1;
    if (nk < KT) {
      load(nk % ST, nk, false);
      load(nk % ST, nk, true);
    }
    cp_async_commit();
    const T* st = ring + (kt % ST) * 2 * kSlab;
    warp_mma_slab<T, kWarpMT, kWarpNT>(acc, st, st + kSlab, 0, 0, 4, lane);
    __syncwarp();
  }
  cp_async_wait<0>();
  __syncwarp();
}

// Expand jobs (16 output columns each) of slice i; 0 for slices past num_slices.
__device__ __forceinline__ int slice_jobs(const ExpandArgs& p, int i) {
  return i < p.num_slices ? (pick(p.offsets, i + 1) - pick(p.offsets, i) + 15) / 16 : 0;
}

// The expand job e (16 output columns numbered over the slices): slice, first column, end of the slice.
__device__ __forceinline__ void expand_job(const ExpandArgs& p, int e, int& slice, int& n0, int& n_end) {
  slice = 0;
  int base = 0;
  bool found = false;  // slices are tried in order; the first whose jobs reach past e holds it
#pragma unroll
  for (int i = 0; i < kMaxSlices; ++i) {
    const int jobs = slice_jobs(p, i);
    if (!found && i < p.num_slices && e >= base + jobs) {
      base += jobs;
      slice = i + 1;
    } else {
      found = true;
    }
  }
  n0 = pick(p.offsets, slice) + (e - base) * 16;
  n_end = pick(p.offsets, slice + 1);
}

__device__ __forceinline__ int expand_jobs(const ExpandArgs& p) {
  int n = 0;
#pragma unroll
  for (int i = 0; i < kMaxSlices; ++i) n += slice_jobs(p, i);
  return n;
}

// B slab of an expand job: rows n0.. of lora_b[slot] (16 columns of out), ranks 0..63, zero past the rank.
template <typename T>
__device__ __forceinline__ void warp_load_b(T* bs, const T* b, const ExpandArgs& p, const TileInfo& ti, int n0,
                                            int n_end, int lane) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = (lane >> 3) + 4 * i, c = lane & 7, n = n0 + r, j = c * 8;
    const int bytes = n < n_end ? max(0, min(16, (ti.rank - j) * 2)) : 0;
    cp_async16(bs + swz(r, c), bytes ? b + (static_cast<int64_t>(ti.slot) * p.out_total + n) * p.R + j : b, bytes);
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
namespace cg = cooperative_groups;

// The CTA's shrink jobs j = rank + cluster * (warp + warps * round) of the tile (split j / NG, column group
// j % NG); each result goes to the owner CTA of its group (g % cluster), block ks * per_owner + g / cluster.
template <typename T>
__device__ __forceinline__ void fused_shrink(cg::cluster_group& cluster, const T* x, const T* a, const ShrinkArgs& p,
                                             const TileInfo& ti, const int* rows_sm, T* ring, float* part,
                                             bool& waited) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, crank = static_cast<int>(cluster.block_rank());
  const int NG = p.N / 16, jobs = p.splits * NG, per_owner = fused_groups_per_owner(p.N);
  T* my_ring = ring + warp * kFusedStages * 2 * kSlab;
  for (int j = crank + kFusedCluster * warp; j < jobs; j += kFusedCluster * kFusedWarps) {
    const int ks = j / NG, g = j % NG;
    if ((g * 16) % p.R >= ti.rank) continue;  // columns past the rank: the owner writes zeros, reads nothing
    const int kbeg = ks * p.k_chunk, kend = min(p.K, kbeg + p.k_chunk);
    TileAcc acc;
    zero_acc(acc);
    const JobCopy<T> cp = job_copy(x, a, p, ti, rows_sm, g * 16, kbeg, lane);
    warp_shrink_chain<T>(acc, cp, x, a, kbeg, kend, my_ring, waited, lane);
    float* dst = cluster.map_shared_rank(part, g % kFusedCluster) + (ks * per_owner + g / kFusedCluster) * 256;
    for_each_acc_pair(acc, 0, 0, lane, [&](int r, int c, float lo, float hi) {
      *reinterpret_cast<float2*>(dst + r * 16 + c) = make_float2(lo, hi);
    });
  }
}

// Owner CTAs: v of their column groups = the splits' partials added in split order from 0.f, 0 past the rank
// and for rows outside the tile, rounded to T, written into the v slabs of every CTA of the cluster.
template <typename T>
__device__ __forceinline__ void fused_reduce(cg::cluster_group& cluster, const ShrinkArgs& p, const TileInfo& ti,
                                             const int* rows_sm, const float* part, T* vs) {
  const int crank = static_cast<int>(cluster.block_rank());
  const int NG = p.N / 16, per_owner = fused_groups_per_owner(p.N);
  for (int idx = threadIdx.x; idx < per_owner * 64; idx += kFusedThreads) {
    const int lg = idx >> 6, r = (idx >> 2) & 15, q = idx & 3, g = lg * kFusedCluster + crank;
    if (g >= NG) continue;
    const int c0 = g * 16 + q * 4, slice = c0 / p.R, j0 = c0 % p.R;
    float f[4] = {0.f, 0.f, 0.f, 0.f};
    if (rows_sm[r] >= 0 && j0 < ti.rank) {
      for (int ks = 0; ks < p.splits; ++ks) {
        const float4 v4 = *reinterpret_cast<const float4*>(part + (ks * per_owner + lg) * 256 + r * 16 + q * 4);
        f[0] += v4.x;
        f[1] += v4.y;
        f[2] += v4.z;
        f[3] += v4.w;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) f[e] = j0 + e < ti.rank ? f[e] : 0.f;
    }
    Pack<T, 4> t;
#pragma unroll
    for (int e = 0; e < 4; ++e) t.v[e] = from_float<T>(f[e]);
    T* local = vs + slice * kSlab + swz(r, j0 >> 3) + (j0 & 7);
#pragma unroll
    for (int d = 0; d < kFusedCluster; ++d) *reinterpret_cast<Pack<T, 4>*>(cluster.map_shared_rank(local, d)) = t;
  }
}

// f(nt, h, dst) for this lane's out pairs of an expand job that exist (rows lane / 4 and + 8 of the tile, columns
// n0 + 8 nt + 2 (lane % 4): the m16n8 accumulator layout), dst the pair's place in out.
template <typename T, typename F>
__device__ __forceinline__ void for_each_out_pair(T* out, const ExpandArgs& p, const int* rows_sm, int n0, int n_end,
                                                  int lane, F&& f) {
#pragma unroll
  for (int nt = 0; nt < kWarpNT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (lane >> 2) + h * 8, c = n0 + nt * 8 + (lane & 3) * 2;
      if (rows_sm[r] >= 0 && c < n_end) f(nt, h, out + static_cast<int64_t>(rows_sm[r]) * p.out_total + c);
    }
}

// This lane's out pairs, read after griddep_wait: out is the previous kernel's output.
template <typename T>
struct OutPairs {
  Pack<T, 2> v[kWarpNT][2];
};

template <typename T>
__device__ __forceinline__ OutPairs<T> load_out_pairs(T* out, const ExpandArgs& p, const int* rows_sm, int n0,
                                                      int n_end, int lane) {
  OutPairs<T> o;
  for_each_out_pair(out, p, rows_sm, n0, n_end, lane,
                    [&](int nt, int h, T* src) { o.v[nt][h] = *reinterpret_cast<const Pack<T, 2>*>(src); });
  return o;
}

template <typename T>
__device__ __forceinline__ void store_out_pairs(const TileAcc& acc, const OutPairs<T>& o, T* out, const ExpandArgs& p,
                                                const int* rows_sm, int n0, int n_end, float scale, int lane) {
  for_each_out_pair(out, p, rows_sm, n0, n_end, lane, [&](int nt, int h, T* dst) {
    store_pair(dst, expand_out(to_float(o.v[nt][h].v[0]), scale, acc[0][nt][2 * h]),
               expand_out(to_float(o.v[nt][h].v[1]), scale, acc[0][nt][2 * h + 1]));
  });
}

// The CTA's expand jobs of column group g: e = lo + rank + cluster * (warp + warps * round). B slabs are
// double-buffered per warp: the next job's slab is requested before this job's MMAs; the first was
// requested at the start of the item (fused_prefetch_b).
template <typename T>
__device__ __forceinline__ void fused_expand(cg::cluster_group& cluster, const T* b, T* out, const ExpandArgs& p,
                                             const TileInfo& ti, const int* rows_sm, const T* vs, T* bsm, int lo,
                                             int hi, bool& waited) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, crank = static_cast<int>(cluster.block_rank());
  const int step = kFusedCluster * kFusedWarps, ksteps = min(4, (ti.rank + 15) / 16);
  const float scale = p.scalings[ti.slot];
  T* my_b = bsm + warp * 2 * kSlab;
  wait_once(waited);
  int buf = 0;
  for (int e = lo + crank + kFusedCluster * warp; e < hi; e += step, buf ^= 1) {
    int slice, n0, n_end;
    expand_job(p, e, slice, n0, n_end);
    const OutPairs<T> o = load_out_pairs(out, p, rows_sm, n0, n_end, lane);
    if (e + step < hi) {
      int s2, m0, m_end;
      expand_job(p, e + step, s2, m0, m_end);
      warp_load_b(my_b + (buf ^ 1) * kSlab, b, p, ti, m0, m_end, lane);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this job's slab (the group before the one just committed)
    __syncwarp();
    TileAcc acc;
    zero_acc(acc);
    warp_mma_slab<T, kWarpMT, kWarpNT>(acc, vs + slice * kSlab, my_b + buf * kSlab, 0, 0, ksteps, lane);
    __syncwarp();  // the slab is free for the job after next
    store_out_pairs(acc, o, out, p, rows_sm, n0, n_end, scale, lane);
  }
  cp_async_wait<0>();
}

// The warp's first expand job's B slab, requested at the start of the item (no kernel writes lora_b).
template <typename T>
__device__ __forceinline__ void fused_prefetch_b(cg::cluster_group& cluster, const T* b, const ExpandArgs& p,
                                                 const TileInfo& ti, T* bsm, int lo, int hi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int e = lo + static_cast<int>(cluster.block_rank()) + kFusedCluster * warp;
  if (e < hi) {
    int slice, n0, n_end;
    expand_job(p, e, slice, n0, n_end);
    warp_load_b(bsm + warp * 2 * kSlab, b, p, ti, n0, n_end, lane);
  }
  cp_async_commit();
}
#endif

template <typename T>
__global__ void __launch_bounds__(kFusedThreads, 1)
    sgmv_fused_cluster_kernel(const T* __restrict__ x, const T* __restrict__ a, const T* __restrict__ b,
                              T* __restrict__ out, ShrinkArgs sp, ExpandArgs ep) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* ring = reinterpret_cast<T*>(smem_raw);
  T* bsm = ring + kFusedRingElems;
  T* vs = bsm + kFusedBElems;
  float* part = reinterpret_cast<float*>(vs + kFusedVElems);
  __shared__ int rows_sm[kTileM];
  cg::cluster_group cluster = cg::this_cluster();
  griddep_launch_dependents();
  cluster.sync();  // every CTA of the cluster runs before any writes into another's shared memory
  bool waited = false;
  const int cid = blockIdx.x / kFusedCluster, clusters = gridDim.x / kFusedCluster;
  const int tiles = num_tiles(sp.w), G = max(1, clusters / max(tiles, 1)), ejobs = expand_jobs(ep);
  for (int item = cid; item < tiles * G; item += clusters) {
    const TileInfo ti = load_tile(sp.w, item / G, sp.R);
    if (ti.slot < 0) continue;  // the same for every CTA of the cluster: no barrier is skipped by half of it
    const int g = item % G, lo = g * ejobs / G, hi = (g + 1) * ejobs / G;
    fill_tile_rows(rows_sm, sp.w, ti);
    fused_prefetch_b(cluster, b, ep, ti, bsm, lo, hi);
    __syncthreads();
    fused_shrink(cluster, x, a, sp, ti, rows_sm, ring, part, waited);
    cluster.sync();  // every partial has landed in its owner
    fused_reduce(cluster, sp, ti, rows_sm, part, vs);
    cluster.sync();  // every CTA holds v
    fused_expand(cluster, b, out, ep, ti, rows_sm, vs, bsm, lo, hi, waited);
    cluster.sync();  // nobody reads this item's partials or v any more (and rows_sm is free)
  }
  wait_once(waited);  // see sgmv_expand_mma_kernel: every CTA waits on the producer before it exits
#endif
}

// Clusters of the kernel that fit on the current device at once (0: none), once per device.
template <typename T>
int fused_cluster_count() {
  static std::mutex mu;
  static std::vector<int> counts;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(counts.size()) <= dev) counts.resize(dev + 1, -1);
  if (counts[dev] < 0) {
    int n = 0;
    cudaLaunchConfig_t lc = {};
    lc.gridDim = dim3(kFusedCluster * 64);
    lc.blockDim = dim3(kFusedThreads);
    lc.dynamicSmemBytes = kFusedSmemBytes;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kFusedCluster;
    attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
    lc.attrs = attr;
    lc.numAttrs = 1;
    if (allow_dynamic_smem<sgmv_fused_cluster_kernel<T>>(kFusedSmemBytes) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, sgmv_fused_cluster_kernel<T>, &lc) != cudaSuccess)
      n = 0;
    cudaGetLastError();  // a failed query leaves no sticky error behind
    counts[dev] = n;
  }
  return counts[dev];
}

template <typename T>
cudaError_t launch_fused_cluster(const T* x, const T* a, const T* b, T* out, const ShrinkArgs& sp,
                                 const ExpandArgs& ep, cudaStream_t stream, int clusters, bool pdl) {
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(clusters * kFusedCluster);
  lc.blockDim = dim3(kFusedThreads);
  lc.dynamicSmemBytes = fused_smem_bytes(sp.splits * fused_groups_per_owner(sp.N));
  lc.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;  // set at launch: a compute_80 build has no __cluster_dims__
  attr[0].val.clusterDim.x = kFusedCluster;
  attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = attr;
  lc.numAttrs = pdl ? 2 : 1;
  return cudaLaunchKernelEx(&lc, sgmv_fused_cluster_kernel<T>, x, a, b, out, sp, ep);
}

}  // namespace lora_kernels
