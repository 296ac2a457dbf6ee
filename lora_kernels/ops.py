"""Public SGMV ops (DESIGN.md §5): argument validation and the wrappers that hand over to a backend.

Backends live in lora_kernels/backends/ ("cuda", "triton", "torch"). The default comes from
LORA_KERNELS_BACKEND (else "auto": on CUDA inputs, the backend the generated table measured fastest for
the batch's regime, see backends/auto.py; on the CPU, torch). An explicitly requested backend that
cannot run raises; "auto" never does.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from lora_kernels import backends
from lora_kernels.backends import auto
from lora_kernels.batch_info import LoRABatchInfo
from lora_kernels.limits import DTYPES as _DTYPES, MAX_RANK, MAX_SLICES

BACKENDS = ("auto", *backends.NAMES)


def resolve_backend(backend: str | None, device: torch.device, info: LoRABatchInfo | None = None) -> str:
    """The backend that will run for inputs on `device` (and batch `info`); raises if an explicit choice cannot."""
    name = backend or os.environ.get("LORA_KERNELS_BACKEND") or "auto"
    if name == "auto":
        return auto.choose(device, info)
    if (name, device) in _runnable:
        return name
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    err = backends.unavailable(name, device)
    if err is not None:
        raise type(err)(f"backend={name!r} {err}")
    _runnable.add((name, device))
    return name


_runnable: set = set()  # (backend, device) pairs found available: availability does not change in a process


def _check_tensor(name: str, t, dim: int, shape_doc: str, dtype=None, device=None, contiguous=True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {shape_doc}, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype} (shape {tuple(t.shape)})")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def _check_info(info: LoRABatchInfo, device: torch.device, num_slots: int, rows: int) -> None:
    """Checks info against the weights and x. Its tensors' layout is checked once per (device, slots) and
    remembered on the info (infos are not modified after they are built); the row count on every call."""
    if not isinstance(info, LoRABatchInfo):
        raise TypeError(f"info must be a LoRABatchInfo, got {type(info).__name__}")
    if info._checked != (device, num_slots):
        _check_info_tensors(info, device, num_slots)
        info._checked = (device, num_slots)
    if info.num_tokens > rows:
        raise ValueError(f"info.num_tokens={info.num_tokens} exceeds the {rows} rows of x")


def _check_info_tensors(info: LoRABatchInfo, device: torch.device, num_slots: int) -> None:
    for name in ("seg_indptr", "weight_indices", "lora_ranks"):
        _check_tensor(f"info.{name}", getattr(info, name), 1, "", torch.int32, device)
    _check_tensor("info.scalings", info.scalings, 1, "", torch.float32, device)
    cap = info.weight_indices.shape[0]
    if info.seg_indptr.shape[0] != cap + 1:
        raise ValueError(f"info.seg_indptr must have {cap + 1} entries, got {info.seg_indptr.shape[0]}")
    if info.lora_ranks.shape[0] != num_slots or info.scalings.shape[0] != num_slots:
        raise ValueError(f"info.lora_ranks/scalings have {info.lora_ranks.shape[0]}/{info.scalings.shape[0]} "
                         f"slots but the weights have {num_slots}")
    if info.permutation is not None:
        _check_tensor("info.permutation", info.permutation, 1, "", torch.int32, device)
    if info.work is not None:
        _check_tensor("info.work", info.work, 1, "", torch.int32, device)
        if info.work.shape[0] != 1 + 3 * info.max_tiles:
            raise ValueError(f"info.work must have 1 + 3 * max_tiles = {1 + 3 * info.max_tiles} entries, got "
                             f"{info.work.shape[0]}")


def _check_shrink(x, lora_a, info, num_slices, out, with_info=True):
    _check_tensor("x", x, 2, "[T, in_dim]", _DTYPES)
    _check_tensor("lora_a", lora_a, 3, "[num_slots, S*R, in_dim]", x.dtype, x.device)
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"num_slices must be in 1..{MAX_SLICES}, got {num_slices}")
    if lora_a.shape[1] % num_slices:
        raise ValueError(f"lora_a.shape[1]={lora_a.shape[1]} is not a multiple of num_slices={num_slices}")
    if lora_a.shape[1] // num_slices > MAX_RANK:
        raise ValueError(f"max rank R={lora_a.shape[1] // num_slices} exceeds {MAX_RANK}")
    if lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"lora_a in_dim {lora_a.shape[2]} != x in_dim {x.shape[1]} "
                         f"(lora_a {tuple(lora_a.shape)}, x {tuple(x.shape)})")
    if with_info:
        _check_info(info, x.device, lora_a.shape[0], x.shape[0])
    if out is not None:
        _check_tensor("out", out, 2, "[T, S*R]", (torch.float32, x.dtype), x.device)
        if tuple(out.shape) != (x.shape[0], lora_a.shape[1]):
            raise ValueError(f"out must have shape {(x.shape[0], lora_a.shape[1])}, got {tuple(out.shape)}")


def _check_expand(v, lora_b, info, slice_offsets, out, with_info=True):
    """Checks expand's arguments; v=None checks everything but v (apply_lora makes its own)."""
    _check_tensor("out", out, 2, "[T, out_total]", _DTYPES)
    _check_tensor("lora_b", lora_b, 3, "[num_slots, out_total, R]", out.dtype, out.device)
    n = len(slice_offsets) - 1
    if not 1 <= n <= MAX_SLICES:
        raise ValueError(f"slice_offsets must have 2..{MAX_SLICES + 1} entries, got {list(slice_offsets)}")
    if slice_offsets[0] != 0 or slice_offsets[-1] != out.shape[1] or any(
            a > b for a, b in zip(slice_offsets, slice_offsets[1:])):
        raise ValueError(f"slice_offsets must rise from 0 to out_total={out.shape[1]}, got {list(slice_offsets)}")
    if lora_b.shape[1] != out.shape[1]:
        raise ValueError(f"lora_b out_total {lora_b.shape[1]} != out columns {out.shape[1]}")
    if lora_b.shape[2] > MAX_RANK:
        raise ValueError(f"lora_b max rank R={lora_b.shape[2]} exceeds {MAX_RANK}")
    if v is not None:
        _check_tensor("v", v, 2, "[T, S*R]", (torch.float32, out.dtype), out.device)
        if tuple(v.shape) != (out.shape[0], n * lora_b.shape[2]):
            raise ValueError(f"v must have shape {(out.shape[0], n * lora_b.shape[2])}, got {tuple(v.shape)}")
    if with_info:
        _check_info(info, out.device, lora_b.shape[0], out.shape[0])


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, info: LoRABatchInfo, num_slices: int,
                out: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Segmented shrink: ``v[t, i*R + j] = Σ_k x[t, k] · lora_a[slot, i*R + j, k]`` for j < rank(slot).

    x: [T, in_dim] fp16/bf16/fp32; lora_a: [num_slots, S*R, in_dim], x's dtype; out: [T, S*R] fp32 or
    x's dtype (a zeroed fp32 tensor when None). Columns j ≥ rank and rows of slot -1 segments are
    written as 0; rows outside every segment are left untouched. Returns out.
    """
    _check_shrink(x, lora_a, info, num_slices, out)
    name = resolve_backend(backend, x.device, info)
    if out is None:
        out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    backends.get(name).sgmv_shrink(x, lora_a, info, num_slices, out)
    return out


def sgmv_expand(v: torch.Tensor, lora_b: torch.Tensor, info: LoRABatchInfo, slice_offsets: Sequence[int],
                out: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """Segmented expand, in place: ``out[t, off[i]+n] += scaling · Σ_{j<rank} v[t, i*R+j] · lora_b[slot, off[i]+n, j]``.

    v: [T, S*R] fp32 or out's dtype; lora_b: [num_slots, out_total, R]; out: [T, out_total]
    fp16/bf16/fp32; slice_offsets: host ints (0, …, out_total). Rows of slot -1 / rank-0 segments and
    rows outside every segment are left exactly as they were. Returns out.
    """
    slice_offsets = tuple(slice_offsets)
    _check_expand(v, lora_b, info, slice_offsets, out)
    name = resolve_backend(backend, out.device, info)
    backends.get(name).sgmv_expand(v, lora_b, info, slice_offsets, out)
    return out


def apply_lora(x: torch.Tensor, base_out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               info: LoRABatchInfo, slice_offsets: Sequence[int], backend: str | None = None) -> torch.Tensor:
    """``base_out[t] += scaling · (x[t] A_slotᵀ) B_slotᵀ`` per slice, in place; shrink then expand (or fused).

    x: [T, in_dim]; base_out: [T, out_total]; lora_a/lora_b as in `sgmv_shrink`/`sgmv_expand`.
    Returns base_out.
    """
    slice_offsets = tuple(slice_offsets)
    sig = _signature(x, base_out, lora_a, lora_b, slice_offsets)
    if sig is None or sig not in _validated:
        _check_apply(x, base_out, lora_a, lora_b, info, slice_offsets)
        if sig is not None:
            if len(_validated) >= _VALIDATED_MAX:
                _validated.clear()
            _validated.add(sig)
    _check_info(info, x.device, lora_a.shape[0], x.shape[0])
    name = resolve_backend(backend, x.device, info)
    backends.get(name).apply_lora(x, base_out, lora_a, lora_b, info, slice_offsets)
    return base_out


# Argument signatures apply_lora has validated: an engine calls it with a few shapes per layer, and the
# checks of shapes, dtypes, devices and contiguity (all fixed by the signature) cost ~10 µs of host time.
_validated: set = set()
_VALIDATED_MAX = 4096


def _signature(x, base_out, lora_a, lora_b, slice_offsets) -> tuple | None:
    """Everything the tensor checks read: shape, strides (contiguity), dtype and device of each tensor (one flat
    tuple: ~0.4 µs less per call than a tuple per tensor)."""
    try:
        return (slice_offsets, x.shape, x.stride(), x.dtype, x.device, base_out.shape, base_out.stride(),
                base_out.dtype, base_out.device, lora_a.shape, lora_a.stride(), lora_a.dtype, lora_a.device,
                lora_b.shape, lora_b.stride(), lora_b.dtype, lora_b.device)
    except (AttributeError, TypeError):  # not tensors: the full checks say which argument
        return None


def _check_apply(x, base_out, lora_a, lora_b, info, slice_offsets) -> None:
    num_slices = len(slice_offsets) - 1
    _check_shrink(x, lora_a, info, num_slices, None, with_info=False)
    _check_expand(None, lora_b, info, slice_offsets, base_out, with_info=False)
    if base_out.shape[0] != x.shape[0] or base_out.dtype != x.dtype or base_out.device != x.device:
        raise ValueError(f"base_out must be [{x.shape[0]}, out_total] {x.dtype} on {x.device}, got "
                         f"{tuple(base_out.shape)} {base_out.dtype} on {base_out.device}")
    if lora_b.shape[2] * num_slices != lora_a.shape[1]:
        raise ValueError(f"lora_a has {lora_a.shape[1]} rows but num_slices*R = {num_slices}*{lora_b.shape[2]}")
    if lora_b.shape[0] != lora_a.shape[0]:
        raise ValueError(f"lora_a has {lora_a.shape[0]} slots but lora_b has {lora_b.shape[0]}")
