"""A LoRA-targeted linear layer as one op: ``y = x Wᵀ (+ bias)`` plus the multi-LoRA delta, overlapped.

Semantics (DESIGN.md §5, `apply_lora`): for every row t in a segment of slot a (rank r > 0),

    y[t] = x[t] Wᵀ + bias + scaling[a] · Σ_i (x[t] A_a,iᵀ) B_a,iᵀ           (slice i of the slot's weights)

and rows of slot -1 / rank-0 segments (or outside every segment) get the base alone. `lora_linear` runs the
base GEMM itself (cuBLAS through torch); `lora_linear_with` takes the engine's own base as a callable
(quantized or custom layers). Both validate like `apply_lora`, never read device data back and can be
captured in a CUDA graph.

Modes (``mode=``, default "auto"):

* ``serial``   base, then `apply_lora` on the current stream (the plain composition); on the cuda backend
               with no ``out`` given, both in one host call (the extension's ``sgmv_linear``, the same bits).
* ``overlap``  the shrink ``v = x Aᵀ`` (fp32) runs on a side stream while the base runs on the current
               stream; the current stream then waits for it and runs the expand into y in place. The
               expand must follow the base: it adds into the base's output.
* ``delta``    shrink and expand both run on the side stream, into a separate delta of y's dtype,
               while the base runs; afterwards one elementwise ``y += delta``. Rounds the delta to y's
               dtype before the add (one more rounding than `apply_lora`).
* ``fused``    the shrink, then one Triton GEMM whose epilogue adds the expand (`fused_gemm.py`): out is
               written once, never re-read. `lora_linear` only, for batches without a permutation on CUDA
               (or under TRITON_INTERPRET=1); otherwise, and for `lora_linear_with`, it runs ``overlap``.
* ``first``    the LoRA delta first, written into out (the Triton tall-tile path with its expand storing, not
               adding: out is written once and never read), then the base GEMM accumulates onto it
               (``addmm`` with beta 1: cuBLAS reads out in its epilogue). At prefill the expand then writes
               out once instead of reading and writing it, but beta 1 costs the GEMM about as much (H200,
               Llama-3-8B layer: -178 µs of LoRA, +150 µs of GEMM at r16), so ``auto`` picks it only where it
               measured faster. Rounds the delta to y's dtype before the add, like ``delta``.
               `lora_linear` only, without bias, where info covers every row of x and the tall path runs
               (enough rows, Triton); otherwise it runs ``serial`` (the better of the others at prefill). On
               the CPU: out zeroed, `apply_lora`, then the ``addmm`` (the same composition). Rows without
               LoRA get ``addmm`` onto zeros, which cuBLAS may compute with another kernel than a plain mm:
               equal to the base up to rounding, not always bit for bit.
* ``gemv``     decode batches (1..16 rows of x): the base GEMM, the shrink and the expand in one launch of the
               extension (`_gemv.py`, csrc/kernels/lora_gemv.cuh): the weight is streamed once with the LoRA inside,
               y is written once. Adds the delta to the base's fp32 sum before rounding (one rounding less than
               ``serial``). `lora_linear` only, with the backend "cuda" or unnamed, fp16/bf16, in_dim a multiple
               of 256, pool rank a multiple of 8 up to 64; otherwise it runs ``delta``.
* ``auto``     the mode measured fastest for the batch's regime on this machine (`_linear_table.py`,
               written by ``bench/bench_layer.py --write-table``); on the CPU, ``serial``.

Batch invariance: the LoRA part of a row is bitwise the same whatever else is in the batch, in every mode
(the SGMV ops' promise; the fused GEMM's tile shapes depend on (N, K, dtype, rank bucket) only). The base
part is cuBLAS's: for a fixed row count a row's result does not depend on the other rows, but cuBLAS may
pick another kernel for another row count; `lora_linear_with` with a batch-invariant base is invariant
across sizes. Modes round differently (``delta`` and ``fused`` round once more / once less than
``serial``), so invariance across sizes also needs one mode: pin ``mode=`` where that matters.

On the CPU there is no side stream: ``overlap`` and ``delta`` run the same arithmetic in program order
(so the CPU tests cover every mode's composition).

Streams and memory. One high-priority side stream and two events per device are created once and reused
(no per-call stream or event creation). The fork records an event on the current stream that the side
stream waits on; the join records one on the side stream that the current stream waits on before it
touches what the side stream wrote. Under CUDA-graph capture this puts the side stream into the
capture and the captured graph holds the fork and the join as edges. Every buffer the side stream
writes (v, delta) is allocated on the current stream before the fork, and the current stream waits for
the join before the call returns, so everything the side stream touched (the caller's x, weights,
metadata and our buffers) is done with, in stream order, before any later work on the current stream
can reuse its memory: no `record_stream` is needed, and the caching allocator's per-stream reuse stays
correct. Internal temporaries a backend allocates while the side stream is current are allocated and
freed on that stream. The side stream is shared by all callers on a device: calls from several host
threads at once on one device are ordered correctly but serialise their LoRA work.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from lora_kernels._linear_table import TABLE
from lora_kernels.batch_info import LoRABatchInfo
from lora_kernels.ops import (_check_expand, _check_shrink, _check_tensor, apply_lora, resolve_backend, sgmv_expand,
                              sgmv_shrink)

__all__ = ["MODES", "lora_linear", "lora_linear_with", "pick_mode"]

MODES = ("auto", "serial", "overlap", "delta", "fused", "first", "gemv")


class _Side:
    """The per-device side stream and its fork/join events (created once, reused by every call)."""

    __slots__ = ("stream", "fork", "join")

    def __init__(self, index: int):
        with torch.cuda.device(index):
            # High priority: the LoRA branch is short and the expand waits on it, so its blocks should be
            # scheduled as soon as the base GEMM leaves an SM free.
            self.stream = torch.cuda.Stream(priority=-1)
        self.fork = torch.cuda.Event()
        self.join = torch.cuda.Event()


_SIDES: dict[int, _Side] = {}


def _side(device: torch.device) -> _Side:
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _SIDES.get(index)
    if side is None:
        side = _SIDES[index] = _Side(index)
    return side


def pick_mode(rows: int, max_rank: int, device: torch.device) -> str:
    """The mode "auto" runs for `rows` rows of x at pool rank `max_rank` on `device`."""
    if device.type != "cuda":
        return "serial"
    for rank_le, rows_le, mode in TABLE:
        if max_rank <= rank_le and rows <= rows_le:
            return mode
    return TABLE[-1][2]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _check_no_alias(name: str, out: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """out must not share memory with an input that the base or LoRA reads while out is written."""
    if other is None or out.device != other.device:
        return
    (a0, a1), (b0, b1) = _extent(out), _extent(other)
    if a0 < b1 and b0 < a1:
        raise ValueError(f"{name} {tuple(out.shape)} {out.dtype} overlaps {other_name} {tuple(other.shape)} "
                         f"in memory; pass a separate output tensor")


def _check_lora(x, lora_a, lora_b, info, slice_offsets) -> int:
    """Checks x, lora_a, info (as `sgmv_shrink`) and the rank agreement of lora_a/lora_b; returns S."""
    num_slices = len(slice_offsets) - 1
    _check_shrink(x, lora_a, info, num_slices, None)
    if not isinstance(lora_b, torch.Tensor) or lora_b.dim() != 3:
        _check_tensor("lora_b", lora_b, 3, "[num_slots, out_total, R]")
    if lora_b.shape[2] * num_slices != lora_a.shape[1]:
        raise ValueError(f"lora_a has {lora_a.shape[1]} rows but num_slices*R = {num_slices}*{lora_b.shape[2]} "
                         f"(lora_a {tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)})")
    return num_slices


def _check_y(y, x, lora_b, info, slice_offsets, name: str) -> None:
    """Checks the output y (LoRA is added into it in place) as `apply_lora` checks base_out."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != x.shape[0] or y.dtype != x.dtype \
            or y.device != x.device:
        got = f"{tuple(y.shape)} {y.dtype} on {y.device}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise ValueError(f"{name} must be [{x.shape[0]}, out_total] {x.dtype} on {x.device}, got {got}")
    _check_expand(None, lora_b, info, slice_offsets, y)
    _check_no_alias(name, y, "x", x)


