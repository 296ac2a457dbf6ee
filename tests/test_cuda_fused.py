"""The cuda backend's one-launch apply (csrc/kernels/sgmv_fused_cluster.cuh, sm_90+, up to 8 rows of x:
kFusedMaxRows in csrc/ops/sgmv_plan.h).

Opt-in (`LORA_KERNELS_CUDA_FUSED=1`; `0` or unset: the two launches). It must give the bits of the two launches
(split-K shrink into fp32 planes, then the expand): with it on, sgmv_apply picks between them by the number of
rows, so batch invariance rests on this equality. Also against a float64 reference, stale weights poisoned with
NaN, rows outside the batch untouched, and graph replay against eager.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import LLAMA_MODULES, TOL, launched_sgmv_kernels, make_case, rel_err
from test_cuda_backend import _poison_stale, _truth_large, _untouched

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not lk.HAS_CUDA_EXT, reason="CUDA extension not built")]
ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _apply(case, info, fused: bool, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv("LORA_KERNELS_CUDA_FUSED", "1" if fused else "0")
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, info, case.slice_offsets, backend="cuda")
    torch.cuda.synchronize()
    return out


def _case(shape, rank, rows, dtype, seed):
    in_dim, widths = LLAMA_MODULES[shape]
    rng = np.random.default_rng([seed, rank, rows, len(shape)])
    n_seg = int(rng.integers(1, rows + 1))
    lens = [int(c) for c in rng.multinomial(rows - n_seg, np.ones(n_seg) / n_seg) + 1]
    ranks = [rank, rank // 2, 5, rank, 13, 0, rank - 3, 1]  # odd ranks: partial 16-column groups and MMA steps
    slots = [int(s) for s in rng.integers(-1, 8, n_seg)]
    slots[0] = 0  # at least one segment with LoRA: otherwise the test could not fail
    return make_case(rng, num_slots=8, max_rank=rank, ranks=ranks, slice_widths=widths, in_dim=in_dim,
                     seg_lens=lens, slots=slots, dtype=dtype, device="cuda", permute=bool(seed % 2),
                     extra_rows=0 if rows == 8 else int(seed % 3))


@pytest.mark.skipif(not ON_SM90, reason="the one-launch path needs sm_90+")
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("shape", ["qkv", "gate_up", "down"])
def test_fused_equals_two_launches_and_reference(shape, rank, rows, monkeypatch):
    for seed, dtype in enumerate((torch.bfloat16, torch.float16)):
        case = _poison_stale(_case(shape, rank, rows, dtype, seed))
        fused = _apply(case, case.info, True, monkeypatch)
        split = _apply(case, case.info, False, monkeypatch)
        assert torch.equal(fused, split), f"{dtype}: the one-launch path changed bits"
        v_ref, covered, expand = _truth_large(case, case.info)
        assert rel_err(fused, expand(v_ref.nan_to_num(0), case.base)) <= TOL[dtype]
        untouched = _untouched(case)
        assert torch.equal(fused[untouched], case.base[untouched]), "rows without LoRA changed"
        assert not torch.equal(fused, case.base), "the batch changed nothing: the test cannot fail"


@pytest.mark.skipif(not ON_SM90, reason="the one-launch path needs sm_90+")
def test_fused_graph_replay_equals_eager(monkeypatch):
    """Captured once on a graph-mode info of 8 rows, replayed for other decode batches: bit-equal to eager."""
    monkeypatch.setenv("LORA_KERNELS_CUDA_FUSED", "1")
    rng = np.random.default_rng(31)
    case = _poison_stale(_case("qkv", 16, 8, torch.bfloat16, 0))
    builder = lk.BatchInfoBuilder(8, 8, case.info.lora_ranks, case.info.scalings, cuda_graph=True)
    info = builder.build([1] * 8, [int(s) for s in rng.integers(-1, 8, 8)])
    x, out = case.x[:8].clone(), case.base[:8].clone()
    args = (case.lora_a, case.lora_b, info, case.slice_offsets)
    lk.apply_lora(x, out.clone(), *args, backend="cuda")  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lk.apply_lora(x, out, *args, backend="cuda")
    base = out.clone()
    for n in (1, 5, 8):
        info2 = builder.build([1] * n, [int(s) for s in rng.integers(-1, 8, n)])
        out.copy_(base)
        graph.replay()
        eager = base.clone()
        lk.apply_lora(x, eager, case.lora_a, case.lora_b, info2, case.slice_offsets, backend="cuda")
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"{n} requests: replay != eager"
    assert not torch.equal(out, base), "the batch changed nothing: the test cannot fail"


@pytest.mark.skipif(not ON_SM90, reason="the one-launch path needs sm_90+")
@pytest.mark.parametrize("rows", [16, 40, 63, 64])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("shape", ["qkv", "gate_up"])
def test_linear_one_launch_has_the_same_bits(shape, rank, rows, monkeypatch):
    """sgmv_linear with one_launch (the eager HF decode step) runs the LoRA as one cluster launch up to
    kFusedMaxRowsLinear = 64 rows, where a cluster runs several tiles' expands, and as two beyond: the bits of the
    two launches either way. LORA_KERNELS_CUDA_FUSED=0 / =1 overrides the argument."""
    case = _poison_stale(_case(shape, rank, rows, torch.bfloat16, 1))
    i = case.info
    g = torch.Generator(device="cuda").manual_seed(rows)
    weight = (torch.randn(case.slice_offsets[-1], case.x.shape[1], device="cuda", generator=g) * 0.02).bfloat16()
    args = (case.x, weight, None, case.lora_a, case.lora_b, i.work, i.lora_ranks, i.scalings, i.permutation,
            list(case.slice_offsets), i.max_tiles)
    op = torch.ops.lora_kernels.sgmv_linear.default
    monkeypatch.delenv("LORA_KERNELS_CUDA_FUSED", raising=False)
    two, one = op(*args, False), op(*args, True)
    monkeypatch.setenv("LORA_KERNELS_CUDA_FUSED", "1")
    forced_on = op(*args, False)
    monkeypatch.setenv("LORA_KERNELS_CUDA_FUSED", "0")
    launched_off = launched_sgmv_kernels(lambda: op(*args, True))
    monkeypatch.delenv("LORA_KERNELS_CUDA_FUSED")
    launched = launched_sgmv_kernels(lambda: op(*args, True))
    torch.cuda.synchronize()
    assert torch.equal(one, two) and torch.equal(forced_on, two), "the one-launch path changed bits"
    assert not torch.equal(two, torch.nn.functional.linear(case.x, weight)), "LoRA changed nothing"
    if os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        return
    assert all("fused" not in n for n in launched_off) and len(launched_off) >= 2, launched_off
    if case.x.shape[0] <= 64:  # x has the case's extra (padding) rows beyond its segments' `rows`
        assert len(launched) == 1 and "fused" in launched[0], launched
    else:
        assert launched == launched_off, launched
