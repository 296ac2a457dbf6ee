"""CPU kernels of the extension's SGMV schemas (reference.py over the rows the work list covers), so the
same ops run, and are op-checked, on a CPU-only machine (CI)."""

from __future__ import annotations

import torch

from lora_kernels import reference
from lora_kernels.batch_info import TILE_M


def work_rows(work: torch.Tensor, max_tiles: int, permutation: torch.Tensor | None, num_slots: int):
    """The rows the work list covers as one-row segments: (seg_indptr, weight_indices, permutation) for
    reference.py, in tile order (segmented row i of tile t is physical row permutation[row0 + i]). A slot
    outside [0, num_slots) means no LoRA, as in the CUDA kernels."""
    m = max_tiles
    n = min(max(int(work[0]), 0), m)
    slots, row0, end = work[1:1 + n].long(), work[1 + m:1 + m + n].long(), work[1 + 2 * m:1 + 2 * m + n].long()
    counts = (end - row0).clamp(0, TILE_M)
    first = torch.cumsum(counts, 0) - counts
    seg_rows = torch.repeat_interleave(row0 - first, counts) + torch.arange(int(counts.sum()))
    rows = seg_rows if permutation is None else permutation.long()[seg_rows]
    indptr = torch.arange(rows.numel() + 1, dtype=torch.int32)
    slots = torch.where((slots >= 0) & (slots < num_slots), slots, -1)
    return indptr, torch.repeat_interleave(slots, counts).int(), rows.int()


def _apply_cpu(x, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out):
    indptr, slots, rows = work_rows(work, max_tiles, permutation, lora_ranks.shape[0])
    reference.apply_lora(x, lora_a, lora_b, indptr, slots, lora_ranks, scalings, rows, slice_offsets, out)


def register() -> None:
    @torch.library.impl("lora_kernels::sgmv_shrink", "CPU")
    def _shrink_cpu(x, lora_a, work, lora_ranks, permutation, num_slices, max_tiles, v):
        indptr, slots, rows = work_rows(work, max_tiles, permutation, lora_ranks.shape[0])
        reference.sgmv_shrink(x, lora_a, indptr, slots, lora_ranks, rows, num_slices, v)

    @torch.library.impl("lora_kernels::sgmv_expand", "CPU")
    def _expand_cpu(v, lora_b, work, lora_ranks, scalings, permutation, slice_offsets, max_tiles, out):
        indptr, slots, rows = work_rows(work, max_tiles, permutation, lora_ranks.shape[0])
        reference.sgmv_expand(v, lora_b, indptr, slots, lora_ranks, scalings, rows, slice_offsets, out)

    torch.library.impl("lora_kernels::sgmv_apply", "CPU")(_apply_cpu)

    @torch.library.impl("lora_kernels::sgmv_linear", "CPU")
    def _linear_cpu(x, weight, bias, lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets,
                    max_tiles, one_launch=False):  # one_launch changes only the GPU's launch count, never the result
        out = torch.nn.functional.linear(x, weight, bias).contiguous()
        _apply_cpu(x.reshape(-1, x.shape[-1]), lora_a, lora_b, work, lora_ranks, scalings, permutation, slice_offsets,
                   max_tiles, out.view(-1, out.shape[-1]))
        return out

    @torch.library.impl("lora_kernels::silu_mul", "CPU")
    def _silu_mul_cpu(gu):
        if gu.shape[-1] % 2:
            raise ValueError(f"gu must be [..., 2 * inter] (gate | up), got shape {tuple(gu.shape)}")
        inter = gu.shape[-1] // 2
        return torch.nn.functional.silu(gu[..., :inter]) * gu[..., inter:]