def _check_linear(x, weight, bias, out) -> torch.Tensor:
    """The base layer's own arguments (x was checked by `_check_lora`); returns out (allocated if None)."""
    _check_tensor("weight", weight, 2, "[out_total, in_dim]", x.dtype, x.device, contiguous=False)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must have shape [out_total, {x.shape[1]}] (x's in_dim), got {tuple(weight.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, 1, "[out_total]", x.dtype, x.device, contiguous=False)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must have shape ({weight.shape[0]},) (weight's out_total), got {tuple(bias.shape)}")
    if out is None:
        return torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _check_tensor("out", out, 2, "[T, out_total]", x.dtype, x.device)
    if tuple(out.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"out must have shape {(x.shape[0], weight.shape[0])} ([T, weight's out_total]), "
                         f"got {tuple(out.shape)}")
    _check_no_alias("out", out, "weight", weight)
    if bias is not None:
        _check_no_alias("out", out, "bias", bias)
    return out


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                info: LoRABatchInfo, slice_offsets: Sequence[int], *, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, backend: str | None = None, mode: str | None = None) -> torch.Tensor:
    """``y = x Wᵀ (+ bias) + scaling · (x A_slotᵀ) B_slotᵀ`` per row (see the module docstring).

    x: [T, in_dim] fp16/bf16/fp32, contiguous; weight: [out_total, in_dim] (a torch Linear's weight);
    bias: [out_total] or None; lora_a: [num_slots, S*R, in_dim]; lora_b: [num_slots, out_total, R];
    slice_offsets: host ints (0, …, out_total); out: [T, out_total] contiguous, not overlapping x
    (allocated when None). All of x's dtype and device. backend: the SGMV backend (as `apply_lora`);
    mode: one of MODES (module docstring). Returns y (= out when given).
    """
    slice_offsets = tuple(slice_offsets)
    _check_lora(x, lora_a, lora_b, info, slice_offsets)
    fresh = out is None
    out = _check_linear(x, weight, bias, out)
    if weight.shape[0] != slice_offsets[-1]:
        raise ValueError(f"weight has {weight.shape[0]} output rows (shape {tuple(weight.shape)}) but slice_offsets "
                         f"end at out_total={slice_offsets[-1]}")
    _check_y(out, x, lora_b, info, slice_offsets, "out")  # slice_offsets and lora_b against weight's out_total
    mode = _resolve_mode(mode, x, lora_b)
    if mode == "gemv":
        from lora_kernels import _gemv

        if _gemv.backend_allows(backend) and _gemv.run(x, weight, bias, lora_a, lora_b, info, slice_offsets, out):
            return out
        mode = "delta"
    if mode == "fused":
        fused = _fused_gemm()
        if fused is not None and fused.supports(x, weight, info, slice_offsets):
            v = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
            sgmv_shrink(x, lora_a, info, len(slice_offsets) - 1, out=v, backend=backend)
            return fused.gemm_lora(x, weight, bias, v, lora_b, info, slice_offsets, out)
        mode = "overlap"
    if mode == "first":
        if bias is None and info.num_tokens == x.shape[0] and _delta_first(x, out, lora_a, lora_b, info,
                                                                          slice_offsets, backend):
            return torch.addmm(out, x, weight.t(), out=out)
        mode = "serial"
    if mode == "serial" and fresh and x.is_cuda and resolve_backend(backend, x.device, info) == "cuda":
        from lora_kernels.backends.cuda import BACKEND as CUDA

        return CUDA.linear(x, weight, bias, lora_a, lora_b, info, slice_offsets)  # GEMM and LoRA: one host call
    if bias is None:
        def base():
            return torch.mm(x, weight.t(), out=out)
    else:
        def base():
            return torch.addmm(bias, x, weight.t(), out=out)
    return _run(base, x, lora_a, lora_b, info, slice_offsets, backend, mode, checked_out=True)


