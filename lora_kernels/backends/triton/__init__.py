"""The `triton` backend of the SGMV ops (DESIGN.md §5); called by lora_kernels/ops.py after validation.

    sgmv_shrink   split-K shrink into a [SPLIT, T, S*R] fp32 workspace, then the ordered reduction into v
                  (SPLIT 1: straight into v)
    sgmv_expand   out += scaling * expand(v), in place
    apply_lora    shrink into the workspace, then the expand adds the partials in split order while it loads
                  v (no reduction kernel, no atomics); from `plan.reduce_first` rows on the partials are
                  reduced once first, so that no column tile re-reads them; up to `plan.fused_rows()` rows,
                  both in one launch (fused.py), with the same bits

Every kernel walks the batch's work list (`LoRABatchInfo.work`) with a persistent grid; plans come from
shapes only (plan.py), launches from cached compiled kernels (launch.py).
"""

from __future__ import annotations

import torch

from lora_kernels.backends.triton import plan as _plan
from lora_kernels.backends.triton.fused import _fused_kernel
from lora_kernels.backends.triton.kernels import _expand_kernel, _reduce_kernel, _shrink_kernel
from lora_kernels.backends.triton.launch import launch

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_sync: dict = {}  # (device, stream, size) -> the fused kernel's tile counters, zero between launches

__all__ = ["BACKEND"]


def _work(info):
    if info.work is None:
        raise ValueError("info has no work list (LoRABatchInfo.work): build it with BatchInfoBuilder.build or "
                         "LoRABatchInfo.from_segments")
    return info.work, info.work if info.permutation is None else info.permutation


def _shrink(p, x, lora_a, info, num_slices, out, partial):
    work, perm = _work(info)
    R = lora_a.shape[1] // num_slices
    tensors = (x, lora_a, out, work, info.lora_ranks, perm)
    scalars = (info.max_tiles, x.shape[1], R, lora_a.shape[1], x.shape[0], p.k_chunk)
    g = _plan.grid(info.max_tiles * p.n_tiles * p.split, p.ctas, x.device)
    launch(_shrink_kernel, p.runs, (partial, out.dtype), g, tensors, scalars, {**p.kw, "PARTIAL": partial})


def _reduce(p, ws, out, info, R, NR):
    work, perm = _work(info)
    g = _plan.grid(info.max_tiles * p.reduce_tiles, p.ctas, out.device)
    launch(_reduce_kernel, p.runs, ("reduce", out.dtype), g, (ws, out, work, info.lora_ranks, perm),
           (info.max_tiles, R, NR, out.shape[0]), p.reduce_kw)


def _expand(v, lora_b, info, slice_offsets, out, n_split):
    work, perm = _work(info)
    R = lora_b.shape[2]
    p = _plan.expand_plan(slice_offsets, R, out.dtype, info.permutation is not None, n_split, out.device)
    tensors = (v, lora_b, out, work, info.lora_ranks, info.scalings, perm)
    scalars = (info.max_tiles, R, R * (len(slice_offsets) - 1), slice_offsets[-1], out.shape[0], *p.scalars)
    g = _plan.grid(info.max_tiles * p.n_tiles, p.ctas, out.device)
    launch(_expand_kernel, p.runs, v.dtype, g, tensors, scalars, p.kw)


def _sync_counters(max_tiles: int, device: torch.device) -> torch.Tensor:
    """Counters [arrivals | consumed] for max_tiles tiles: one buffer per stream (kernels on two streams may
    run at once) and power-of-two size, kept for the process (a captured graph holds its address)."""
    n = 1 << max(2 * max_tiles - 1, 0).bit_length()
    stream = _raw_stream(device.index) if device.type == "cuda" else None
    key = (device, stream, n)
    buf = _sync.get(key)
    if buf is None:
        buf = _sync[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return buf


def _fused(sp, x, base_out, lora_a, lora_b, info, slice_offsets, ws):
    """apply_lora in one launch (fused.py): the shrink's and the expand's items in two phases."""
    work, perm = _work(info)
    R = lora_b.shape[2]
    ep = _plan.expand_plan(slice_offsets, R, base_out.dtype, info.permutation is not None, sp.split, x.device)
    fp = _plan.fused_plan(sp, ep)
    sync = _sync_counters(info.max_tiles, x.device)
    tensors = (x, lora_a, lora_b, base_out, ws, sync, work, info.lora_ranks, info.scalings, perm)
    scalars = (info.max_tiles, x.shape[1], R, lora_a.shape[1], slice_offsets[-1], x.shape[0], sp.k_chunk, *ep.scalars)
    launch(_fused_kernel, fp.runs, ("fused", x.dtype), _plan.fused_grid(info.max_tiles, fp.items, x.device), tensors,
           scalars, fp.kw)


def _shrink_plan(x, lora_a, info, num_slices):
    return _plan.shrink_plan(x.shape[1], num_slices, lora_a.shape[1] // num_slices, x.dtype,
                             info.permutation is not None, x.device)


class TritonBackend:
    name = "triton"

    def unavailable(self, device):
        if device.type != "cuda" and not _plan.INTERPRET:
            return ValueError(f"needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on {device}")
        return None

    def sgmv_shrink(self, x, lora_a, info, num_slices, out):
        p = _shrink_plan(x, lora_a, info, num_slices)
        if p.split == 1:
            _shrink(p, x, lora_a, info, num_slices, out, partial=False)
            return
        ws = torch.empty((p.split, x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
        _shrink(p, x, lora_a, info, num_slices, ws, partial=True)
        _reduce(p, ws, out, info, lora_a.shape[1] // num_slices, lora_a.shape[1])

    def sgmv_expand(self, v, lora_b, info, slice_offsets, out):
        _expand(v, lora_b, info, slice_offsets, out, 1)

    def apply_lora(self, x, base_out, lora_a, lora_b, info, slice_offsets):
        num_slices = len(slice_offsets) - 1
        p = _shrink_plan(x, lora_a, info, num_slices)
        ws = torch.empty((p.split, x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
        if x.shape[0] <= _plan.fused_rows():
            _fused(p, x, base_out, lora_a, lora_b, info, slice_offsets, ws)
            return
        _shrink(p, x, lora_a, info, num_slices, ws, partial=True)
        if p.split > 1 and _plan.reduce_first(x.shape[0]):
            v = torch.empty((x.shape[0], lora_a.shape[1]), dtype=torch.float32, device=x.device)
            _reduce(p, ws, v, info, lora_a.shape[1] // num_slices, lora_a.shape[1])
            _expand(v, lora_b, info, slice_offsets, base_out, 1)
        else:
            _expand(ws, lora_b, info, slice_offsets, base_out, p.split)


BACKEND = TritonBackend()
