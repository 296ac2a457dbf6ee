// Thin wrappers over Hopper's warpgroup MMA (wgmma, sm_90a only): shared-memory descriptors for the 128-byte
// swizzled K-major tiles of mma_tile.cuh (rows of kMmaBK = 64 16-bit elements, chunk ^ (row % 8)), and the
// m64n64k16 MMA with fp32 accumulators. Compiled to nothing outside sm_90a (WGMMA_ENABLED 0): the launchers run
// these kernels only where the device has sm_90a code (has_wgmma). Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/ptx.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WGMMA_ENABLED 1
#else
#define WGMMA_ENABLED 0
#endif

namespace lora_kernels {

// Descriptor of a K-major tile in shared memory with the 128-byte swizzle: 8-row groups of 1024 bytes (the stride
// byte offset), the tile based 1024-byte aligned. A k16 step further along K is the same descriptor 32 bytes on: the
// swizzle is applied to the address bits, so an offset inside the 128-byte row stays valid.
__device__ __forceinline__ uint64_t wgmma_desc(const void* tile) {
  const uint32_t addr = smem_addr(tile);
  uint64_t d = static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= uint64_t{1} << 16;           // leading byte offset: unused for swizzled K-major tiles
  d |= uint64_t{1024 >> 4} << 32;   // stride byte offset: 8 rows x 128 bytes
  d |= uint64_t{1} << 62;           // 128-byte swizzle
  return d;
}

// Bytes from dynamic shared memory at `smem` to its first 1024-byte aligned address (the 128-byte swizzle's period:
// wgmma_desc's tiles start there); the launch asks for 1024 bytes more than the tiles take.
__device__ __forceinline__ uint32_t swizzle_pad(const void* smem) { return (1024 - smem_addr(smem) % 1024) % 1024; }

__device__ __forceinline__ void wgmma_fence() {
#if WGMMA_ENABLED
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if WGMMA_ENABLED
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if WGMMA_ENABLED
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
// Shared memory written by cp.async (the generic proxy) is read next by wgmma (the async proxy).
__device__ __forceinline__ void fence_proxy_async() {
#if WGMMA_ENABLED
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
// Keeps the compiler from moving accumulator reads or writes across a wgmma fence or wait.
__device__ __forceinline__ void wgmma_fence_regs(float (&d)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (the warp's 16 rows of a 64 x 64 fp32 block) = A(64 x 16, K-major at desc_a) * B(64 x 16, K-major at desc_b)^T,
// plus d where `accumulate` (0: a new chain without zeroing d, so that no other instruction writes d while an earlier
// wgmma on it is in flight). d[4 j + e]: row 16 warp + lane / 4 + 8 (e / 2), column 8 j + 2 (lane % 4) + e % 2 (the
// m16n8 fragments side by side).
template <typename T>
__device__ __forceinline__ void wgmma_64x64x16_scaled(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate);

#define LK_WGMMA_64x64_SCALED(TYPE)                                                                                \
  asm volatile(                                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                                \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                              \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),             \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),       \
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),     \
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])      \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <>
__device__ __forceinline__ void wgmma_64x64x16_scaled<__nv_bfloat16>(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                                     int accumulate) {
#if WGMMA_ENABLED
  LK_WGMMA_64x64_SCALED("bf16");
#endif
}
template <>
__device__ __forceinline__ void wgmma_64x64x16_scaled<__half>(float (&d)[32], uint64_t desc_a, uint64_t desc_b,
                                                              int accumulate) {
#if WGMMA_ENABLED
  LK_WGMMA_64x64_SCALED("f16");
#endif
}
#undef LK_WGMMA_64x64_SCALED

// d += A * B^T (the chain continued).
template <typename T>
__device__ __forceinline__ void wgmma_64x64x16(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
  wgmma_64x64x16_scaled<T>(d, desc_a, desc_b, 1);
}

}  // namespace lora_kernels
