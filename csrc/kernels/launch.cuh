// The launch helper every launcher uses: persistent 1-D grids on a given stream, with programmatic
// dependent launch (PDL) where the kernel has real griddepcontrol. Raw CUDA runtime; no torch headers.
#pragma once
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

namespace lora_kernels {

struct LaunchCfg {
  cudaStream_t stream;
  int grid;  // persistent CTAs (see ops/sgmv_plan.h: a multiple of the SM count, capped by the work)
  bool pdl;  // the caller wants PDL (sm_90+ device, LORA_KERNELS_PDL != 0)
};

// Whether `Kernel` was compiled from sm_90+ code (the sm_90a machine code of this build), i.e. whether its
// griddepcontrol, cluster and wgmma instructions exist. A compute_80 PTX build JIT-compiled for a newer GPU compiles
// them to nothing, so it must not be launched with PDL (its consumers could then run before it finished), and kernels
// made only of sm_90 instructions must not be launched at all.
template <auto Kernel>
bool has_sm90_code() {
  static const bool ok = [] {
    cudaFuncAttributes attr{};
    return cudaFuncGetAttributes(&attr, Kernel) == cudaSuccess && attr.ptxVersion >= 90;
  }();
  return ok;
}

// cudaFuncSetAttribute(Kernel, Attr, value), once per kernel, attribute and device (the value is the same on every
// call).
template <auto Kernel, cudaFuncAttribute Attr>
cudaError_t set_attribute_once(int value) {
  static std::mutex mu;
  static std::vector<bool> done;
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  if (static_cast<int>(done.size()) <= dev) done.resize(dev + 1, false);
  if (!done[dev]) {
    err = cudaFuncSetAttribute(Kernel, Attr, value);
    if (err != cudaSuccess) return err;
    done[dev] = true;
  }
  return cudaSuccess;
}

// Dynamic shared memory above 48 KB.
template <auto Kernel>
cudaError_t allow_dynamic_smem(int bytes) {
  return set_attribute_once<Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(bytes);
}

// The largest shared-memory carveout: without it the driver may configure less shared memory than the CTAs that a
// kernel's __launch_bounds__ asks for need.
template <auto Kernel>
cudaError_t prefer_max_smem() {
  return set_attribute_once<Kernel, cudaFuncAttributePreferredSharedMemoryCarveout>(cudaSharedmemCarveoutMaxShared);
}

// CTAs of `Kernel` (threads, smem bytes of dynamic shared memory, the same on every call) that one SM holds at once,
// by the occupancy API, once per kernel; 0 where it cannot say.
template <auto Kernel>
int resident_ctas_per_sm(int threads, int smem) {
  static const int per_sm = [threads, smem] {
    int blocks = 0;
    if (allow_dynamic_smem<Kernel>(smem) != cudaSuccess) return 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, threads, smem) == cudaSuccess ? blocks : 0;
  }();
  return per_sm;
}

// Launches Kernel<<<cfg.grid, threads, smem, cfg.stream>>>(args...), with the programmatic-serialization
// attribute when cfg.pdl and the kernel supports it. Returns the launch error (the caller checks it).
template <auto Kernel, typename... Args>
cudaError_t launch_kernel(const LaunchCfg& cfg, int threads, int smem, Args... args) {
  if (smem > 32 * 1024) {  // static shared memory counts against the 48 KB default too
    const cudaError_t err = allow_dynamic_smem<Kernel>(smem);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(cfg.grid);
  lc.blockDim = dim3(threads);
  lc.dynamicSmemBytes = smem;
  lc.stream = cfg.stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = attr;
  lc.numAttrs = cfg.pdl && has_sm90_code<Kernel>() ? 1 : 0;
  return cudaLaunchKernelEx(&lc, Kernel, args...);
}

}  // namespace lora_kernels
