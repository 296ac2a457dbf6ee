"""Backend registry: loads the CUDA extension and the Triton kernels once and remembers what failed.

Each backend is an object with sgmv_shrink(x, lora_a, info, num_slices, out),
sgmv_expand(v, lora_b, info, slice_offsets, out) and apply_lora(x, base_out, lora_a, lora_b, info,
slice_offsets), called by ops.py after validation.
"""

from __future__ import annotations

import os
import types

import torch

from lora_kernels import reference

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

try:
    from lora_kernels import _C  # noqa: F401  (loading it registers torch.ops.lora_kernels.*)

    HAS_CUDA_EXT = True
    CUDA_EXT_ERROR = ""
except ImportError as e:  # not built (no nvcc / LORA_KERNELS_BUILD_CUDA=0) or built for another torch
    HAS_CUDA_EXT = False
    CUDA_EXT_ERROR = str(e)

TRITON_ERROR = ""
_triton_ops = None


def triton_ops():
    """The Triton backend module, imported on first use; None if Triton cannot be imported."""
    global _triton_ops, TRITON_ERROR
    if _triton_ops is None and not TRITON_ERROR:
        try:
            from lora_kernels import triton as mod

            _triton_ops = mod
        except ImportError as e:
            TRITON_ERROR = str(e) or repr(e)
    return _triton_ops


def _torch_apply(x, base_out, lora_a, lora_b, info, slice_offsets, shrink, expand):
    v = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    shrink(x, lora_a, info, len(slice_offsets) - 1, v)
    expand(v, lora_b, info, slice_offsets, base_out)


def _ref_shrink(x, lora_a, info, num_slices, out):
    reference.sgmv_shrink(x, lora_a, info.seg_indptr, info.weight_indices, info.lora_ranks, info.permutation,
                          num_slices, out)


def _ref_expand(v, lora_b, info, slice_offsets, out):
    reference.sgmv_expand(v, lora_b, info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                          info.permutation, slice_offsets, out)


def _cuda_shrink(x, lora_a, info, num_slices, out):
    torch.ops.lora_kernels.sgmv_shrink.default(x, lora_a, info.seg_indptr, info.weight_indices, info.lora_ranks,
                                               info.permutation, num_slices, info.max_seg_len, out)


def _cuda_expand(v, lora_b, info, slice_offsets, out):
    torch.ops.lora_kernels.sgmv_expand.default(v, lora_b, info.seg_indptr, info.weight_indices, info.lora_ranks,
                                               info.scalings, info.permutation, list(slice_offsets),
                                               info.max_seg_len, out)


def _cuda_apply(x, base_out, lora_a, lora_b, info, slice_offsets):
    torch.ops.lora_kernels.sgmv_apply.default(x, lora_a, lora_b, info.seg_indptr, info.weight_indices,
                                              info.lora_ranks, info.scalings, info.permutation, list(slice_offsets),
                                              info.max_seg_len, base_out)


def _two_step(shrink, expand):
    return types.SimpleNamespace(
        sgmv_shrink=shrink,
        sgmv_expand=expand,
        apply_lora=lambda x, base_out, a, b, info, offs: _torch_apply(x, base_out, a, b, info, offs, shrink, expand),
    )


TORCH = _two_step(_ref_shrink, _ref_expand)
CUDA = types.SimpleNamespace(sgmv_shrink=_cuda_shrink, sgmv_expand=_cuda_expand, apply_lora=_cuda_apply)


def get(name: str):
    if name == "torch":
        return TORCH
    if name == "cuda":
        return CUDA
    return triton_ops()


# Regime table measured by bench/bench_kernels.py (H200, 2026-11-22, Llama-3-8B shapes, bf16, graph replay;
# bench/RESULTS.md): the cuda backend beat Triton only on one-segment batches of 16-256 rows (0.55-0.89x of
# Triton's per-layer time); on decode batches of distinct or uniform adapters and on prefill it took
# 1.1-3.2x Triton's time.
CUDA_MIN_ROWS_ONE_SEGMENT = 16


def auto_backend(device: torch.device, info=None) -> str:
    if device.type != "cuda":
        return "torch"
    if triton_ops() is None:
        return "cuda" if HAS_CUDA_EXT else "torch"
    if HAS_CUDA_EXT and info is not None and info.num_segments == 1 and info.num_tokens >= CUDA_MIN_ROWS_ONE_SEGMENT:
        return "cuda"
    return "triton"