def lora_linear_with(base: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, lora_a: torch.Tensor,
                     lora_b: torch.Tensor, info: LoRABatchInfo, slice_offsets: Sequence[int], *,
                     backend: str | None = None, mode: str | None = None) -> torch.Tensor:
    """`lora_linear` with the engine's own base layer: ``y = base(x)`` plus the LoRA delta, added into y.

    base(x) must return a fresh [T, out_total] tensor of x's dtype on x's device, contiguous (the output
    of a quantized or custom GEMM), and must enqueue its work on the current stream (it runs while the
    LoRA shrink runs on the side stream). Returns that tensor, with the delta added in place.
    """
    if not callable(base):
        raise TypeError(f"base must be callable (x -> [T, out_total] tensor), got {type(base).__name__}")
    slice_offsets = tuple(slice_offsets)
    _check_lora(x, lora_a, lora_b, info, slice_offsets)
    return _run(lambda: base(x), x, lora_a, lora_b, info, slice_offsets, backend, mode, checked_out=False)


def _resolve_mode(mode, x, lora_b) -> str:
    mode = mode or "auto"
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return pick_mode(x.shape[0], lora_b.shape[2], x.device) if mode == "auto" else mode


def _delta_first(x, out, lora_a, lora_b, info, slice_offsets, backend) -> bool:
    """Writes the LoRA delta of every row into out ("first" mode); False where that path does not run here."""
    if resolve_backend(backend, x.device, info) == "triton":
        from lora_kernels.backends.triton import BACKEND

        return BACKEND.lora_delta(x, out, lora_a, lora_b, info, slice_offsets)
    if x.device.type == "cuda":
        return False
    out.zero_()
    apply_lora(x, out, lora_a, lora_b, info, slice_offsets, backend=backend)
    return True


