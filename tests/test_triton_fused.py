"""The one-launch decode path of the Triton backend (backends/triton/fused.py).

It must give the bits of the two-launch path (so that choosing it by the number of rows keeps batch
invariance), be right against float64, leave its tile counters at zero after every launch, and replay
under a CUDA graph. CPU: the interpreter (one program, fp32 / fp16); GPU: bf16 at Llama shapes, graphs.
"""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import TOL, compile_for_sm90, make_case, rel_err
from lora_kernels import backends
from lora_kernels.backends import triton as tb
from lora_kernels.backends.triton import plan
from test_triton import SMALL_TABLE, RowLoop, check_case

pytestmark = pytest.mark.skipif(backends.unavailable("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
                                is not None, reason="Triton backend unavailable")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON = {"max_rows": 1 << 30, "ctas_per_sm": 1}
OFF = {"max_rows": 0, "ctas_per_sm": 1}


def _set(monkeypatch, base: dict, fused: dict) -> None:
    monkeypatch.setattr(plan, "TABLE", {**base, "fused": fused})
    plan.clear_cache()


def _apply(case, info=None):
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, info or case.info, case.slice_offsets, backend="triton")
    return out


def _counters_zero(device) -> bool:
    """True when the fused kernel has run on `device` (its counters exist) and left every counter at zero."""
    bufs = [buf for key, buf in tb._sync.items() if key[0].type == torch.device(device).type]
    return bool(bufs) and all(int(buf.abs().sum()) == 0 for buf in bufs)


CASES = [  # (seg_lens, in_dim, widths, max_rank, permute): split-K or not, one to four slices, sorted rows
    ((1, 1, 1, 1, 1), 96, (32, 16), 16, False),
    ((3, 1, 5), 64, (48,), 8, True),
    ((1, 2, 1, 7, 1, 1), 40, (24, 8, 8), 16, False),
    ((2, 20, 1), 130, (16, 16, 16, 16), 4, True),
]


@pytest.mark.parametrize("table", ["default", "small", "small-prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", range(len(CASES)))
def test_fused_equals_two_launches_and_reference(monkeypatch, table, dtype, k):
    """small-prefetch: the expand's prefetch form, in both paths (the fused one waits, then prefetches)."""
    if table != "default" and dtype != torch.float32:
        pytest.skip("the tiny table reaches the same paths in fp32 (the interpreter is slow)")
    seg_lens, in_dim, widths, max_rank, permute = CASES[k]
    rng = np.random.default_rng([k, dtype.itemsize])
    case = make_case(rng, num_slots=5, max_rank=max_rank, slice_widths=widths, in_dim=in_dim, seg_lens=seg_lens,
                     dtype=dtype, device=DEVICE, permute=permute, extra_rows=2)
    base = dict(plan.TABLE) if table == "default" else SMALL_TABLE
    if table == "small-prefetch":
        base = {**base, "expand": {**base["expand"], "prefetch": True}}
    _set(monkeypatch, base, OFF)
    two = _apply(case)
    _set(monkeypatch, base, ON)
    one = _apply(case)
    assert torch.equal(one, two), "the fused path changed bits"
    ref = RowLoop(case, case.info)
    v_ref, _ = ref.shrink()
    assert rel_err(one, ref.expand(v_ref.nan_to_num(0), case.base)) <= TOL[dtype]
    assert _counters_zero(DEVICE), "a tile counter was left non-zero"
    plan.clear_cache()


def test_path_follows_the_table_without_a_cache_clear(monkeypatch):
    """The launch recipes are cached per argument signature and per path: a table whose `fused` entry changes
    between calls (bench_kernels' triton-fused variant swaps it) takes effect at the next call."""
    rng = np.random.default_rng(7)
    case = make_case(rng, num_slots=4, max_rank=8, slice_widths=(16,), in_dim=48, seg_lens=(1, 1), device=DEVICE)
    _set(monkeypatch, dict(plan.TABLE), OFF)
    tb._sync.clear()
    two = _apply(case)
    assert not tb._sync, "the two-launch path ran the fused kernel"
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "fused": ON})  # no clear_cache
    one = _apply(case)
    assert tb._sync and torch.equal(one, two)
    plan.clear_cache()


def test_fused_grid_checks(monkeypatch):
    """check_case (shrink, expand and apply against float64, untouched rows bit-equal) with the fused path on."""
    _set(monkeypatch, dict(plan.TABLE), ON)
    rng = np.random.default_rng(5)
    case = make_case(rng, num_slots=4, max_rank=8, slice_widths=(16, 8), in_dim=48, seg_lens=(1, 1, 2, 1),
                     device=DEVICE, extra_rows=3)
    check_case(case)
    plan.clear_cache()


