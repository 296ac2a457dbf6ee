"""The `cuda` backend: the compiled extension `lora_kernels._C` (csrc/), loaded once, and the fake
(meta) kernels of its ops, so that torch.compile and torch.library.opcheck can trace them.

The flat schemas take the batch as the builder's work list (`LoRABatchInfo.work`, `max_tiles`; see
lora_kernels/batch_info.py) plus `lora_ranks`, `scalings` and the optional permutation:

    sgmv_shrink(x, lora_a, work, lora_ranks, permutation, num_slices, max_tiles, v!)
    sgmv_expand(v, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out!)
    sgmv_apply(x, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out!)
    sgmv_linear(x, weight, bias, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets,
                max_tiles, one_launch=False) -> y   (y = linear(x, weight, bias), then sgmv_apply into it; x [..., in_dim];
                one_launch: up to 64 rows the LoRA in one cluster launch, the same bits, fewer host µs, more GPU µs)
    lora_gemv(x, weight, bias, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles,
              sync!, sync_slot, out!)   (out = linear(x, weight, bias) + the LoRA delta in one launch, 1..16 rows;
              lora_kernels/_gemv.py gives the sync words)
    silu_mul(gu) -> y                  (silu(gu[..., :I]) * gu[..., I:], torch's roundings, one launch)
"""

from __future__ import annotations

import torch

try:
    from lora_kernels import _C  # noqa: F401  (loading it registers torch.ops.lora_kernels.*)

    HAS_CUDA_EXT = True
    CUDA_EXT_ERROR = ""
except ImportError as e:  # not built (no nvcc / LORA_KERNELS_BUILD_CUDA=0) or built for another torch
    HAS_CUDA_EXT = False
    CUDA_EXT_ERROR = str(e)


def work_args(info) -> tuple:
    """(work, lora_ranks, permutation): the batch as the schemas take it."""
    if info.work is None:
        raise ValueError("info has no work list (LoRABatchInfo.work): build it with BatchInfoBuilder.build or "
                         "LoRABatchInfo.from_segments")
    return info.work, info.lora_ranks, info.permutation


class CudaBackend:
    name = "cuda"

    def unavailable(self, device):
        if not HAS_CUDA_EXT:
            return RuntimeError(f"requested but the CUDA extension is not available: {CUDA_EXT_ERROR}")
        if device.type != "cuda":
            return ValueError(f"needs CUDA tensors, got tensors on {device}")
        return None

    def sgmv_shrink(self, x, lora_a, info, num_slices, out):
        work, ranks, perm = work_args(info)
        torch.ops.lora_kernels.sgmv_shrink.default(x, lora_a, work, ranks, perm, num_slices, info.max_tiles, out)

    def sgmv_expand(self, v, lora_b, info, slice_offsets, out):
        work, ranks, perm = work_args(info)
        torch.ops.lora_kernels.sgmv_expand.default(v, lora_b, work, ranks, info.scalings, perm, list(slice_offsets),
                                                   info.max_tiles, out)

    def apply_lora(self, x, base_out, lora_a, lora_b, info, slice_offsets):
        work, ranks, perm = work_args(info)
        torch.ops.lora_kernels.sgmv_apply.default(x, lora_a, lora_b, work, ranks, info.scalings, perm,
                                                  list(slice_offsets), info.max_tiles, base_out)

    def linear(self, x, weight, bias, lora_a, lora_b, info, slice_offsets, one_launch=False):
        """linear(x, weight, bias) plus the LoRA delta, in one host call (x [..., in_dim] contiguous); the C++ op
        checks every argument. one_launch: for callers whose GPU waits on the host (an eager decode step)."""
        work, ranks, perm = work_args(info)
        return torch.ops.lora_kernels.sgmv_linear.default(x, weight, bias, lora_a, lora_b, work, ranks, info.scalings,
                                                          perm, list(slice_offsets), info.max_tiles, one_launch)


def _register_fakes() -> None:
    @torch.library.register_fake("lora_kernels::sgmv_shrink")
    def _shrink_fake(x, lora_a, work, lora_ranks, permutation, num_slices, max_tiles, v):
        return None

    @torch.library.register_fake("lora_kernels::sgmv_expand")
    def _expand_fake(v, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out):
        return None

    @torch.library.register_fake("lora_kernels::sgmv_apply")
    def _apply_fake(x, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out):
        return None

    @torch.library.register_fake("lora_kernels::sgmv_linear")
    def _linear_fake(x, weight, bias, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets,
                     max_tiles, one_launch=False):
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("lora_kernels::lora_gemv")
    def _gemv_fake(x, weight, bias, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles,
                   sync, sync_slot, out):
        return None

    @torch.library.register_fake("lora_kernels::silu_mul")
    def _silu_mul_fake(gu):
        return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))

    @torch.library.register_fake("lora_kernels::batched_h2d_copy")
    def _copy_fake(srcs, dsts):
        return None


BACKEND = CudaBackend()
if HAS_CUDA_EXT:
    _register_fakes()
    from lora_kernels.backends import cuda_cpu

    cuda_cpu.register()
