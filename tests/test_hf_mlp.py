"""The HF integration's one-pass gated SiLU MLP (lora_kernels/integrations/_hf_mlp.py): the kernel against torch's
two ops (CPU under the Triton interpreter; bf16 on the GPU), the dispatch by size and switch, and silu_mul_lora
(the gate_up LoRA expand fused into it) against a float64 reference, its batch invariance and its fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lora_kernels as lk
from lora_kernels import BatchInfoBuilder, sgmv_shrink
from lora_kernels.integrations import _hf_mlp

pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()


def _torch_ref(gu):
    inter = gu.shape[-1] // 2
    return F.silu(gu[..., :inter]) * gu[..., inter:]


def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("shape", [(3, 5, 2 * 1100), (7, 2 * 64), (1, 1, 2 * 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_torch_cpu(shape, dtype):
    """Under TRITON_INTERPRET (set by conftest without a GPU); bf16 only on the GPU (the interpreter's bf16 casts
    do not round as the GPU does). Fresh random inputs, an inner size that is not a multiple of the block."""
    if ON_GPU:
        pytest.skip("the CPU interpreter case; the GPU one is test_kernel_equals_torch_gpu")
    gu = torch.randn(*shape, dtype=torch.float32).to(dtype) * 3
    out = _hf_mlp.silu_mul_kernel(gu)
    ref = _torch_ref(gu)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert _rel(out, ref) <= (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_equals_torch_gpu(dtype):
    gu = (torch.randn(4, 300, 2 * 5000, device="cuda") * 3).to(dtype)
    out = _hf_mlp.silu_mul_kernel(gu)
    ref = _torch_ref(gu)
    assert out.is_contiguous() and out.shape == ref.shape
    # silu is rounded to the dtype first, as torch's two ops do; exp is libdevice's expf, as torch's
    assert _rel(out, ref) <= {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    assert (out != ref).float().mean().item() < 0.05  # nearly every element bit-equal to torch's


def test_kernel_is_on_by_default(monkeypatch):
    """The switch, and the phase choice's device rule: prefill on CUDA takes the kernels, the CPU never does."""
    monkeypatch.delenv("LORA_KERNELS_HF_MLP_KERNEL", raising=False)
    assert _hf_mlp.enabled()
    assert not _hf_mlp.kernels_for(torch.zeros(1, 2, 4))  # CPU tensors: torch's ops (the interpreter is for tests)
    if ON_GPU:
        assert _hf_mlp.kernels_for(torch.zeros(1, 2, 4, device="cuda"))
    monkeypatch.setenv("LORA_KERNELS_HF_MLP_KERNEL", "0")
    assert not _hf_mlp.enabled()
    if ON_GPU:
        assert not _hf_mlp.kernels_for(torch.zeros(1, 2, 4, device="cuda"))


def test_silu_mul_is_torchs_two_ops():
    """silu_mul (decode steps, the switch off) is the model's own two ops, bit for bit; silu_mul_kernel falls back
    to them on a strided gu."""
    gu = torch.randn(32, 1, 2 * 128)
    assert torch.equal(_hf_mlp.silu_mul(gu), _torch_ref(gu))
    strided = torch.randn(4, 2 * 128 + 8)[:, : 2 * 128]
    assert torch.equal(_hf_mlp.silu_mul_kernel(strided), _torch_ref(strided))


