"""The `torch` backend: reference.py's segment loop (CPU and GPU; reads the metadata back, so it syncs)."""

from __future__ import annotations

from lora_kernels import reference
from lora_kernels.backends.base import segment_args, shrink_then_expand


class TorchBackend:
    name = "torch"

    def unavailable(self, device):
        return None

    def sgmv_shrink(self, x, lora_a, info, num_slices, out):
        reference.sgmv_shrink(x, lora_a, *segment_args(info), num_slices, out)

    def sgmv_expand(self, v, lora_b, info, slice_offsets, out):
        seg_indptr, weight_indices, lora_ranks, perm = segment_args(info)
        reference.sgmv_expand(v, lora_b, seg_indptr, weight_indices, lora_ranks, info.scalings, perm, slice_offsets,
                              out)

    def apply_lora(self, x, base_out, lora_a, lora_b, info, slice_offsets):
        shrink_then_expand(self.sgmv_shrink, self.sgmv_expand, x, base_out, lora_a, lora_b, info, slice_offsets)


BACKEND = TorchBackend()
