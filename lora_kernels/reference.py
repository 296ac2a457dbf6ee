"""Pure-torch SGMV: the `torch` backend and the ground truth of the tests (CPU and GPU).

Semantics (DESIGN.md §5), for segment s covering segmented rows [seg_indptr[s], seg_indptr[s+1]),
physical row t = permutation[i] (or i), slot = weight_indices[s], r = lora_ranks[slot], R = max rank:

    shrink: v[t, i*R + j] = sum_k x[t, k] * lora_a[slot, i*R + j, k]     j < r;  0 otherwise / slot -1
    expand: out[t, off[i] + n] += scalings[slot] * sum_{j<r} v[t, i*R + j] * lora_b[slot, off[i] + n, j]

Arithmetic runs in fp32 for 16-bit inputs (as the kernels accumulate) and in the input dtype for
fp32/fp64. The loop over segments reads the metadata back to the host: correct, not fast.
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _segments(seg_indptr, weight_indices, lora_ranks, permutation):
    """Yields (rows, slot, rank) for each non-empty segment; rows are physical row indices."""
    indptr = seg_indptr.tolist()
    slots = weight_indices.tolist()
    ranks = lora_ranks.tolist()
    perm = permutation
    for s, slot in enumerate(slots):
        begin, end = indptr[s], indptr[s + 1]
        if end <= begin:
            continue
        if slot >= len(ranks):
            raise ValueError(f"weight_indices[{s}]={slot} is out of range for {len(ranks)} slots")
        rank = ranks[slot] if slot >= 0 else 0
        idx = torch.arange(begin, end, device=seg_indptr.device)
        rows = perm[idx].long() if perm is not None else idx
        yield rows, slot, rank


def sgmv_shrink(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, num_slices, out):
    """Writes v = shrink(x) into ``out`` [T, S*R] for every row covered by a segment; returns out."""
    cd = _compute_dtype(x.dtype)
    max_rank = lora_a.shape[1] // num_slices
    for rows, slot, rank in _segments(seg_indptr, weight_indices, lora_ranks, permutation):
        if slot < 0 or rank == 0:
            out[rows] = 0
            continue
        a = lora_a[slot].to(cd).view(num_slices, max_rank, -1).clone()
        a[:, rank:] = 0
        out[rows] = (x[rows].to(cd) @ a.reshape(num_slices * max_rank, -1).T).to(out.dtype)
    return out


def sgmv_expand(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets, out):
    """Adds scaling * expand(v) into ``out`` [T, out_total] in place; returns out."""
    cd = _compute_dtype(out.dtype)
    max_rank = lora_b.shape[2]
    scale_list = scalings.tolist()
    for rows, slot, rank in _segments(seg_indptr, weight_indices, lora_ranks, permutation):
        if slot < 0 or rank == 0:
            continue
        acc = out[rows].to(cd)
        for i in range(len(slice_offsets) - 1):
            lo, hi = slice_offsets[i], slice_offsets[i + 1]
            vi = v[rows, i * max_rank : i * max_rank + rank].to(cd)
            bi = lora_b[slot, lo:hi, :rank].to(cd)
            acc[:, lo:hi] += scale_list[slot] * (vi @ bi.T)
        out[rows] = acc.to(out.dtype)
    return out


def apply_lora(x, lora_a, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets, out):
    """out += scaling * expand(shrink(x)) through a zeroed fp32 v [T, S*R]: the one place the shrink-then-expand
    composition is written (the torch backend and the extension's CPU kernels call it); returns out."""
    v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    sgmv_shrink(x, lora_a, seg_indptr, weight_indices, lora_ranks, permutation, len(slice_offsets) - 1, v)
    return sgmv_expand(v, lora_b, seg_indptr, weight_indices, lora_ranks, scalings, permutation, slice_offsets, out)
