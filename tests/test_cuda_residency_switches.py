"""Two A/B switches of the cuda backend's plans (csrc/ops/sgmv.cu: fit_shrink, stream_ctas), read at each call:
LK_SHRINK_FIT=1 (the one-warp decode shrink with 5 pipeline stages instead of 8 where its K split is at most 4 slabs)
and LK_STREAM_CTAS=N (the streaming expand's persistent grid at N CTAs an SM instead of 5). Neither may change a bit:
every output is torch.equal to the default plan's, eagerly and in a CUDA-graph replay, at K = 4096 (16 splits of 256:
4 slabs, where FIT applies) and K = 1024 (4 splits of 256), one row and 16 rows (the narrow shrink), 2 x 14336 columns
(runs of several items a warp, more with fewer CTAs), slot -1 rows, ranks below the pool's with NaN past them; right
against float64; FIT launches another shrink kernel than the default."""

from __future__ import annotations

import os

import pytest
import torch

import lora_kernels as lk
from cases import TOL, launched_sgmv_kernels, make_info, poisoned_weights, reference_apply, rel_err

HAS_EXT = lk.HAS_CUDA_EXT and torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_EXT, reason="needs the CUDA extension and a GPU")]

SHAPES = {  # in_dim, slice widths, pool ranks (R = 16), rows (one a segment)
    "o_k4096_bs1": (4096, (4096,), [16, 8, 16, 3], 1),
    "o_k4096_bs16": (4096, (4096,), [16, 8, 16, 3, 16, 12], 16),
    "gate_up_k4096_bs16": (4096, (14336, 14336), [16, 8, 16, 3, 16, 12], 16),
    "gate_up_k1024_bs16": (1024, (14336, 14336), [16, 16, 5], 16),
}
SWITCHES = {"fit": {"LK_SHRINK_FIT": "1"}, "ctas2": {"LK_STREAM_CTAS": "2"},
            "fit_ctas4": {"LK_SHRINK_FIT": "1", "LK_STREAM_CTAS": "4"}}


def _problem(shape: str, dtype):
    in_dim, widths, ranks, rows = SHAPES[shape]
    g = torch.Generator().manual_seed(401 + list(SHAPES).index(shape))
    a, b, offs = poisoned_weights(g, dtype, in_dim, 16, widths, ranks)
    scal = (torch.rand(len(ranks), generator=g) + 0.5).cuda()
    slots = [int(s) for s in torch.randint(0, len(ranks), (rows,), generator=g)]
    if rows > 1:
        slots[1] = -1
    info = make_info([1] * rows, slots, None, torch.tensor(ranks, dtype=torch.int32, device="cuda"), scal, "cuda")
    x = torch.randn(rows, in_dim, generator=g).to(dtype).cuda()
    base = torch.randn(rows, offs[-1], generator=g).to(dtype).cuda()
    return x, base, a, b, info, offs, [i for i, s in enumerate(slots) if s < 0]


def _apply(x, base, a, b, info, offs, graph: bool) -> torch.Tensor:
    """apply_lora on a copy of base, eagerly or from a captured graph's replay (the switches are read at each call)."""
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


@pytest.mark.parametrize("switch", SWITCHES)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_plan_switches_keep_every_bit(dtype, shape, graph, switch, monkeypatch):
    x, base, a, b, info, offs, untouched = _problem(shape, dtype)
    for name in ("LK_SHRINK_FIT", "LK_STREAM_CTAS"):
        monkeypatch.delenv(name, raising=False)
    plain_names = launched_sgmv_kernels(lambda: _apply(x, base, a, b, info, offs, False))
    plain = _apply(x, base, a, b, info, offs, graph)
    for name, value in SWITCHES[switch].items():
        monkeypatch.setenv(name, value)
    names = launched_sgmv_kernels(lambda: _apply(x, base, a, b, info, offs, False))
    switched = _apply(x, base, a, b, info, offs, graph)
    fit = "LK_SHRINK_FIT" in SWITCHES[switch] and "k4096" in shape  # 16 splits of 4 slabs: the 5-stage shrink
    if fit and not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert names != plain_names, names
    assert torch.equal(switched, plain)
    assert not torch.equal(switched, base)
    assert all(torch.equal(switched[i], base[i]) for i in untouched)
    assert rel_err(switched, reference_apply(x, base, a, b, info, offs)) <= TOL[dtype]
