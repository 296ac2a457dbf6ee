// Declarations of the op implementations registered in registration.cpp.
#pragma once
#include <optional>
#include <torch/all.h>

namespace lora_kernels {

void sgmv_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& work, const at::Tensor& lora_ranks,
                 const std::optional<at::Tensor>& permutation, int64_t num_slices, int64_t max_tiles, at::Tensor& v);

void sgmv_expand(const at::Tensor& v, const at::Tensor& lora_b, const at::Tensor& work, const at::Tensor& lora_ranks,
                 const at::Tensor& scalings, const std::optional<at::Tensor>& permutation,
                 at::IntArrayRef slice_offsets, int64_t max_tiles, at::Tensor& out);

void sgmv_apply(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
                const at::Tensor& lora_ranks, const at::Tensor& scalings,
                const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets, int64_t max_tiles,
                at::Tensor& out);

at::Tensor sgmv_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
                       const at::Tensor& lora_ranks, const at::Tensor& scalings,
                       const std::optional<at::Tensor>& permutation, at::IntArrayRef slice_offsets,
                       int64_t max_tiles, bool one_launch);

// out = x weightᵀ (+ bias) + the LoRA delta, one launch, up to 16 rows of x (ops/lora_gemv.cu); sync[2*sync_slot..]:
// two int32 words, zero before the first launch, which every launch leaves at zero.
void lora_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
               const at::Tensor& lora_a, const at::Tensor& lora_b, const at::Tensor& work,
               const at::Tensor& lora_ranks, const at::Tensor& scalings, const std::optional<at::Tensor>& permutation,
               at::IntArrayRef slice_offsets, int64_t max_tiles, at::Tensor& sync, int64_t sync_slot,
               at::Tensor& out);

void batched_h2d_copy(at::TensorList srcs, at::TensorList dsts);

// silu(gu[..., :I]) * gu[..., I:] with torch's roundings (ops/silu_mul.cu).
at::Tensor silu_mul(const at::Tensor& gu);

}  // namespace lora_kernels