@pytest.mark.skipif(not lk.HAS_CUDA_EXT, reason="CUDA extension not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_extension_silu_mul_is_torchs_two_ops(dtype):
    """The extension's silu_mul (decode steps on CUDA): torch's two ops bit for bit, on values from -120 to 120 (exp
    overflows) and rows of odd width; shape, dtype and bad input named. CPU: its reference kernel."""
    dev = "cuda" if ON_GPU else "cpu"
    gen = torch.Generator().manual_seed(5)
    gu = (torch.randn(8, 3, 2 * 1001, generator=gen) * 6).to(dtype).to(dev)
    gu.view(-1)[:240] = torch.linspace(-120, 120, 240).to(dtype)
    out = torch.ops.lora_kernels.silu_mul(gu)
    assert out.shape == (8, 3, 1001) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, _torch_ref(gu))
    if ON_GPU:
        assert torch.equal(_hf_mlp.silu_mul(gu), out)  # the HF decode path takes it
        with pytest.raises(RuntimeError, match=r"gu must be \[..., 2 \* inter\]"):
            torch.ops.lora_kernels.silu_mul(gu[..., :-1].contiguous())
        with pytest.raises(RuntimeError, match="gu must have dtype"):
            torch.ops.lora_kernels.silu_mul(gu.double())
        with pytest.raises(RuntimeError, match="gu must be contiguous"):
            torch.ops.lora_kernels.silu_mul(gu[..., :1000])
        assert torch.ops.lora_kernels.silu_mul(gu[:0]).shape == (0, 3, 1001)
    torch.library.opcheck(torch.ops.lora_kernels.silu_mul.default, (gu,))


def test_silu_gated_detects_the_activation():
    mlp = torch.nn.Module()
    mlp.down_proj = torch.nn.Linear(4, 4)
    mlp.act_fn = torch.nn.SiLU()
    assert _hf_mlp.silu_gated(mlp)
    mlp.act_fn = torch.nn.GELU()
    assert not _hf_mlp.silu_gated(mlp)


# ---- silu_mul_lora: the gate_up group's LoRA expand fused into the silu pass ----

