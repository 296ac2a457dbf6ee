"""The `cuda` backend: the compiled extension `lora_kernels._C` (csrc/), loaded once, and the fake
(meta) kernels of its ops, so that torch.compile and torch.library.opcheck can trace them."""

from __future__ import annotations

import torch

from lora_kernels.backends.base import segment_args

try:
    from lora_kernels import _C  # noqa: F401  (loading it registers torch.ops.lora_kernels.*)

    HAS_CUDA_EXT = True
    CUDA_EXT_ERROR = ""
except ImportError as e:  # not built (no nvcc / LORA_KERNELS_BUILD_CUDA=0) or built for another torch
    HAS_CUDA_EXT = False
    CUDA_EXT_ERROR = str(e)


class CudaBackend:
    name = "cuda"

    def unavailable(self, device):
        if not HAS_CUDA_EXT:
            return RuntimeError(f"requested but the CUDA extension is not available: {CUDA_EXT_ERROR}")
        if device.type != "cuda":
            return ValueError(f"needs CUDA tensors, got tensors on {device}")
        return None

    def sgmv_shrink(self, x, lora_a, info, num_slices, out):
        torch.ops.lora_kernels.sgmv_shrink.default(x, lora_a, *segment_args(info), num_slices, info.max_seg_len, out)

    def sgmv_expand(self, v, lora_b, info, slice_offsets, out):
        seg_indptr, weight_indices, lora_ranks, perm = segment_args(info)
        torch.ops.lora_kernels.sgmv_expand.default(v, lora_b, seg_indptr, weight_indices, lora_ranks, info.scalings,
                                                   perm, list(slice_offsets), info.max_seg_len, out)

    def apply_lora(self, x, base_out, lora_a, lora_b, info, slice_offsets):
        seg_indptr, weight_indices, lora_ranks, perm = segment_args(info)
        torch.ops.lora_kernels.sgmv_apply.default(x, lora_a, lora_b, seg_indptr, weight_indices, lora_ranks,
                                                  info.scalings, perm, list(slice_offsets), info.max_seg_len, base_out)


def _register_fakes() -> None:
    @torch.library.register_fake("lora_kernels::sgmv_shrink")
    def _shrink_fake(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices, max_seg_len, v):
        return None

    @torch.library.register_fake("lora_kernels::sgmv_expand")
    def _expand_fake(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets,
                     max_seg_len, out):
        return None

    @torch.library.register_fake("lora_kernels::sgmv_apply")
    def _apply_fake(x, lora_a, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets,
                    max_seg_len, out):
        return None

    @torch.library.register_fake("lora_kernels::batched_h2d_copy")
    def _copy_fake(srcs, dsts):
        return None


BACKEND = CudaBackend()
if HAS_CUDA_EXT:
    _register_fakes()
    from lora_kernels.backends import cuda_cpu

    cuda_cpu.register()
