"""The `triton` backend of the SGMV ops (DESIGN.md §5); called by lora_kernels/ops.py after validation.

    sgmv_shrink   split-K shrink into a [SPLIT, T, S*R] fp32 workspace, then the ordered reduction into v
                  (SPLIT 1: straight into v)
    sgmv_expand   out += scaling * expand(v), in place
    apply_lora    shrink into the workspace, then the expand adds the partials in split order while it loads
                  v (no reduction kernel, no atomics); from `plan.reduce_first` rows on the partials are
                  reduced once first, so that no column tile re-reads them; up to `plan.fused_rows()` rows,
                  both in one launch (fused.py), with the same bits; from the tall entry's `min_rows` rows on
                  (pool ranks `min_rank`..`max_rank`, a dense work list, `min_items`), tall tiles (tall.py):
                  groups of work-list tiles per dot,
                  the shrink sums its K splits in registers into v, the expand reads v, again with the same bits

Every kernel walks the batch's work list (`LoRABatchInfo.work`) with a persistent grid; plans come from
shapes only (plan.py), launches from cached compiled kernels (launch.py).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from lora_kernels.backends.triton import plan as _plan
from lora_kernels.backends.triton.fused import _fused_kernel
from lora_kernels.backends.triton.kernels import _expand_kernel, _reduce_kernel, _shrink_kernel
from lora_kernels.backends.triton.tall import _tall_expand_kernel, _tall_shrink_kernel
from lora_kernels.backends.triton.launch import launch
from lora_kernels.batch_info import _raw_stream

_sync: dict = {}  # (device, stream, size) -> the fused kernel's tile counters, zero between launches

__all__ = ["BACKEND"]


def _work(info):
    if info.work is None:
        raise ValueError("info has no work list (LoRABatchInfo.work): build it with BatchInfoBuilder.build or "
                         "LoRABatchInfo.from_segments")
    return info.work, info.work if info.permutation is None else info.permutation


@dataclass(frozen=True)
class _Step:
    """One launch with everything but its tensors fixed: kernel, compiled-launcher cache, grid, scalars."""
    kernel: object
    runs: dict
    tag: object
    grid: tuple
    scalars: tuple
    kw: dict

    def __call__(self, *tensors) -> None:
        launch(self.kernel, self.runs, self.tag, self.grid, tensors, self.scalars, self.kw)


def _shrink_step(p, x_shape, NR, R, max_tiles, partial, out_dtype, device) -> _Step:
    scalars = (max_tiles, x_shape[1], R, NR, x_shape[0], p.k_chunk)
    g = _plan.grid(max_tiles * p.n_tiles * p.split, p.ctas, device)
    return _Step(_shrink_kernel, p.runs, (partial, out_dtype), g, scalars, {**p.kw, "PARTIAL": partial})


def _reduce_step(p, rows, R, NR, max_tiles, out_dtype, device) -> _Step:
    g = _plan.grid(max_tiles * p.reduce_tiles, p.ctas, device)
    return _Step(_reduce_kernel, p.runs, ("reduce", out_dtype), g, (max_tiles, R, NR, rows), p.reduce_kw)


def _expand_step(rows, R, slice_offsets, v_dtype, out_dtype, has_perm, n_split, max_tiles, device) -> _Step:
    p = _plan.expand_plan(slice_offsets, R, out_dtype, has_perm, n_split, device)
    scalars = (max_tiles, R, R * (len(slice_offsets) - 1), slice_offsets[-1], rows, *p.scalars)
    g = _plan.grid(max_tiles * p.n_tiles, p.ctas, device)
    return _Step(_expand_kernel, p.runs, v_dtype, g, scalars, p.kw)


def _fused_step(sp, x_shape, NR, R, slice_offsets, dtype, has_perm, max_tiles, device) -> _Step:
    ep = _plan.expand_plan(slice_offsets, R, dtype, has_perm, sp.split, device)
    fp = _plan.fused_plan(sp, ep)
    scalars = (max_tiles, x_shape[1], R, NR, slice_offsets[-1], x_shape[0], sp.k_chunk, *ep.scalars)
    return _Step(_fused_kernel, fp.runs, ("fused", dtype), _plan.fused_grid(max_tiles, fp.items, device), scalars,
                 fp.kw)


def _tall_steps(sp, x_shape, NR, R, slice_offsets, dtype, v_dtype, max_tiles, assign=False) -> tuple:
    """The tall-tile shrink (into v of v_dtype) and expand (adds to out; assign: writes the delta) launches: one
    program per item (group, column tile) of the work list's capacity."""
    tp, scalars = _plan.tall_plan(sp, slice_offsets, R, dtype)
    s, e = tp.shrink_kw, {**tp.expand_kw, "ASSIGN": assign}
    s_grid = (max(1, _plan._cdiv(max_tiles, s["GROUP"]) * s["N_COLS"]),)
    e_grid = (max(1, _plan._cdiv(max_tiles, e["GROUP"]) * e["N_COLS"]),)
    shrink = _Step(_tall_shrink_kernel, tp.runs, ("tall-s", v_dtype), s_grid,
                   (max_tiles, x_shape[1], R, NR, sp.k_chunk), s)
    expand = _Step(_tall_expand_kernel, tp.runs, ("tall-e", dtype, assign), e_grid,
                   (max_tiles, R, NR, slice_offsets[-1], *scalars), e)
    return shrink, expand


