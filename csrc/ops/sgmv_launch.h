// Launchers of the SGMV kernels (one per kernel family, instantiated per dtype in sgmv_small.cu and
// sgmv_mma.cu) and the launch helper they share. Grids depend only on capacities (number of segment
// slots, max_seg_len, weight shapes), never on the batch's device-side contents, so a CUDA graph
// captured once replays for any batch of the same capacity.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

#include "kernels/sgmv_params.cuh"

namespace lora_kernels {

struct LaunchCtx {
  cudaStream_t stream;
  int num_sms;
  int64_t rows;         // rows of x / out (the token capacity in graph mode)
  int64_t max_seg_len;  // upper bound of rows per segment (sizes the row dimension of the grids)
  bool pdl;             // launch with programmatic dependent launch (expand after shrink, same op)
};

// Segments up to this many rows take the CUDA-core kernels; longer ones the tensor-core kernels.
constexpr int64_t kSmallMaxRows = 8;

template <typename T, typename V>
void launch_shrink_small(const T* x, const T* lora_a, V* v, SgmvParams p, bool vec16, const LaunchCtx& ctx);
template <typename T, typename V>
void launch_expand_small(const V* v, const T* lora_b, T* out, SgmvParams p, bool vec16, const LaunchCtx& ctx);
// Rows per row window of the tensor-core kernels: the tile height, or 16 for batches of at most 1024
// rows (decode-sized, sorted by adapter: short segments, so more, shorter windows).
inline int mma_window(int64_t rows) { return rows > 1024 ? 64 : 16; }
// K splits (and the K chunk of each) of the tensor-core shrink for a batch of `rows` rows (capacity).
int shrink_mma_splits(int64_t rows, int64_t in_dim, int64_t cols, int num_sms, int* k_chunk);
// p.splits == 1: writes v; p.splits > 1: writes the fp32 partial planes ws[p.splits][rows][cols].
template <typename T, typename V>
void launch_shrink_mma(const T* x, const T* lora_a, V* v, float* ws, SgmvParams p, const LaunchCtx& ctx);
// v[covered rows] = sum of the planes of ws.
template <typename V>
void launch_split_reduce(const float* ws, V* v, SgmvParams p, int rows, const LaunchCtx& ctx);
template <typename T, typename V>
void launch_expand_mma(const V* v, const T* lora_b, T* out, SgmvParams p, const LaunchCtx& ctx);

// Whether `Kernel` was compiled from sm_90+ code, i.e. whether its griddep_wait() is real. A compute_80
// PTX build JIT-compiled for a newer GPU has no griddepcontrol, so it must not be launched with PDL.
template <auto Kernel>
bool has_griddep_control() {
  static const bool ok = [] {
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, Kernel));
    return attr.ptxVersion >= 90;
  }();
  return ok;
}

// cudaFuncSetAttribute for dynamic shared memory above 48 KB, once per kernel and device.
template <auto Kernel>
void allow_dynamic_smem(int bytes) {
  static std::mutex mu;
  static std::vector<bool> done;
  const int dev = c10::cuda::current_device();
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(done.size()) <= dev) done.resize(dev + 1, false);
  if (!done[dev]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    done[dev] = true;
  }
}

// Launches on ctx.stream, with the programmatic-serialization attribute when pdl is set; checks the
// launch.
template <auto Kernel, typename... Args>
void launch_kernel(dim3 grid, dim3 block, int smem, const LaunchCtx& ctx, bool pdl, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = ctx.stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl && has_griddep_control<Kernel>() ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, Kernel, std::forward<Args>(args)...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

inline int row_chunks(int64_t max_seg_len, int rows_per_chunk) {
  const int64_t n = (std::max<int64_t>(max_seg_len, 1) + rows_per_chunk - 1) / rows_per_chunk;
  return static_cast<int>(std::min<int64_t>(n, 65535));  // kernels stride over the rest
}

}  // namespace lora_kernels
