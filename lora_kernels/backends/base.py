"""The protocol every backend implements (the shrink-then-expand composition is reference.apply_lora)."""

from __future__ import annotations

from typing import Protocol

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
