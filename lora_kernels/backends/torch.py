"""The `torch` backend: reference.py's segment loop (CPU and GPU; reads the metadata back, so it syncs)."""

from __future__ import annotations

from lora_kernels import reference


class TorchBackend:
    name = "torch"

    def unavailable(self, device):
        return None

    def sgmv_shrink(self, x, lora_a, info, num_slices, out):
        reference.sgmv_shrink(x, lora_a, info.seg_indptr, info.weight_indices, info.lora_ranks, info.permutation,
                              num_slices, out)

    def sgmv_expand(self, v, lora_b, info, slice_offsets, out):
        reference.sgmv_expand(v, lora_b, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                              info.permutation, slice_offsets, out)

    def apply_lora(self, x, base_out, lora_a, lora_b, info, slice_offsets):
        reference.apply_lora(x, lora_a, lora_b, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                             info.permutation, slice_offsets, base_out)


BACKEND = TorchBackend()
