"""The streaming expand's A/B switches (csrc/kernels/sgmv_expand_stream.cuh), read at each launch: LK_STREAM_LATE=1
(the copies on the tile's slot alone: whole B blocks copied whatever the rank, the fragments past it masked) and
LK_STREAM_B3=1 (three B stages at R <= 16: a warp's third item's B block before griddep_wait), alone and together.
Every output is torch.equal to the default form's, eagerly and in a CUDA-graph replay, at R 16 (decode batches of
2-127 rows; 2 x 14336 columns give runs of three items a warp) and R 64 (one-row tiles from 128 rows), with runs that
cross tiles and slices, slot -1 rows, ranks below the pool's (NaN past each slot's rank: a mask that lets one through
shows) and a slot of rank 0 (copied, never applied), and right against float64."""

from __future__ import annotations

import os

import pytest
import torch

import lora_kernels as lk
from cases import TOL, launched_sgmv_kernels, make_info, poisoned_weights, reference_apply, rel_err

HAS_EXT = lk.HAS_CUDA_EXT and torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_EXT, reason="needs the CUDA extension and a GPU")]

SHAPES = {  # R, slice widths, pool ranks, rows (one a segment)
    "gate_up_r16": (16, (1536, 1536), [16, 8, 16, 3, 16, 12, 0], 16),
    "gate_up_r16_wide": (16, (14336, 14336), [16, 8, 16, 3, 16, 12, 0], 16),
    "qkv_r16": (16, (1024, 256, 256), [16, 16, 5, 16], 64),
    "gate_up_r64": (64, (512, 136), [64, 32, 64, 5, 64, 0], 128),
}


def _problem(shape: str, dtype):
    R, widths, ranks, rows = SHAPES[shape]
    g = torch.Generator().manual_seed(211 + list(SHAPES).index(shape))
    in_dim, n = 1024, len(ranks)
    a, b, offs = poisoned_weights(g, dtype, in_dim, R, widths, ranks)
    scal = (torch.rand(n, generator=g) + 0.5).cuda()
    slots = [int(s) for s in torch.randint(-1, n, (rows,), generator=g)]
    slots[1] = -1
    if 0 in ranks:
        slots[2] = ranks.index(0)  # a slot of rank 0: no LoRA
    info = make_info([1] * rows, slots, None, torch.tensor(ranks, dtype=torch.int32, device="cuda"), scal, "cuda")
    x = torch.randn(rows, in_dim, generator=g).to(dtype).cuda()
    base = torch.randn(rows, offs[-1], generator=g).to(dtype).cuda()
    return x, base, a, b, info, offs, [i for i, s in enumerate(slots) if s < 0 or ranks[s] == 0]


def _apply(x, base, a, b, info, offs, graph: bool) -> torch.Tensor:
    """apply_lora on a copy of base, eagerly or from a captured graph's replay (the switches are read at launch)."""
    out = base.clone()
    if not graph:
        lk.apply_lora(x, out, a, b, info, offs, backend="cuda")
        return out
    lk.apply_lora(x, out.clone(), a, b, info, offs, backend="cuda")  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        lk.apply_lora(x, out, a, b, info, offs, backend="cuda")
    g.replay()
    torch.cuda.synchronize()
    return out


SWITCHES = {"late": ("LK_STREAM_LATE",), "b3": ("LK_STREAM_B3",), "late_b3": ("LK_STREAM_LATE", "LK_STREAM_B3")}


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stream_switches_keep_every_bit(dtype, shape, graph, switch, monkeypatch):
    x, base, a, b, info, offs, untouched = _problem(shape, dtype)
    for name in ("LK_STREAM_LATE", "LK_STREAM_B3"):
        monkeypatch.setenv(name, "0")
    plain = _apply(x, base, a, b, info, offs, graph)
    for name in SWITCHES[switch]:
        monkeypatch.setenv(name, "1")
    names = launched_sgmv_kernels(lambda: _apply(x, base, a, b, info, offs, False))
    switched = _apply(x, base, a, b, info, offs, graph)
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert any("expand_stream" in k for k in names), names
    assert torch.equal(switched, plain)
    assert 1 in untouched and not torch.equal(switched, base)  # row 1: slot -1; row 2 where a slot has rank 0
    assert all(torch.equal(switched[i], base[i]) for i in untouched)
    assert rel_err(switched, reference_apply(x, base, a, b, info, offs)) <= TOL[dtype]
