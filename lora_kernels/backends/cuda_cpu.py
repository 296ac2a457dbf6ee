"""CPU kernels (the reference) for the extension's SGMV schemas, so the same ops run, and are
op-checked, on a CPU-only machine (CI)."""

from __future__ import annotations

import torch

from lora_kernels import reference


def register() -> None:
    @torch.library.impl("lora_kernels::sgmv_shrink", "CPU")
    def _shrink_cpu(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices, max_seg_len, v):
        reference.sgmv_shrink(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices, v)

    @torch.library.impl("lora_kernels::sgmv_expand", "CPU")
    def _expand_cpu(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets,
                    max_seg_len, out):
        reference.sgmv_expand(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation,
                              slice_offsets, out)

    @torch.library.impl("lora_kernels::sgmv_apply", "CPU")
    def _apply_cpu(x, lora_a, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets,
                   max_seg_len, out):
        v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32)
        reference.sgmv_shrink(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, len(slice_offsets) - 1,
                              v)
        reference.sgmv_expand(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation,
                              slice_offsets, out)
