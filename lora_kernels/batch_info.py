"""Batch metadata for the SGMV ops (DESIGN.md §4).

`BatchInfoBuilder.build` turns the scheduler's per-request (token count, slot) lists into a
`LoRABatchInfo` on the device of the pool's `lora_ranks`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass
class LoRABatchInfo:
    """Segments of a batch, one adapter slot each; all tensors on the kernels' device.

    seg_lens[s]        rows in segment s (int32[cap_segments])
    seg_indptr[s]      exclusive prefix sum of seg_lens (int32[cap_segments + 1])
    weight_indices[s]  slot of segment s, -1 = no LoRA (int32[cap_segments])
    permutation[i]     physical row of segmented row i, or None (int32[cap_tokens])
    num_segments       segments in use; tail segments are empty with slot -1
    max_seg_len        upper bound on seg_lens, sizes the kernels' grids
    num_tokens         rows of x in the batch
    lora_ranks         rank per slot (the pool's tensor), scalings: scaling per slot (the pool's)
    """

    seg_lens: torch.Tensor
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    permutation: torch.Tensor | None
    num_segments: int
    max_seg_len: int
    num_tokens: int
    lora_ranks: torch.Tensor
    scalings: torch.Tensor

    @property
    def num_slots(self) -> int:
        return self.lora_ranks.shape[0]


class BatchInfoBuilder:
    """Builds `LoRABatchInfo` for batches of at most `max_tokens` rows and `max_segments` requests."""

    def __init__(self, max_tokens: int, max_segments: int, lora_ranks: torch.Tensor, scalings: torch.Tensor,
                 cuda_graph: bool = False):
        if max_tokens < 1 or max_segments < 1:
            raise ValueError(f"max_tokens and max_segments must be >= 1, got {max_tokens}, {max_segments}")
        if lora_ranks.dim() != 1 or lora_ranks.dtype != torch.int32:
            raise ValueError(f"lora_ranks must be int32[num_slots], got {tuple(lora_ranks.shape)} {lora_ranks.dtype}")
        if scalings.shape != lora_ranks.shape or scalings.dtype != torch.float32:
            raise ValueError(f"scalings must be float32[{lora_ranks.shape[0]}], got {tuple(scalings.shape)} "
                             f"{scalings.dtype}")
        self.max_tokens = max_tokens
        self.max_segments = max_segments
        self.lora_ranks = lora_ranks
        self.scalings = scalings
        self.device = lora_ranks.device
        self.cuda_graph = cuda_graph

    def _validate(self, counts: np.ndarray, slots: np.ndarray) -> None:
        if counts.shape != slots.shape:
            raise ValueError(f"seg_token_counts has {counts.size} entries but slots has {slots.size}")
        if counts.size > self.max_segments:
            raise ValueError(f"{counts.size} requests exceed max_segments={self.max_segments}")
        if counts.size and counts.min() < 0:
            raise ValueError(f"seg_token_counts must be >= 0, got {int(counts.min())}")
        num_slots = self.lora_ranks.shape[0]
        if slots.size and (slots.min() < -1 or slots.max() >= num_slots):
            bad = int(slots[(slots < -1) | (slots >= num_slots)][0])
            raise ValueError(f"slot {bad} out of range: slots must be -1 or in [0, {num_slots})")
        if counts.sum() > self.max_tokens:
            raise ValueError(f"{int(counts.sum())} tokens exceed max_tokens={self.max_tokens}")

    def build(self, seg_token_counts: Sequence[int], slots: Sequence[int], sort_by_adapter: bool = False
              ) -> LoRABatchInfo:
        counts = np.asarray(seg_token_counts, dtype=np.int64).reshape(-1)
        slot_arr = np.asarray(slots, dtype=np.int64).reshape(-1)
        self._validate(counts, slot_arr)
        num_tokens = int(counts.sum())
        permutation = None
        if sort_by_adapter and counts.size:
            row_slot = np.repeat(slot_arr, counts)
            order = np.argsort(row_slot, kind="stable")
            permutation = order.astype(np.int32)
            uniq, seg_counts = np.unique(row_slot[order], return_counts=True)
            slot_arr, counts = uniq, seg_counts
        cap = self.max_segments if self.cuda_graph else max(counts.size, 1)
        seg_lens = np.zeros(cap, dtype=np.int32)
        seg_lens[: counts.size] = counts
        weight_indices = np.full(cap, -1, dtype=np.int32)
        weight_indices[: slot_arr.size] = slot_arr
        seg_indptr = np.zeros(cap + 1, dtype=np.int32)
        np.cumsum(seg_lens, out=seg_indptr[1:])
        if permutation is not None and self.cuda_graph:
            full = np.arange(self.max_tokens, dtype=np.int32)
            full[: permutation.size] = permutation
            permutation = full
        max_seg_len = self.max_tokens if self.cuda_graph else int(counts.max(initial=0))

        def dev(a):
            return torch.from_numpy(a).to(self.device, non_blocking=False)

        return LoRABatchInfo(
            seg_lens=dev(seg_lens),
            seg_indptr=dev(seg_indptr),
            weight_indices=dev(weight_indices),
            permutation=None if permutation is None else dev(permutation),
            num_segments=int(counts.size),
            max_seg_len=max_seg_len,
            num_tokens=num_tokens,
            lora_ranks=self.lora_ranks,
            scalings=self.scalings,
        )
