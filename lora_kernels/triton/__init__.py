"""Triton backend of the SGMV ops (DESIGN.md §5); called by lora_kernels/ops.py after validation.

    sgmv_shrink(x, lora_a, info, num_slices, out)          v = shrink(x) into out [T, S*R]
    sgmv_expand(v, lora_b, info, slice_offsets, out)       out += scaling * expand(v), in place
    apply_lora(x, base_out, lora_a, lora_b, info, offs)    base_out += scaling * expand(shrink(x))

apply_lora runs two launches: split-K shrink into an fp32 workspace of partial sums, then expand,
which adds the partials while loading v (no separate reduction, no atomics). Launch configs come
from plan.py (cached per capacity), launches from launch.py (compiled kernels reused); the batch's
segments, slots and ranks are read on the device only.
"""

from __future__ import annotations

import torch

from lora_kernels.triton import plan as _plan
from lora_kernels.triton.kernels import _expand_kernel, _shrink_kernel, _shrink_reduce_kernel
from lora_kernels.triton.launch import launch

__all__ = ["apply_lora", "sgmv_expand", "sgmv_shrink"]


def _shrink_plan(x, lora_a, info, num_slices):
    return _plan.shrink_plan(x.shape[0], x.shape[1], num_slices, lora_a.shape[1] // num_slices, x.dtype,
                             info.weight_indices.shape[0], info.max_seg_len, info.permutation is not None)


def _shrink(p, x, lora_a, info, num_slices, out, partial):
    """The shrink kernel into out: v itself (partial=False, split 1) or the [split, T, S*R] workspace."""
    perm = info.permutation
    tensors = (x, lora_a, out, info.seg_indptr, info.weight_indices, info.lora_ranks,
               info.seg_indptr if perm is None else perm)
    scalars = (info.weight_indices.shape[0], x.shape[1], lora_a.shape[1] // num_slices, lora_a.shape[1], x.shape[0],
               p.k_chunk)
    launch(_shrink_kernel, p.runs, (partial, out.dtype), p.grid, tensors, scalars, {**p.kw, "PARTIAL": partial})


def sgmv_shrink(x, lora_a, info, num_slices, out):
    p = _shrink_plan(x, lora_a, info, num_slices)
    if p.split == 1:
        _shrink(p, x, lora_a, info, num_slices, out, partial=False)
        return out
    ws = torch.empty((p.split, x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    _shrink(p, x, lora_a, info, num_slices, ws, partial=True)
    perm = info.permutation
    tensors = (ws, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.seg_indptr if perm is None else perm)
    scalars = (info.weight_indices.shape[0], lora_a.shape[1] // num_slices, lora_a.shape[1], x.shape[0], p.split)
    launch(_shrink_reduce_kernel, p.runs, ("reduce", out.dtype), p.reduce_grid, tensors, scalars, p.reduce_kw)
    return out


def _expand(v, lora_b, info, slice_offsets, out, n_split):
    rows = out.shape[0]
    cap = info.weight_indices.shape[0]
    perm = info.permutation
    max_rank = lora_b.shape[2]
    p = _plan.expand_plan(rows, slice_offsets, max_rank, out.dtype, cap, info.max_seg_len, perm is not None, n_split)
    tensors = (v, lora_b, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
               info.seg_indptr if perm is None else perm)
    scalars = (cap, max_rank, max_rank * (len(slice_offsets) - 1), slice_offsets[-1], rows, n_split, *p.offsets)
    launch(_expand_kernel, p.runs, v.dtype, p.grid, tensors, scalars, p.kw)


def sgmv_expand(v, lora_b, info, slice_offsets, out):
    _expand(v, lora_b, info, slice_offsets, out, 1)
    return out


def apply_lora(x, base_out, lora_a, lora_b, info, slice_offsets):
    num_slices = len(slice_offsets) - 1
    p = _shrink_plan(x, lora_a, info, num_slices)
    ws = torch.empty((p.split, x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
    _shrink(p, x, lora_a, info, num_slices, ws, partial=True)
    _expand(ws, lora_b, info, slice_offsets, base_out, p.split)
    return base_out
