"""Triton backend of the SGMV ops (DESIGN.md §5); called by lora_kernels/ops.py after validation.

    sgmv_shrink(x, lora_a, info, num_slices, out)          v = shrink(x) into out [T, S*R]
    sgmv_expand(v, lora_b, info, slice_offsets, out)       out += scaling * expand(v), in place
    apply_lora(x, base_out, lora_a, lora_b, info, offs)    base_out += scaling * expand(shrink(x))

apply_lora runs two launches: split-K shrink into an fp32 workspace of partial sums, then expand,
which adds the partials while loading v (no separate reduction, no atomics). Launch configs come
from plan.py (cached per capacity); the batch's segments, slots and ranks are read on the device only.
"""

from __future__ import annotations

import torch

from lora_kernels.triton import plan as _plan
from lora_kernels.triton.kernels import _expand_kernel, _shrink_kernel, _shrink_reduce_kernel

__all__ = ["apply_lora", "sgmv_expand", "sgmv_shrink"]


def _shrink(x, lora_a, info, num_slices, ws, partial):
    """Launches the shrink kernel; returns its plan (ws: out itself, or the [split, T, S*R] workspace)."""
    rows, in_dim = x.shape
    cap = info.weight_indices.shape[0]
    perm = info.permutation
    p = _plan.shrink_plan(rows, in_dim, num_slices, lora_a.shape[1] // num_slices, x.dtype, cap, info.max_seg_len,
                          perm is not None)
    if ws is None:
        ws = torch.empty((p.split, rows, lora_a.shape[1]), dtype=torch.float32, device=x.device)
    _shrink_kernel[p.grid](x, lora_a, ws, info.seg_indptr, info.weight_indices, info.lora_ranks,
                           info.seg_indptr if perm is None else perm, cap, in_dim, lora_a.shape[1] // num_slices,
                           lora_a.shape[1], rows, p.k_chunk, PARTIAL=partial, **p.kw)
    return p, ws


def sgmv_shrink(x, lora_a, info, num_slices, out):
    rows = x.shape[0]
    cap = info.weight_indices.shape[0]
    p = _plan.shrink_plan(rows, x.shape[1], num_slices, lora_a.shape[1] // num_slices, x.dtype, cap,
                          info.max_seg_len, info.permutation is not None)
    if p.split == 1:
        _shrink(x, lora_a, info, num_slices, out, partial=False)
        return out
    _, ws = _shrink(x, lora_a, info, num_slices, None, partial=True)
    perm = info.permutation
    _shrink_reduce_kernel[p.reduce_grid](ws, out, info.seg_indptr, info.weight_indices, info.lora_ranks,
                                         info.seg_indptr if perm is None else perm, cap,
                                         lora_a.shape[1] // num_slices, lora_a.shape[1], rows, p.split,
                                         **p.reduce_kw)
    return out


def _expand(v, lora_b, info, slice_offsets, out, n_split):
    rows = out.shape[0]
    cap = info.weight_indices.shape[0]
    perm = info.permutation
    max_rank = lora_b.shape[2]
    p = _plan.expand_plan(rows, slice_offsets, max_rank, out.dtype, cap, info.max_seg_len, perm is not None, n_split)
    o1, o2, o3, t1, t2, t3 = p.offsets
    _expand_kernel[p.grid](v, lora_b, out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                           info.seg_indptr if perm is None else perm, cap, max_rank,
                           max_rank * (len(slice_offsets) - 1), slice_offsets[-1], rows, n_split,
                           o1, o2, o3, t1, t2, t3, **p.kw)


def sgmv_expand(v, lora_b, info, slice_offsets, out):
    _expand(v, lora_b, info, slice_offsets, out, 1)
    return out


def apply_lora(x, base_out, lora_a, lora_b, info, slice_offsets):
    p, ws = _shrink(x, lora_a, info, len(slice_offsets) - 1, None, partial=True)
    _expand(ws, lora_b, info, slice_offsets, base_out, p.split)
    return base_out
