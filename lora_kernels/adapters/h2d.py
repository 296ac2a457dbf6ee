"""`batched_h2d_copy(srcs, dsts, stream)`: many pinned-host -> device copies in one call on `stream`.

Semantics: ``dsts[i].copy_(srcs[i])`` byte for byte (equal byte sizes, any dtypes), all enqueued on
`stream` (default: the current stream), completion marked by whatever the caller records after it.
The sources must stay alive and unchanged until the copies complete; the caller keeps them.

Backends: the C++ op `torch.ops.lora_kernels.batched_h2d_copy` (cudaMemcpyBatchAsync on CUDA >= 13,
else a cudaMemcpyAsync loop; it validates pinned / contiguous / sizes / devices) when the extension is
built; else a pure-torch loop of ``copy_(non_blocking=True)`` with the same checks. CPU destinations
(the CPU pool of tests and the CPU serve-sim) are copied synchronously.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lora_kernels.backends import cuda as _backends


def _check(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], need_pinned: bool) -> None:
    if len(srcs) != len(dsts):
        raise ValueError(f"srcs has {len(srcs)} tensors but dsts has {len(dsts)}")
    device = dsts[0].device if dsts else None
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s.device.type != "cpu" or (need_pinned and not s.is_pinned()):
            raise ValueError(f"srcs[{i}] must be {'pinned ' if need_pinned else ''}host memory, got {s.device}"
                             f"{'' if s.is_pinned() else ' (not pinned)'} shape {tuple(s.shape)} {s.dtype}")
        if d.device != device:
            raise ValueError(f"dsts[{i}] is on {d.device} but dsts[0] is on {device}")
        if not (s.is_contiguous() and d.is_contiguous()):
            raise ValueError(f"srcs[{i}] and dsts[{i}] must be contiguous, got strides {s.stride()} and {d.stride()}")
        sb, db = s.numel() * s.element_size(), d.numel() * d.element_size()
        if sb != db:
            raise ValueError(f"srcs[{i}] has {sb} bytes ({tuple(s.shape)} {s.dtype}) but dsts[{i}] has {db} "
                             f"({tuple(d.shape)} {d.dtype})")


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def batched_h2d_copy(srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor],
                     stream: torch.cuda.Stream | None = None, backend: str = "auto", check: bool = True) -> None:
    """Copies each pinned host tensor srcs[i] into device tensor dsts[i] (same byte size) on `stream`.

    backend: "auto" (the C++ op when built, else torch), "cuda" (the C++ op; raises if not built) or
    "torch" (the fallback loop). CPU dsts are copied synchronously whatever the backend.
    check: validate here (ValueError naming the argument) before any copy; the loader, whose lists
    come from a validated pool and store, passes False to keep ~1 µs per tensor off its host path
    (the C++ op checks again).
    """
    if backend not in ("auto", "cuda", "torch"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'torch', got {backend!r}")
    if not dsts and not srcs:
        return
    if dsts and dsts[0].device.type == "cpu":
        _check(srcs, dsts, need_pinned=False)
        for s, d in zip(srcs, dsts):
            _as_bytes(d).copy_(_as_bytes(s))
        return
    if backend == "cuda" and not _backends.HAS_CUDA_EXT:
        raise RuntimeError(f"backend='cuda' requested but the CUDA extension is not available: "
                           f"{_backends.CUDA_EXT_ERROR}")
    use_ext = backend == "cuda" or (backend == "auto" and _backends.HAS_CUDA_EXT)
    if check or not use_ext:
        _check(srcs, dsts, need_pinned=True)
    with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(dsts[0].device)):
        if use_ext:
            torch.ops.lora_kernels.batched_h2d_copy.default(list(srcs), list(dsts))
        else:
            for s, d in zip(srcs, dsts):
                _as_bytes(d).copy_(_as_bytes(s), non_blocking=True)
