// Thin wrappers over the PTX instructions the SGMV kernels use: asynchronous copies, ldmatrix,
// mma.sync and programmatic dependent launch. Raw pointers only; no torch headers.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lora_kernels {

// VEC elements of T moved as one access (16 bytes for VEC * sizeof(T) == 16).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// Load through L2 only (ld.global.cg). v is read this way: under programmatic dependent launch it
// was written by a grid that ran beside the reader, so no L1 / read-only-cache copy may be used.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_cg(const T* p) {
  static_assert(sizeof(T) * VEC == 16 || sizeof(T) * VEC == 8 || sizeof(T) * VEC == 4, "4, 8 or 16 bytes");
  Pack<T, VEC> r;
  if constexpr (sizeof(T) * VEC == 16) {
    *reinterpret_cast<uint4*>(&r) = __ldcg(reinterpret_cast<const uint4*>(p));
  } else if constexpr (sizeof(T) * VEC == 8) {
    *reinterpret_cast<uint2*>(&r) = __ldcg(reinterpret_cast<const uint2*>(p));
  } else {
    *reinterpret_cast<unsigned*>(&r) = __ldcg(reinterpret_cast<const unsigned*>(p));
  }
  return r;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1; bytes beyond src_bytes (0..16) are zero-filled,
// so masked rows / ranks / K tails land as zeros without a branch in the consumer.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
// The same copy to a shared-memory address already converted (smem_addr): a base converted once per stage, plus
// offsets, instead of a conversion per copy.
__device__ __forceinline__ void cp_async16_s(uint32_t smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem)));
}

// D += A(16x16, row) * B(16x8, col), fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Programmatic dependent launch (sm_90+). A kernel launched with the programmatic-serialization
// attribute may start before its predecessor finishes; griddep_wait() blocks until the predecessor
// grid has completed and its writes are visible. Both are no-ops when the launch had no such
// attribute. The host enables the attribute only on devices this file was compiled for with sm_90
// machine code (launch.cuh), because the compute_80 PTX build compiles these to nothing.
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// griddep_wait() the first time a CTA is about to read what an earlier kernel writes (x, v, out) or to
// write anything: before it, a kernel reads only what no kernel writes (weights, batch metadata).
__device__ __forceinline__ void wait_once(bool& waited) {
  if (!waited) {
    griddep_wait();
    waited = true;
  }
}

}  // namespace lora_kernels