RANKS = [4, 8, 16, 0]  # slot 3: rank 0 (no LoRA for its rows)
SCALINGS = [0.5, 2.0, 1.25, 3.0]
LORA_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def _pool(ranks, R, inter, k, dtype, device, gen):
    """lora_a [S, 2R, k], lora_b [S, 2I, R]; lora_b beyond each slot's rank is NaN: the kernel must never read it
    into a sum. lora_a stays finite (the shrink is not under test)."""
    lora_a = (torch.randn(len(ranks), 2 * R, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    lora_b = (torch.randn(len(ranks), 2 * inter, R, generator=gen) * 0.5).to(dtype).to(device)
    for a, r in enumerate(ranks):
        lora_b[a, :, r:] = float("nan")
    return lora_a, lora_b


def _row_slots(counts, slots):
    """Physical row -> slot: request i owns the next counts[i] rows whatever the sorting."""
    return [a for c, a in zip(counts, slots) for _ in range(c)]


def _batch(counts, slots, sort, pool, inter, dtype, device, gen, ranks=RANKS):
    """(gu [T, 2I], v [T, 2R], info) for one batch: fresh random x and gu, v from the shrink (torch backend on the
    CPU), then v beyond each row's rank (all of it for rows without LoRA) poisoned with NaN."""
    lora_a, lora_b = pool
    R, k = lora_b.shape[2], lora_a.shape[2]
    builder = BatchInfoBuilder(1024, 16, torch.tensor(ranks, dtype=torch.int32, device=device),
                               torch.tensor(SCALINGS[:len(ranks)], device=device))
    info = builder.build(counts, slots, sort_by_adapter=sort)
    T = sum(counts)
    x = torch.randn(T, k, generator=gen).to(dtype).to(device)
    gu = (torch.randn(T, 2 * inter, generator=gen) * 2).to(dtype).to(device)
    v = sgmv_shrink(x, lora_a, info, 2)
    for t, a in enumerate(_row_slots(counts, slots)):
        r = ranks[a] if a >= 0 else 0
        v[t, r:R] = v[t, R + r:] = float("nan")
    return gu, v, info


def _reference(gu, v, lora_b, row_slots, ranks=RANKS):
    """float64 silu(gate + s * v_g B_g^T) * (up + s * v_u B_u^T), per row from its slot, only j < rank."""
    inter, R = gu.shape[-1] // 2, lora_b.shape[2]
    g = gu.reshape(-1, 2 * inter).double().cpu()
    v, lora_b = v.double().cpu(), lora_b.double().cpu()
    for t, a in enumerate(row_slots):
        r = ranks[a] if a >= 0 else 0
        if r:
            g[t, :inter] += SCALINGS[a] * (v[t, :r] @ lora_b[a, :inter, :r].T)
            g[t, inter:] += SCALINGS[a] * (v[t, R:R + r] @ lora_b[a, inter:, :r].T)
    return (F.silu(g[:, :inter]) * g[:, inter:]).reshape(*gu.shape[:-1], inter)


# (counts, slots, sort_by_adapter, pool rank R, I, gu 3-D): segment lengths off the 16-row tile, a slot -1 and a
# rank-0 segment, mixed ranks below R, repeated slots merged by sorting (a permutation), a pool R under BLOCK_R,
# I not a multiple of BLOCK_N.
LORA_CASES = [
    ([5, 17, 33, 4, 9], [0, -1, 2, 1, 3], False, 16, 200, True),
    ([5, 17, 33, 3, 16], [2, 0, 2, -1, 0], True, 16, 200, False),
    ([20, 7, 1], [1, 0, -1], False, 8, 130, False),
]


@pytest.mark.parametrize("case", range(len(LORA_CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_lora_cpu(case, dtype, monkeypatch):
    """The fused kernel under the interpreter (bf16 only on the GPU) against the float64 reference."""
    if ON_GPU:
        pytest.skip("the CPU interpreter case; the GPU one is test_silu_mul_lora_gpu")
    monkeypatch.delenv("LORA_KERNELS_HF_MLP_KERNEL", raising=False)
    counts, slots, sort, R, inter, three_d = LORA_CASES[case]
    gen = torch.Generator().manual_seed(case)
    ranks = [min(r, R) for r in RANKS]
    pool = _pool(ranks, R, inter, 48, dtype, "cpu", gen)
    gu, v, info = _batch(counts, slots, sort, pool, inter, dtype, "cpu", gen, ranks)
    gu = gu.view(1, -1, 2 * inter) if three_d else gu
    before = gu.clone()
    assert _hf_mlp.fused_applies(gu, v, pool[1], info)
    out = _hf_mlp.silu_mul_lora(gu, v, pool[1], info)
    ref = _reference(gu, v, pool[1], _row_slots(counts, slots), ranks)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.isfinite(out).all() and _rel(out, ref) <= LORA_TOL[dtype]
    assert torch.equal(gu, before)  # the fused path leaves the base output as it was


# (counts, slots, sort_by_adapter, X's first physical row) of batches holding request X (21 rows, slot 1). Unsorted,
# a request is its own segment and its tiles start with it; sorted, slot 1's requests share a segment, so X's last
# tile also holds another request's rows, and in the last batch X starts 7 rows into a tile.
ALIGNED = [([21], [1], False, 0), ([16, 21, 33], [0, 1, -1], False, 16), ([16, 21, 17, 3], [1, 1, 2, 1], True, 16)]
SHIFTED = [([5, 21, 33], [0, 1, -1], False, 5), ([7, 17, 21, 3], [1, 2, 1, 0], True, 24)]


def _check_invariance(batches, dtype, device):
    """X's rows of silu_mul_lora, bit for bit the same in every batch. X's x, gu and v rows are copied into each batch
    from the first: only the fused kernel's invariance is under test here."""
    gen = torch.Generator().manual_seed(7)
    pool = _pool(RANKS, 16, 300, 64, dtype, device, gen)
    results = []
    for counts, slots, sort, start in batches:
        gu, v, info = _batch(counts, slots, sort, pool, 300, dtype, device, gen)
        rows = slice(start, start + 21)
        if results:
            gu[rows], v[rows] = gu0, v0
        else:
            gu0, v0 = gu[rows].clone(), v[rows].clone()
        assert _hf_mlp.fused_applies(gu, v, pool[1], info)
        results.append(_hf_mlp.silu_mul_lora(gu, v, pool[1], info)[rows])
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_silu_mul_lora_batch_invariant_cpu(monkeypatch):
    """A request's rows, bit for bit, whatever else is in its batch, its tiles and its sorting (interpreter, fp32).
    The interpreter's tl.dot is numpy's matmul, whose rounding depends on a row's position in the tile (the GPU's
    MMA does not: the GPU test also shifts X within its tiles), so here X keeps its offsets within tiles."""
    if ON_GPU:
        pytest.skip("the CPU interpreter case; the GPU one is test_silu_mul_lora_batch_invariant_gpu")
    monkeypatch.delenv("LORA_KERNELS_HF_MLP_KERNEL", raising=False)
    _check_invariance(ALIGNED, torch.float32, "cpu")


@pytest.mark.parametrize("why", ["switch_off", "more_rows", "strided"])
def test_silu_mul_lora_fallback(why, monkeypatch):
    """Where the fused kernel does not apply (switch off; gu with rows the info does not cover; a strided gu), the
    expand-then-silu_mul composition gives the same values (CPU: the torch backend and torch's ops)."""
    monkeypatch.delenv("LORA_KERNELS_HF_MLP_KERNEL", raising=False)
    counts, slots, sort = [5, 17, 33, 4], [0, -1, 2, 1], True
    gen = torch.Generator().manual_seed(3)
    pool = _pool(RANKS, 16, 200, 48, torch.float32, "cpu", gen)
    gu, v, info = _batch(counts, slots, sort, pool, 200, torch.float32, "cpu", gen)
    row_slots = _row_slots(counts, slots)
    if why == "switch_off":
        monkeypatch.setenv("LORA_KERNELS_HF_MLP_KERNEL", "0")
    elif why == "more_rows":  # 3 trailing rows outside every segment: no LoRA, silu_mul only
        gu = torch.cat([gu, torch.randn(3, 400, generator=gen)])
        v = torch.cat([v, torch.zeros(3, 32)])
        row_slots += [-1] * 3
    else:
        gu = torch.cat([gu, torch.randn(gu.shape[0], 8, generator=gen)], 1)[:, :400]
    ref = _reference(gu, v, pool[1], row_slots)
    assert not _hf_mlp.fused_applies(gu, v, pool[1], info)
    out = _hf_mlp.silu_mul_lora(gu, v, pool[1], info)
    assert out.shape == ref.shape and torch.isfinite(out).all() and _rel(out, ref) <= LORA_TOL[torch.float32]


# silu_mul_lora's tile shapes (GROUP tiles per program, BLOCK_N, warps) that bench/profile/hf_mlp_tiles.py times: each
# must be right and batch-invariant on the GPU, whichever the table keeps.
TILES = [(1, 128, 4), (2, 64, 4), (2, 128, 8), (4, 64, 8)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_mul_lora_gpu(dtype, sort, tiles, monkeypatch):
    monkeypatch.delenv("LORA_KERNELS_HF_MLP_KERNEL", raising=False)
    monkeypatch.setattr(_hf_mlp, "LORA_TILES", tiles)
    counts, slots = [5, 17, 33, 300, 64, 1, 40], [0, -1, 2, 1, 2, 0, 3]
    gen = torch.Generator().manual_seed(11)
    pool = _pool(RANKS, 16, 1000, 256, dtype, "cuda", gen)
    gu, v, info = _batch(counts, slots, sort, pool, 1000, dtype, "cuda", gen)
    assert _hf_mlp.fused_applies(gu, v, pool[1], info)
    out = _hf_mlp.silu_mul_lora(gu, v, pool[1], info)
    ref = _reference(gu, v, pool[1], _row_slots(counts, slots))
    assert out.dtype == dtype and torch.isfinite(out).all() and _rel(out, ref) <= LORA_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_lora_batch_invariant_gpu(dtype, tiles, monkeypatch):
    monkeypatch.delenv("LORA_KERNELS_HF_MLP_KERNEL", raising=False)
    monkeypatch.setattr(_hf_mlp, "LORA_TILES", tiles)
    _check_invariance(ALIGNED + SHIFTED, dtype, "cuda")
