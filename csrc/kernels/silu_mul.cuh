// out[r, j] = silu(gu[r, j]) * gu[r, inter + j], rounded as torch's two ops round it: silu computed in fp32 as
// g / (1 + expf(-g)) (IEEE division and expf: this build uses no fast math, as torch's does), rounded to T, then
// the product in fp32, rounded to T. A gated MLP's activation in one launch for eager decode steps.
#pragma once
#include <cstdint>

#include "types.cuh"

namespace lora_kernels {

constexpr int kSiluMulThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kSiluMulThreads)
    silu_mul_kernel(const T* __restrict__ gu, T* __restrict__ out, int64_t rows, int64_t inter) {
  const int64_t n = rows * inter;
  for (int64_t i = int64_t{blockIdx.x} * kSiluMulThreads + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * kSiluMulThreads) {
    const int64_t r = i / inter, j = i - r * inter;
    const float g = to_float(gu[r * 2 * inter + j]);
    const float u = to_float(gu[r * 2 * inter + inter + j]);
    const float s = to_float(from_float<T>(g / (1.0f + expf(-g))));
    out[i] = from_float<T>(s * u);
  }
}

}  // namespace lora_kernels