@dataclass(frozen=True)
class _Recipe:
    """An op's launches for one argument signature, and the fp32 workspaces they need (split-K partials ws,
    reduced v). Cached with the plans (plan.cached): a call then costs its allocations and launches."""
    mode: str  # shrink: direct | reduce; expand: direct; apply: fused | two | reduce | tall
    steps: tuple
    ws: tuple | None
    v: tuple | None


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


# fp32 workspaces of eager calls up to this many elements (decode batches) come from one buffer per (thread, device,
# stream), grown on demand: torch.empty cost ~3 of an eager call's ~26 µs of host time (host_breakdown.py, H200).
_WS_KEEP, _WS_KEYS = 1 << 20, 64
_ws: dict = {}


def _workspace(shape: tuple, device: torch.device) -> torch.Tensor:
    """An fp32 tensor of at least prod(shape) elements for one call's kernels, which use only its address. One buffer
    reused by the calls of a thread on a stream is what the caching allocator gives consecutive calls there: each
    call's kernels run after the previous call's on that stream (under PDL a kernel writes only after gdc_wait, i.e.
    after its predecessor grid completed). Per thread: two threads interleaving launches on one stream never share it.
    Larger workspaces (prefill) and graph captures (whose pool holds what the graph uses) take torch.empty."""
    n = math.prod(shape)
    if n > _WS_KEEP or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.empty(shape, dtype=torch.float32, device=device)
    key = (threading.get_ident(), device.index, _raw_stream(device.index))
    buf = _ws.get(key)
    if buf is None or buf.numel() < n:
        if buf is None and len(_ws) >= _WS_KEYS:  # threads come and go: drop the buffers rather than grow without
            _ws.clear()                           # bound (a dropped one returns to the allocator in stream order)
        buf = _ws[key] = torch.empty(max(n, 4096), dtype=torch.float32, device=device)
    return buf


