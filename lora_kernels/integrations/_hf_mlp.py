"""The gated MLP of a patched decoder layer over the stacked gate_up output (Llama, Qwen2, Mistral: SiLU).

The integration runs gate_proj and up_proj as one GEMM into [.., gate | up]; the model's own MLP forward then
computes `act_fn(gate) * up` on two column slices of it. Those are strided views, and torch's elementwise kernels
take their slow non-vectorized path on them: on the H200 the integration with no adapter row spent ~1.5-2 ms more
than the base model in such ops at the 1B prefill (bench/RESULTS.md, sixth session). Here one pass reads both
halves row by row and writes `silu(gate) * up` contiguous: what the model computes (silu rounded to the model's
dtype, then the product rounded), in fewer bytes than the base model's two ops. exp is libdevice's (CUDA's
accurate expf, as torch's silu uses), not tl.exp's approximate ex2: fp32 results equal torch's bit for bit in
nearly every element.

The integration chooses by phase, never by batch size, so that a row's bits do not depend on its batch: prefill
calls (more than one position per row) take the one-pass kernels on CUDA; decode steps take the extension's
silu_mul op, torch's two ops' roundings in one launch and one host call (a Triton launch costs more host time than
it saves there, and eager decode steps are host-bound). The kernels are
on by default (`LORA_KERNELS_HF_MLP_KERNEL=0`, read at each call, turns them off): on an H100, bench/bench_hf.py
measured the prefill overhead over the base model going from +24.0% to +14.2% at the 1B shapes and from +14.9% to
+8.0% at the 8B ones with the one-pass kernel. Off, the patched MLP runs torch's two ops on the stacked output's
halves, as the model's own forward would.

`silu_mul_lora` also folds the gate_up group's LoRA expand into that pass: from the base GEMM's output and the
group's shrink output v it computes silu(gate + Δgate) * (up + Δup), each sum rounded to the dtype as the
standalone expand rounds it, so the stacked output is read once and never written back. It walks the batch
info's work list, so it runs only where the list covers every row exactly once; elsewhere it composes
`sgmv_expand` (in place into gu) and `silu_mul`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from lora_kernels import backends
from lora_kernels import ops as _ops
from lora_kernels.backends.cuda import HAS_CUDA_EXT
from lora_kernels.batch_info import LoRABatchInfo
from lora_kernels.batch_record import TILE_M

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with CUDA torch; the torch path stays
    triton = None

if triton is not None:
    try:  # the backend-neutral stub (resolved to CUDA's libdevice at compile time)
        from triton.language.extra import libdevice
    except ImportError:  # pragma: no cover - Triton versions without the stub module
        from triton.language.extra.cuda import libdevice
    from lora_kernels.backends.triton.kernels import _load_b, _rows
    from lora_kernels.backends.triton.tall import _group, _next_run

_BLOCK = 1024
_ENV = "LORA_KERNELS_HF_MLP_KERNEL"
# The interpreter implements no libdevice function (Triton 3.8 raises on them); there tl.exp is numpy's exp.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# silu_mul_lora's tiles: TILE_M rows (the work list's) by BLOCK_N columns; each of the two B blocks it loads is at
# most _LORA_TILE_ELEMS elements (BLOCK_N shrinks as the padded rank grows), as the standalone expand's table has it.
# An ad hoc timing while it was written (not a bench script; H100, bf16, rank 16, 4096 rows of 8 adapters,
# I = 8192 / 14336): 128 columns and 4 warps fastest of 64/4, 128/4, 128/8, 256/4, 256/8: 0.112 / 0.187 ms against
# 0.194 / 0.337 ms for sgmv_expand then silu_mul (silu_mul alone: 0.077 / 0.127 ms); rank 64 at I = 14336: 0.317
# against 0.383 ms. bench/bench_hf.py measures what it does to the model (bench/RESULTS.md).
_LORA_TILE_ELEMS = 8192
# (GROUP work-list tiles per program, BLOCK_N, warps). bench/profile/hf_mlp_tiles.py (H100, 2026-11-26, 9ee246a;
# 32 x 128 rows, 32 adapters, r16): (1, 128, 4) 106 / 181 µs at I = 8192 / 14336 (1.56x / 1.53x a memcpy of the
# bytes; silu_mul without LoRA 1.04x); two or four tiles per program measured 1.9-3.2x, every shape bit-equal.
LORA_TILES = (1, 128, 4)


def enabled() -> bool:
    """The switch (LORA_KERNELS_HF_MLP_KERNEL, read at each call; on unless it is 0)."""
    return os.environ.get(_ENV, "1") != "0"


def kernels_for(x: torch.Tensor) -> bool:
    """Whether a prefill MLP on x takes the one-pass kernels: the switch on, Triton, CUDA tensors."""
    return triton is not None and enabled() and x.is_cuda


def _runs_here(t: torch.Tensor) -> bool:
    """Whether the kernels can run on t's device: CUDA, or the CPU under TRITON_INTERPRET (the tests)."""
    return triton is not None and (t.is_cuda or (_INTERPRET and t.device.type == "cpu"))


