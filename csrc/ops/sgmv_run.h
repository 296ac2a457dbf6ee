// Dtype dispatch of the SGMV launchers (ops/dtypes.h), one translation unit per op family so the
// kernels compile in parallel: sgmv_shrink.cu (shrink + split reduction) and sgmv_expand.cu.
#pragma once
#include <torch/all.h>

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

}  // namespace lora_kernels
