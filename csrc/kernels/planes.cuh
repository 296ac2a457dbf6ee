// Sums over the split-K planes of the shrink (fp32 partials, or v itself as one plane), added strictly
// in plane order: the batch-invariant reduction. The loads of kPlaneBatch consecutive planes are issued
// before their adds so that their latencies overlap (up to 32 planes at decode); the adds stay
// sequential, so the bits equal the plain loop's. Planes are read through L2 only (ld.global.cg): an
// earlier grid wrote them. No torch headers.
#pragma once
#include <cstdint>

#include "kernels/ptx.cuh"
#include "kernels/types.cuh"

namespace lora_kernels {

constexpr int kPlaneBatch = 8;

template <typename V>
__device__ __forceinline__ float sum_planes(const V* src, int64_t stride, int planes) {
  float s = 0.f;
  int sp = 0;
  for (; sp + kPlaneBatch <= planes; sp += kPlaneBatch) {
    float f[kPlaneBatch];
#pragma unroll
    for (int u = 0; u < kPlaneBatch; ++u) f[u] = to_float(__ldcg(src + (sp + u) * stride));
#pragma unroll
    for (int u = 0; u < kPlaneBatch; ++u) s += f[u];
  }
  for (; sp < planes; ++sp) s += to_float(__ldcg(src + sp * stride));
  return s;
}

// f[e] += sum over the planes of src[e], e < 4 (src aligned to 4 elements of V).
template <typename V>
__device__ __forceinline__ void sum_planes4(float (&f)[4], const V* src, int64_t stride, int planes) {
  int sp = 0;
  for (; sp + kPlaneBatch <= planes; sp += kPlaneBatch) {
    Pack<V, 4> pk[kPlaneBatch];
#pragma unroll
    for (int u = 0; u < kPlaneBatch; ++u) pk[u] = load_cg<V, 4>(src + (sp + u) * stride);
#pragma unroll
    for (int u = 0; u < kPlaneBatch; ++u)
#pragma unroll
      for (int e = 0; e < 4; ++e) f[e] += to_float(pk[u].v[e]);
  }
  for (; sp < planes; ++sp) {
    const Pack<V, 4> pk = load_cg<V, 4>(src + sp * stride);
#pragma unroll
    for (int e = 0; e < 4; ++e) f[e] += to_float(pk.v[e]);
  }
}

}  // namespace lora_kernels