def _apply_recipe(x, lora_a, lora_b, info, slice_offsets, path: tuple, assign: bool = False) -> _Recipe:
    """assign (tall path only): the expand writes the delta instead of adding it (`TritonBackend.lora_delta`)."""
    S, R, NR, rows, dev = len(slice_offsets) - 1, lora_b.shape[2], lora_a.shape[1], x.shape[0], x.device
    has_perm, mt = info.permutation is not None, info.max_tiles
    sp = _plan.shrink_plan(x.shape[1], S, NR // S, x.dtype, has_perm, dev)
    ws = (sp.split, rows, NR)
    if path[0] == "fused":
        return _Recipe("fused", (_fused_step(sp, x.shape, NR, R, slice_offsets, x.dtype, has_perm, mt, dev),), ws, None)
    if path[0] == "tall":
        # v in the adapters' dtype: the expand casts v to it before its dot anyway, so the same bits, half the bytes.
        return _Recipe("tall", _tall_steps(sp, x.shape, NR, R, slice_offsets, x.dtype, x.dtype, mt, assign), None,
                       (rows, NR))
    shrink = _shrink_step(sp, x.shape, NR, NR // S, mt, True, torch.float32, dev)
    # The partials are reduced into v first from reduce_first rows on (no column tile re-reads them); otherwise the
    # expand adds them itself.
    reduce = sp.split > 1 and _plan.reduce_first(rows)
    expand = _expand_step(rows, R, slice_offsets, torch.float32, x.dtype, has_perm, 1 if reduce else sp.split, mt,
                          dev)
    if not reduce:
        return _Recipe("two", (shrink, expand), ws, None)
    return _Recipe("reduce", (shrink, _reduce_step(sp, rows, NR // S, NR, mt, torch.float32, dev), expand), ws,
                   (rows, NR))




def _run_tall(r: _Recipe, x, out, lora_a, lora_b, info, work, perm) -> None:
    """A tall recipe's two launches: the shrink into v (the adapters' dtype), then the expand into out."""
    v = torch.empty(r.v, dtype=x.dtype, device=x.device)
    r.steps[0](x, lora_a, v, work, info.lora_ranks, perm)
    r.steps[1](v, lora_b, out, work, info.lora_ranks, info.scalings, perm)


class TritonBackend:
    name = "triton"

    def unavailable(self, device):
        if device.type != "cuda" and not _plan.INTERPRET:
            return ValueError(f"needs CUDA tensors (or TRITON_INTERPRET=1), got tensors on {device}")
        return None

    def sgmv_shrink(self, x, lora_a, info, num_slices, out):
        work, perm = _work(info)
        key = ("shrink", x.shape, x.dtype, lora_a.shape, num_slices, out.dtype, x.device, info.max_tiles,
               perm is not work, _plan.apply_path(x.shape[0], lora_a.shape[1] // num_slices, lora_a.shape[1],
                                                 info.max_tiles))
        r = _plan.cached(key, lambda: _shrink_recipe(x, lora_a, info, num_slices, out.dtype))
        if r.mode == "direct":
            r.steps[0](x, lora_a, out, work, info.lora_ranks, perm)
            return
        ws = _workspace(r.ws, x.device)
        r.steps[0](x, lora_a, ws, work, info.lora_ranks, perm)
        r.steps[1](ws, out, work, info.lora_ranks, perm)

    def sgmv_expand(self, v, lora_b, info, slice_offsets, out):
        work, perm = _work(info)
        key = ("expand", v.shape, v.dtype, lora_b.shape, slice_offsets, out.dtype, v.device, info.max_tiles,
               perm is not work)
        r = _plan.cached(key, lambda: _Recipe("direct", (_expand_step(
            out.shape[0], lora_b.shape[2], slice_offsets, v.dtype, out.dtype, perm is not work, 1, info.max_tiles,
            out.device),), None, None))
        r.steps[0](v, lora_b, out, work, info.lora_ranks, info.scalings, perm)

    def lora_delta(self, x, out, lora_a, lora_b, info, slice_offsets) -> bool:
        """out = the LoRA delta of every row (0 for rows of slot -1 / rank 0), out never read: the tall-tile path
        with its expand storing instead of adding (`lora_linear`'s "first" mode). Rows the work list does not
        cover are not written: the caller checks that info covers x. Returns False, having done nothing, where
        the tall path does not run (plan.apply_path: fewer rows than the table's tall entry, a sparse work list,
        too few items)."""
        path = _plan.apply_path(x.shape[0], lora_b.shape[2], lora_a.shape[1], info.max_tiles)
        if path[0] != "tall":
            return False
        work, perm = _work(info)
        key = ("delta", x.shape, x.dtype, lora_a.shape, lora_b.shape[2], slice_offsets, x.device, info.max_tiles,
               perm is not work, path)
        r = _plan.cached(key, lambda: _apply_recipe(x, lora_a, lora_b, info, slice_offsets, path, assign=True))
        _run_tall(r, x, out, lora_a, lora_b, info, work, perm)
        return True

    def apply_lora(self, x, base_out, lora_a, lora_b, info, slice_offsets):
        work, perm = _work(info)
        path = _plan.apply_path(x.shape[0], lora_b.shape[2], lora_a.shape[1], info.max_tiles)
        key = ("apply", x.shape, x.dtype, lora_a.shape, lora_b.shape[2], slice_offsets, x.device, info.max_tiles,
               perm is not work, path)
        r = _plan.cached(key, lambda: _apply_recipe(x, lora_a, lora_b, info, slice_offsets, path))
        ranks = info.lora_ranks
        if r.mode == "tall":
            _run_tall(r, x, base_out, lora_a, lora_b, info, work, perm)
            return
        ws = _workspace(r.ws, x.device)
        if r.mode == "fused":
            r.steps[0](x, lora_a, lora_b, base_out, ws, _sync_counters(info.max_tiles, x.device), work, ranks,
                       info.scalings, perm)
            return
        r.steps[0](x, lora_a, ws, work, ranks, perm)
        if r.mode == "reduce":
            v = torch.empty(r.v, dtype=torch.float32, device=x.device)
            r.steps[1](ws, v, work, ranks, perm)
            r.steps[2](v, lora_b, base_out, work, ranks, info.scalings, perm)
        else:
            r.steps[1](ws, lora_b, base_out, work, ranks, info.scalings, perm)


def _shrink_recipe(x, lora_a, info, num_slices, out_dtype) -> _Recipe:
    NR, dev, mt = lora_a.shape[1], x.device, info.max_tiles
    R = NR // num_slices
    p = _plan.shrink_plan(x.shape[1], num_slices, R, x.dtype, info.permutation is not None, dev)
    if _plan.apply_path(x.shape[0], R, NR, mt)[0] == "tall":
        # As apply_lora's tall path (prefill): the K splits summed in registers in split order, the reduce's sums (the
        # same bits), in one launch with no fp32 partials. Only its shrink is used: the slices' widths do not matter.
        tall = _tall_steps(p, x.shape, NR, R, tuple(range(num_slices + 1)), x.dtype, out_dtype, mt)
        return _Recipe("direct", tall[:1], None, None)
    if p.split == 1:
        return _Recipe("direct", (_shrink_step(p, x.shape, NR, R, mt, False, out_dtype, dev),), None, None)
    return _Recipe("reduce", (_shrink_step(p, x.shape, NR, R, mt, True, torch.float32, dev),
                              _reduce_step(p, x.shape[0], R, NR, mt, out_dtype, dev)),
                   (p.split, x.shape[0], NR), None)


BACKEND = TritonBackend()