if triton is not None:
    @triton.jit
    def _silu_times(g, u, dtype: tl.constexpr, EXACT_EXP: tl.constexpr):
        """round(round(silu(g)) * u) from fp32 g, u: torch's two ops (silu computed as x / (1 + expf(-x)))."""
        if EXACT_EXP:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        s = tl.math.div_rn(g, 1.0 + e).to(dtype).to(tl.float32)  # act_fn(gate), rounded as torch returns it
        return (s * u).to(dtype)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, EXACT_EXP: tl.constexpr):
        """out[r, j] = round(round(silu(gate[r, j])) * up[r, j]), gate = gu[r, :inter], up = gu[r, inter:]."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        src = gu_ptr + row * (2 * inter) + cols
        g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
        h = _silu_times(g, u, out_ptr.dtype.element_ty, EXACT_EXP)
        tl.store(out_ptr + row * inter + cols, h, mask=mask)

    @triton.jit
    def _lora_delta(v_ptr, bt, rows, row_mask, rank, R, SLICE: tl.constexpr, BLOCK_R: tl.constexpr,
                    DOT_PREC: tl.constexpr):
        """fp32 sum_{j<rank} v[rows, SLICE*R + j] * bt[:, j] as one [TILE_M, BLOCK_R] x [BLOCK_R, BLOCK_N] dot (v
        loaded and selected as B is; rounded to B's dtype first, as the standalone expand does)."""
        j = tl.arange(0, BLOCK_R)
        vt = tl.load(v_ptr + rows[:, None] * (2 * R) + SLICE * R + j[None, :],
                     mask=row_mask[:, None] & (j < R)[None, :], other=0.0)
        vt = tl.where((j < rank)[None, :], vt, 0.0).to(bt.dtype)
        return tl.dot(vt, tl.trans(bt), input_precision=DOT_PREC)

    @triton.jit
    def _silu_mul_lora_run(gu_ptr, v_ptr, b_ptr, out_ptr, lora_ranks, scalings, perm_ptr, slot, lo, hi, n, n_mask,
                           inter, R, num_slots, HAS_PERM: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                           DOT_PREC: tl.constexpr, EXACT_EXP: tl.constexpr):
        """One run (rows [lo, hi) of one slot, at most ROWS) by the program's columns n: g = round(gu[row, n] + s *
        dg), u = round(gu[row, inter + n] + s * du) (dg, du: the slot's gate/up expand; none for slot -1, out of
        range or rank 0), out[row, n] = _silu_times(g, u)."""
        rows, row_mask = _rows(perm_ptr, lo, hi, ROWS, HAS_PERM)
        mask = row_mask[:, None] & n_mask[None, :]
        src = gu_ptr + rows[:, None] * (2 * inter) + n[None, :]
        g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        live = (slot >= 0) & (slot < num_slots)
        slot64 = tl.where(live, slot, 0).to(tl.int64)
        rank = tl.where(live, tl.load(lora_ranks + slot64), 0)
        if rank > 0:
            # B's gate / up rows of the slot, columns j < rank (loaded up to R, then selected: whatever the columns
            # beyond the rank hold never reaches a sum, where a 0 * NaN in the dot would).
            j = tl.arange(0, BLOCK_R)
            b_gate = b_ptr + slot64 * 2 * inter * R
            bg = _load_b(b_gate, n, n_mask, j, j < rank, R)
            bu = _load_b(b_gate + inter * R, n, n_mask, j, j < rank, R)
            s = tl.load(scalings + slot64)
            dg = _lora_delta(v_ptr, bg, rows, row_mask, rank, R, 0, BLOCK_R, DOT_PREC)
            du = _lora_delta(v_ptr, bu, rows, row_mask, rank, R, 1, BLOCK_R, DOT_PREC)
            g = (g + s * dg).to(dtype).to(tl.float32)  # the expand's rounding of gu + s * acc
            u = (u + s * du).to(dtype).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * inter + n[None, :], _silu_times(g, u, dtype, EXACT_EXP), mask=mask)

    @triton.jit(do_not_specialize=["MT"])
    def _silu_mul_lora_kernel(gu_ptr, v_ptr, b_ptr, out_ptr, work, lora_ranks, scalings, perm_ptr, MT, inter, R,
                              num_slots, HAS_PERM: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr,
                              EXACT_EXP: tl.constexpr):
        """Program (group of GROUP work-list tiles, column tile): every run of the group's tiles (consecutive tiles
        of one slot whose rows follow on, as the tall expand's) as one _silu_mul_lora_run, whose dots are GROUP *
        BLOCK_M rows tall. A row's result does not depend on the dot's height on sm90 (scripts/triton_dot_bits.py)
        nor on the column tile: its bits depend on its own inputs only, whatever the batch."""
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < inter
        n_tiles = tl.load(work)
        g0 = tl.program_id(0) * GROUP
        if g0 < n_tiles:
            slot_v, lo_v, hi_v, link_v, count = _group(work, g0, n_tiles, MT, GROUP, BLOCK_M)
            r = 0
            for q in tl.static_range(GROUP):  # unrolled, as the tall expand's runs
                if r < count:
                    slot, lo, hi, r = _next_run(r, slot_v, lo_v, hi_v, link_v, GROUP)
                    _silu_mul_lora_run(gu_ptr, v_ptr, b_ptr, out_ptr, lora_ranks, scalings, perm_ptr, slot, lo, hi,
                                       n, n_mask, inter, R, num_slots, HAS_PERM, GROUP * BLOCK_M, BLOCK_R,
                                       DOT_PREC, EXACT_EXP)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gu[..., :I]) * gu[..., I:] for gu [..., 2I]: [..., I], as torch's two ops (the model's own) compute it.
    A contiguous CUDA gu takes the extension's silu_mul (their roundings, one launch): in an eager decode step each
    torch call is host time, and the two ops on the halves are four (two slices, silu, mul)."""
    if HAS_CUDA_EXT and gu.is_cuda and gu.is_contiguous():
        return torch.ops.lora_kernels.silu_mul.default(gu)
    inter = gu.shape[-1] // 2
    return F.silu(gu[..., :inter]) * gu[..., inter:]


def silu_mul_kernel(gu: torch.Tensor) -> torch.Tensor:
    """silu_mul in one pass (CUDA, or CPU under TRITON_INTERPRET=1 for the tests); torch's ops where gu is not
    contiguous or the kernel cannot run."""
    if not (gu.is_contiguous() and _runs_here(gu)):
        return silu_mul(gu)
    inter = gu.shape[-1] // 2
    rows = gu.numel() // max(2 * inter, 1)
    out = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype, device=gu.device)
    if rows and inter:
        _silu_mul_kernel[(rows, triton.cdiv(inter, _BLOCK))](gu, out, inter, BLOCK=_BLOCK, EXACT_EXP=not _INTERPRET)
    return out


def silu_mul_lora(gu: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
    """silu(gate) * up [..., I] of the gate_up group's output with its LoRA delta added: gate/up = gu's halves plus
    scaling * v's slice 0/1 expanded by lora_b's rows [0, I) / [I, 2I), each sum rounded to gu's dtype.

    gu: [..., 2I] the base GEMM's output (no LoRA yet), fp16/bf16/fp32; v: [T, 2R] the group's shrink output
    (`sgmv_shrink(x, lora_a, info, 2)`), fp32 or gu's dtype; lora_b: [num_slots, 2I, R], gu's dtype; T = rows of
    gu. Checked as `sgmv_expand` checks them (errors name the argument). One fused pass where `fused_applies`;
    otherwise `sgmv_expand` into gu in place (gu then holds the sums) and `silu_mul_kernel`.
    """
    inter = gu.shape[-1] // 2
    offsets = (0, inter, 2 * inter)
    gu2d = gu.reshape(-1, gu.shape[-1])
    if not gu2d.is_contiguous():  # the expand writes a contiguous out; a copy is the fallback's own gu
        gu2d = gu2d.contiguous()
    _ops._check_expand(v, lora_b, info, offsets, gu2d)
    if fused_applies(gu, v, lora_b, info):
        return silu_mul_lora_kernel(gu, v, lora_b, info)
    # sgmv_expand's backend call without its checks: the arguments passed the same checks above.
    backends.get(_ops.resolve_backend(None, gu2d.device, info)).sgmv_expand(v, lora_b, info, offsets, gu2d)
    return silu_mul_kernel(gu2d).reshape(*gu.shape[:-1], inter)


def fused_applies(gu: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, info: LoRABatchInfo) -> bool:
    """Whether silu_mul_lora runs its fused kernel on arguments it has checked: Triton on CUDA (or the interpreter
    on the CPU), the switch on, no CUDA graph being captured (a replay would reuse the launch for other infos), a
    contiguous gu, a rank of at least 1, and an info whose work list covers each of gu's rows once (num_tokens ==
    rows; not graph-mode decode with padding segments)."""
    if not (enabled() and _runs_here(gu)):
        return False
    if gu.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    rows = gu.numel() // max(gu.shape[-1], 1)
    if info.work is None or info.num_tokens != rows or rows == 0 or lora_b.shape[2] == 0:
        return False
    if info.max_seg_len == 1 and info.num_segments != info.num_tokens:  # padding rows no tile covers
        return False
    return gu.is_contiguous()


def silu_mul_lora_kernel(gu: torch.Tensor, v: torch.Tensor, lora_b: torch.Tensor, info: LoRABatchInfo
                         ) -> torch.Tensor:
    """The fused kernel (callers check `fused_applies` first): writes only the rows info's work list covers."""
    inter = gu.shape[-1] // 2
    R = lora_b.shape[2]
    out = torch.empty(*gu.shape[:-1], inter, dtype=gu.dtype, device=gu.device)
    if info.max_tiles == 0 or inter == 0:
        return out
    group, block_n_max, warps = LORA_TILES
    block_r = max(16, 1 << (R - 1).bit_length())  # the whole rank in one dot
    block_n = max(16, min(block_n_max, _LORA_TILE_ELEMS // block_r))
    perm = info.permutation
    grid = (triton.cdiv(info.max_tiles, group), triton.cdiv(inter, block_n))
    _silu_mul_lora_kernel[grid](
        gu, v, lora_b, out, info.work, info.lora_ranks, info.scalings, perm if perm is not None else info.work,
        info.max_tiles, inter, R, lora_b.shape[0], HAS_PERM=perm is not None, GROUP=group, BLOCK_M=TILE_M,
        BLOCK_N=block_n, BLOCK_R=block_r, DOT_PREC="ieee" if gu.dtype == torch.float32 else "tf32",
        EXACT_EXP=not _INTERPRET, num_warps=warps)
    return out


def silu_gated(mlp) -> bool:
    """Whether mlp's act_fn is SiLU (transformers' "silu": Llama, Qwen2, Mistral), the gate this path computes."""
    return type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation") and hasattr(mlp, "down_proj")
