"""The gated MLP of a patched decoder layer over the stacked gate_up output (Llama, Qwen2, Mistral: SiLU).

The integration runs gate_proj and up_proj as one GEMM into [.., gate | up]; the model's own MLP forward then
computes `act_fn(gate) * up` on two column slices of it. Those are strided views, and torch's elementwise kernels
take their slow non-vectorized path on them: on the H200 the integration with no adapter row spent ~1.5-2 ms more
than the base model in such ops at the 1B prefill (bench/RESULTS.md, sixth session). Here one pass reads both
halves row by row and writes `silu(gate) * up` contiguous: what the model computes (silu rounded to the model's
dtype, then the product rounded), in fewer bytes than the base model's two ops.

Batches of fewer than `MIN_ELEMS` products (decode steps) keep torch's two ops: a Triton launch costs more host
time than it saves there, and eager decode steps are host-bound. The kernel is opt-in
(`LORA_KERNELS_HF_MLP_KERNEL=1`, read at each call) until a GPU run of bench/bench_hf.py measures it; without it
the patched MLP runs torch's two ops on the stacked output's halves, as the model's own forward would.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch; the torch path stays
    triton = None

MIN_ELEMS = 1 << 20  # products per call from which the one-pass kernel runs (CUDA tensors only)
_BLOCK = 1024

if triton is not None:
    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr):
        """out[r, j] = round(round(silu(gate[r, j])) * up[r, j]), gate = gu[r, :inter], up = gu[r, inter:]."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        src = gu_ptr + row * (2 * inter) + cols
        g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        s = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dtype).to(tl.float32)  # act_fn(gate), rounded as torch returns it
        tl.store(out_ptr + row * inter + cols, (s * u).to(dtype), mask=mask)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gu[..., :I]) * gu[..., I:] for gu [..., 2I]: [..., I] (contiguous on the kernel's path)."""
    inter = gu.shape[-1] // 2
    if triton is None or not gu.is_cuda or not gu.is_contiguous() or gu.numel() // 2 < MIN_ELEMS or \
            os.environ.get("LORA_KERNELS_HF_MLP_KERNEL", "0") != "1":
        return F.silu(gu[..., :inter]) * gu[..., inter:]
    return silu_mul_kernel(gu)


def silu_mul_kernel(gu: torch.Tensor) -> torch.Tensor:
    """The one-pass kernel on a contiguous gu (CUDA, or CPU under TRITON_INTERPRET=1 for the tests)."""
    inter = gu.shape[-1] // 2
    rows = gu.numel() // max(2 * inter, 1)
    out = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype, device=gu.device)
    if rows and inter:
        _silu_mul_kernel[(rows, triton.cdiv(inter, _BLOCK))](gu, out, inter, BLOCK=_BLOCK)
    return out


def silu_gated(mlp) -> bool:
    """Whether mlp's act_fn is SiLU (transformers' "silu": Llama, Qwen2, Mistral), the gate this path computes."""
    return type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation") and hasattr(mlp, "down_proj")
