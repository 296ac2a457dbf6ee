"""Fake (meta) kernels of the compiled ops, so torch.compile and torch.library.opcheck can trace them,
and CPU kernels (the reference) so the same schemas run, and are op-checked, on a CPU-only machine."""

from __future__ import annotations

import torch

from lora_kernels import reference


def register() -> None:
    @torch.library.register_fake("lora_kernels::sgmv_shrink")
    def _shrink_fake(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices, max_seg_len, v):
        return None

    @torch.library.register_fake("lora_kernels::sgmv_expand")
    def _expand_fake(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets,
                     max_seg_len, out):
        return None

    @torch.library.register_fake("lora_kernels::batched_h2d_copy")
    def _copy_fake(srcs, dsts):
        return None

    @torch.library.impl("lora_kernels::sgmv_shrink", "CPU")
    def _shrink_cpu(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices, max_seg_len, v):
        reference.sgmv_shrink(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices, v)

    @torch.library.impl("lora_kernels::sgmv_expand", "CPU")
    def _expand_cpu(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets,
                    max_seg_len, out):
        reference.sgmv_expand(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation,
                              slice_offsets, out)

    if not hasattr(torch.ops.lora_kernels, "sgmv_apply"):  # a _C built before the fused op existed
        return

    @torch.library.register_fake("lora_kernels::sgmv_apply")
    def _apply_fake(x, lora_a, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets,
                    max_seg_len, out):
        return None

    @torch.library.impl("lora_kernels::sgmv_apply", "CPU")
    def _apply_cpu(x, lora_a, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets,
                   max_seg_len, out):
        v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32)
        reference.sgmv_shrink(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, len(slice_offsets) - 1,
                              v)
        reference.sgmv_expand(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation,
                              slice_offsets, out)
