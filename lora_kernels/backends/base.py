"""The protocol every backend implements, and the helpers they share."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from lora_kernels.batch_info import LoRABatchInfo


class Backend(Protocol):
    """Ops run after ops.py has validated their arguments (shapes, dtypes, devices, limits)."""

    name: str

    def unavailable(self, device: torch.device) -> Exception | None:
        """Why this backend cannot run on `device` (RuntimeError: not installed/built; ValueError: wrong
        device), or None."""

    def sgmv_shrink(self, x: torch.Tensor, lora_a: torch.Tensor, info: LoRABatchInfo, num_slices: int,
                    out: torch.Tensor) -> None: ...

    def sgmv_expand(self, v: torch.Tensor, lora_b: torch.Tensor, info: LoRABatchInfo,
                    slice_offsets: tuple[int, ...], out: torch.Tensor) -> None: ...

    def apply_lora(self, x: torch.Tensor, base_out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   info: LoRABatchInfo, slice_offsets: tuple[int, ...]) -> None: ...


def segment_args(info: LoRABatchInfo) -> tuple:
    """The batch as the flat kernel schemas take it: (seg_indptr, weight_indices, lora_ranks, permutation)."""
    return info.seg_indptr, info.weight_indices, info.lora_ranks, info.permutation


def shrink_then_expand(shrink: Callable, expand: Callable, x: torch.Tensor, base_out: torch.Tensor,
                       lora_a: torch.Tensor, lora_b: torch.Tensor, info: LoRABatchInfo,
                       slice_offsets: Sequence[int]) -> None:
    """apply_lora composed of the two ops through a zeroed fp32 v [T, S*R] (backends without a fused path)."""
    v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    shrink(x, lora_a, info, len(slice_offsets) - 1, v)
    expand(v, lora_b, info, slice_offsets, base_out)