def _fused_gemm():
    """The fused GEMM module, or None where Triton cannot be imported."""
    try:
        from lora_kernels import fused_gemm
    except ImportError:
        return None
    return fused_gemm


def _run(base, x, lora_a, lora_b, info, slice_offsets, backend, mode, checked_out):
    """Runs base() and adds the LoRA delta in the chosen mode; y is validated before any LoRA write."""
    mode = _resolve_mode(mode, x, lora_b)
    if mode == "fused":  # lora_linear took it where it can run; what reaches here runs overlapped
        mode = "overlap"
    elif mode == "gemv":  # likewise (lora_linear_with's base is the engine's own: it cannot be fused into)
        mode = "delta"
    elif mode == "first":  # likewise (and lora_linear_with's base returns a fresh tensor: nothing to add onto)
        mode = "serial"
    if mode == "serial":
        y = base()
        if not checked_out:
            _check_y(y, x, lora_b, info, slice_offsets, "base(x)")
        return apply_lora(x, y, lora_a, lora_b, info, slice_offsets, backend=backend)
    num_slices = len(slice_offsets) - 1
    v = torch.empty(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    delta = None
    if mode == "delta":
        delta = torch.empty(x.shape[0], slice_offsets[-1], dtype=x.dtype, device=x.device)
    cuda = x.device.type == "cuda"
    side = _side(x.device) if cuda else None
    cur = torch.cuda.current_stream(x.device) if cuda else None
    if cuda:
        side.fork.record(cur)
        side.stream.wait_event(side.fork)
        torch.cuda.set_stream(side.stream)
    try:
        sgmv_shrink(x, lora_a, info, num_slices, out=v, backend=backend)
        if delta is not None:
            delta.zero_()
            sgmv_expand(v, lora_b, info, slice_offsets, delta, backend=backend)
    except BaseException:
        if cuda:  # join before v is freed: its memory returns to the current stream's pool
            side.join.record(side.stream)
            torch.cuda.set_stream(cur)
            cur.wait_event(side.join)
        raise
    if cuda:
        side.join.record(side.stream)
        torch.cuda.set_stream(cur)
    try:
        y = base()
    finally:
        if cuda:  # joined even if the base raises: nothing after this call may run beside the side work
            cur.wait_event(side.join)
    if not checked_out:
        _check_y(y, x, lora_b, info, slice_offsets, "base(x)")
    if delta is None:
        return sgmv_expand(v, lora_b, info, slice_offsets, y, backend=backend)
    return y.add_(delta)