_AOT = r'''
import json
from lora_kernels.backends.triton import fused, kernels, plan
out = []
for S, R, sp, offs, ep in llama_plans(False):
    fp = plan.fused_plan(sp, ep)
    k = compile90(fused._fused_kernel, {**fp.kw, "PDL": True},
                  ("x_ptr:bf16", "a_ptr:bf16", "b_ptr:bf16", "out_ptr:bf16", "ws_ptr:fp32", "sync_ptr:i32"),
                  ("MT", "K", "R", "NR", "OUT", "num_rows", "k_chunk", "off1", "off2", "off3", "t1", "t2", "t3"),
                  scalings=True)
    ptx = k.asm["ptx"]
    out.append({"S": S, "R": R, "shared": k.metadata.shared,
                "mma": "mma.sync" in ptx or "wgmma" in ptx, "acquire": "acquire" in ptx, "release": "release" in ptx,
                "gdc": "griddepcontrol" in ptx})
    # the two launches' kernels too, which share the fused kernel's helpers
    for fn, kw, ptrs, ints in ((kernels._shrink_kernel, {**sp.kw, "PDL": True, "PARTIAL": True},
                                ("x_ptr:bf16", "a_ptr:bf16", "out_ptr:fp32"), ("MT", "K", "R", "NR", "num_rows", "k_chunk")),
                               (kernels._expand_kernel, {**ep.kw, "PDL": True},
                                ("v_ptr:fp32", "b_ptr:bf16", "out_ptr:bf16"),
                                ("MT", "R", "NR", "OUT", "num_rows", "off1", "off2", "off3", "t1", "t2", "t3"))):
        k = compile90(fn, kw, ptrs, ints, scalings=fn is kernels._expand_kernel)
        ptx = k.asm["ptx"]
        out.append({"S": S, "R": R, "kernel": fn.fn.__name__, "shared": k.metadata.shared,
                    "mma": "mma.sync" in ptx or "wgmma" in ptx, "acquire": True, "release": True,
                    "gdc": "griddepcontrol" in ptx})
print(json.dumps(out))
'''


def test_fused_kernel_compiles_for_sm90():
    """The one-launch kernel compiles for an H100/H200 (sm90) on this GPU-less machine (triton.compile to a cubin,
    ptxas included, without the interpreter) at the Llama-3-8B module shapes, bf16, with PDL: tensor-core dots,
    the acquire/release counters and griddepcontrol are in the PTX."""
    pytest.importorskip("triton.backends.nvidia")
    for k in compile_for_sm90(_AOT):
        assert k["mma"] and k["acquire"] and k["release"] and k["gdc"], k
        assert 0 < k["shared"] <= 227 * 1024


# ---- GPU ----

@pytest.mark.gpu
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("shape", ["qkv", "gate_up", "down"])
def test_gpu_fused_bits_llama_bf16(monkeypatch, shape, rank):
    """Llama-3-8B shapes, bf16, decode batches 1 / 16 / 64 over 32 slots: fused == two launches, bit for bit,
    right against float64, counters back to zero."""
    in_dim, widths = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)),
                      "down": (14336, (4096,))}[shape]
    for n in (1, 16, 64):
        rng = np.random.default_rng([n, rank, len(widths)])
        case = make_case(rng, num_slots=32, max_rank=rank, ranks=[rank] * 32, slice_widths=widths, in_dim=in_dim,
                         seg_lens=[1] * n, dtype=torch.bfloat16, device="cuda", no_lora_frac=0.1)
        _set(monkeypatch, dict(plan.TABLE), OFF)
        two = _apply(case)
        _set(monkeypatch, dict(plan.TABLE), ON)
        one = _apply(case)
        torch.cuda.synchronize()
        assert torch.equal(one, two), f"bits differ at batch {n}"
        ref = RowLoop(case, case.info)
        v_ref, _ = ref.shrink()
        assert rel_err(one, ref.expand(v_ref.nan_to_num(0), case.base)) <= TOL[torch.bfloat16]
        assert _counters_zero("cuda")
    plan.clear_cache()


@pytest.mark.gpu
def test_gpu_fused_graph_replay(monkeypatch):
    """Captured once with a graph-mode builder, replayed for batches of other sizes and slots: equal to eager."""
    _set(monkeypatch, dict(plan.TABLE), ON)
    rng = np.random.default_rng(9)
    in_dim, widths, R, slots_n, cap = 1024, (512, 256), 16, 8, 64
    offs = (0, 512, 768)
    a = (torch.randn(slots_n, 2 * R, in_dim, device="cuda") * in_dim ** -0.5).bfloat16()
    b = (torch.randn(slots_n, offs[-1], R, device="cuda") * R ** -0.5).bfloat16()
    ranks = torch.full((slots_n,), R, dtype=torch.int32, device="cuda")
    scal = torch.rand(slots_n, device="cuda") + 0.5
    builder = lk.BatchInfoBuilder(cap, cap, ranks, scal, cuda_graph=True)
    x = torch.randn(cap, in_dim, device="cuda").bfloat16()
    out = torch.randn(cap, offs[-1], device="cuda").bfloat16()
    info = builder.build([1] * 4, [0, 1, 2, 3])
    lk.apply_lora(x, out.clone(), a, b, info, offs, backend="triton")  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    base = out.clone()
    work = out.clone()
    with torch.cuda.graph(g):
        lk.apply_lora(x, work, a, b, info, offs, backend="triton")
    for n in (1, 7, 64, 3):
        slots = [int(s) for s in rng.integers(-1, slots_n, n)]
        new = builder.build([1] * n, slots)
        assert builder.graph_family(new) == builder.graph_family(info)
        work.copy_(base)
        g.replay()
        eager = base.clone()
        lk.apply_lora(x, eager, a, b, new, offs, backend="triton")
        torch.cuda.synchronize()
        assert torch.equal(work, eager)
        assert _counters_zero("cuda")
    plan.clear_cache()
