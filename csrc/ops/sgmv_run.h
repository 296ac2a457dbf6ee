// Dtype dispatch of the SGMV launchers (ops/dtypes.h), one translation unit per op family so the
// kernels compile in parallel: sgmv_shrink.cu (shrink + split reduction) and sgmv_expand.cu.
#pragma once
#include <torch/all.h>

#include "kernels/lora_gemv.cuh"
#include "ops/sgmv_plan.h"

namespace lora_kernels {

// v (dtype v_dtype) when plan.splits == 1, else the fp32 planes ws[splits][rows][N].
void run_shrink(const at::Tensor& x, const at::Tensor& lora_a, void* v, at::ScalarType v_dtype, float* ws,
                const ShrinkArgs& p, const ShrinkPlan& plan, const LaunchCfg& cfg);
// v = the planes of ws summed in plane order.
void run_split_reduce(const float* ws, void* v, at::ScalarType v_dtype, const ShrinkArgs& p, const LaunchCfg& cfg);
// out += expand(sum of p.splits planes of v), with the plan's kernel.
void run_expand(const void* v, at::ScalarType v_dtype, const at::Tensor& lora_b, at::Tensor& out,
                const ExpandArgs& p, const ExpandPlan& plan, const LaunchCfg& cfg);

// out += LoRA(x) in one launch (kernels/sgmv_fused_cluster.cuh). Returns false, having launched nothing, where
// the device or this build cannot run it (no sm_90 code, compute capability < 9, no cluster fits).
bool run_fused(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, at::Tensor& out,
               const ShrinkArgs& sp, const ExpandArgs& ep, bool pdl);

// Whether p starts 16-byte aligned (the tensor-core paths' vector loads need it).
bool aligned16(const void* p);

// The batch as the kernels read it (kernels/work.cuh): the work list, ranks, optional permutation, rows of x.
WorkArgs make_work(const at::Tensor& work, const at::Tensor& lora_ranks, const std::optional<at::Tensor>& perm,
                   int64_t max_tiles, int64_t rows);

// Programmatic dependent launch for this call: an sm_90+ device and LORA_KERNELS_PDL != 0 (ops/sgmv.cu).
bool pdl_enabled();

// The checks sgmv_apply makes of its arguments (ops/sgmv.cu): x/lora_a as sgmv_shrink, lora_b/out as sgmv_expand,
// the work list, and their agreement (rows, dtype, device, S*R).
void check_apply_args(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
                      const at::Tensor& lora_ranks, const at::Tensor& scalings,
                      const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets, int64_t max_tiles,
                      const at::Tensor& out);

// out = x weightᵀ (+ bias) + LoRA(x) in one launch (kernels/lora_gemv.cuh); v: [rows, S*R] fp32 scratch.
void run_lora_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                   const at::Tensor& lora_a, const at::Tensor& lora_b, float* v, at::Tensor& out,
                   const GemvArgs& p);

}  // namespace lora_kernels
