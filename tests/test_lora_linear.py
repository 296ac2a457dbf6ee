"""lora_linear / lora_linear_with: base layer + multi-LoRA delta in one op (lora_kernels/linear.py).

CPU: every mode against a float64 ground truth (F.linear + the per-row LoRA loop of cases.py) and against
F.linear + apply_lora in the torch backend, poisoned outputs, bias, the callable base, bad inputs.
GPU (marked gpu): the default backend, bitwise batch invariance, graph replay = eager, no host sync.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lora_kernels as lk
from cases import TOL, compile_for_sm90, make_case, make_info, rel_err, rowloop_expand, rowloop_shrink
from lora_kernels import linear

MODES = ["serial", "overlap", "delta", "fused", "first", "auto"]


def _layer(case, rng, bias: bool):
    """A random base weight (and bias) for the case's in_dim -> out_total."""
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))
    in_dim, out_total = case.x.shape[1], case.slice_offsets[-1]
    w = (torch.randn(out_total, in_dim, generator=g, dtype=torch.float64) * in_dim ** -0.5)
    b = torch.randn(out_total, generator=g, dtype=torch.float64) if bias else None
    dev, dt = case.x.device, case.x.dtype
    return w.to(dt).to(dev), None if b is None else b.to(dt).to(dev)


def _reference(case, w, b):
    """float64 x Wᵀ + bias + the per-row LoRA delta (rows outside every segment: the base alone)."""
    base = F.linear(case.x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu())
    v, _ = rowloop_shrink(case)
    return rowloop_expand(case, torch.nan_to_num(v), base)


CPU_CASES = {  # name: make_case kwargs
    "one_slice": dict(seg_lens=(3, 1, 5, 2), slice_widths=(40,), in_dim=48),
    "qkv_permuted_padded": dict(seg_lens=(4, 1, 1, 6), slice_widths=(32, 8, 8), in_dim=56, permute=True,
                                extra_rows=3),
    "gate_up_odd": dict(seg_lens=(7, 2), slice_widths=(19, 19), in_dim=33, max_rank=8),
    # Row tiles spanning several segments and segments spanning tiles, 4 slices, rows past every segment.
    "four_slices_long": dict(seg_lens=(20, 13, 1, 0, 9), slice_widths=(24, 8, 8, 16), in_dim=40, extra_rows=5),
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_equals_linear_plus_apply_lora(name, dtype, mode, bias):
    if mode == "fused" and dtype != torch.float32:
        pytest.skip("bf16 tl.dot is wrong in Triton's CPU interpreter: the fused GEMM's bf16 runs on the GPU tests")
    rng = np.random.default_rng([len(name), dtype.itemsize, MODES.index(mode), bias])
    case = make_case(rng, dtype=dtype, **CPU_CASES[name])
    w, b = _layer(case, rng, bias)
    out = torch.full((case.x.shape[0], case.slice_offsets[-1]), float("nan"), dtype=dtype)
    got = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, bias=b, out=out,
                         backend="torch", mode=mode)
    assert got is out
    assert rel_err(got, _reference(case, w, b)) <= TOL[dtype]
    # The plain composition in the same dtype: F.linear, then apply_lora (torch backend).
    plain = lk.apply_lora(case.x, F.linear(case.x, w, b), case.lora_a, case.lora_b, case.info, case.slice_offsets,
                          backend="torch")
    assert rel_err(got, plain) <= TOL[dtype]
    if dtype == torch.float32 or mode in ("serial", "overlap", "auto"):
        # The delta mode rounds the delta to the output dtype before adding it; fused rounds once at the end.
        assert rel_err(got, plain) <= 1e-6 if dtype == torch.float32 else torch.equal(got, plain)


@pytest.mark.parametrize("max_rank", [16, 48])  # 48: the epilogue's rank in two chunks of 32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tma", [True, False])
def test_fused_kernels(monkeypatch, tma, dtype, max_rank):
    """Both fused GEMMs (persistent TMA; pointer loads), fp32 under the interpreter, bf16 on a GPU."""
    if not torch.cuda.is_available() and (dtype != torch.float32 or not linear._fused_gemm()._INTERPRET):
        pytest.skip("needs a GPU (or TRITON_INTERPRET=1 for fp32: bf16 tl.dot is wrong in the interpreter)")
    fg = linear._fused_gemm()
    monkeypatch.setattr(fg, "USE_TMA", tma)
    used = []
    real = fg._tma_ok
    monkeypatch.setattr(fg, "_tma_ok", lambda *a: used.append(real(*a)) or used[-1])
    rng = np.random.default_rng([31, tma, dtype.itemsize, max_rank])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ranks = [max_rank, 40, 33, 1, 17, max_rank] if max_rank > 32 else None
    case = make_case(rng, seg_lens=(20, 13, 1, 0, 9), slice_widths=(24, 8, 8, 16), in_dim=40, extra_rows=5,
                     device=dev, dtype=dtype, max_rank=max_rank, ranks=ranks, slots=[0, 1, 2, 4, -1])
    w, b = _layer(case, rng, True)
    b = torch.stack([b, -b], dim=1)[:, 0]  # a strided bias view
    got = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, bias=b, mode="fused")
    assert used == [tma]
    assert rel_err(got, _reference(case, w, b)) <= TOL[dtype]


def test_lora_really_changes_rows():
    """A guard on the test above: the LoRA delta is a sizeable part of the output."""
    rng = np.random.default_rng(7)
    case = make_case(rng, no_lora_frac=0.0, **CPU_CASES["one_slice"])
    w, _ = _layer(case, rng, False)
    got = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="torch")
    assert rel_err(F.linear(case.x, w), got) > 0.05


def test_out_allocated_and_no_lora_rows_are_the_base():
    rng = np.random.default_rng(3)
    case = make_case(rng, seg_lens=(2, 3), slots=[-1, 1], slice_widths=(24,), in_dim=16, extra_rows=2)
    w, b = _layer(case, rng, True)
    for mode in MODES:
        y = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, bias=b,
                           backend="torch", mode=mode)
        base = F.linear(case.x, w, b)
        if mode == "fused":  # a Triton GEMM: the same base up to rounding
            assert rel_err(y[:2], base[:2]) <= 1e-5 and rel_err(y[5:], base[5:]) <= 1e-5
        else:
            assert torch.equal(y[:2], base[:2]) and torch.equal(y[5:], base[5:])  # slot -1 and padding rows
        assert rel_err(y[2:5], base[2:5]) > 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_callable_base(mode):
    """An engine's own base (here a per-channel int8-quantized GEMM) through lora_linear_with."""
    rng = np.random.default_rng([11, MODES.index(mode)])
    case = make_case(rng, seg_lens=(2, 5, 1), slice_widths=(16, 24), in_dim=40)
    w, _ = _layer(case, rng, False)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    wq = torch.round(w / scale).to(torch.int8)
    calls = []

    def base(x):
        calls.append(x)
        return F.linear(x, wq.to(x.dtype) * scale)

    got = lk.lora_linear_with(base, case.x, case.lora_a, case.lora_b, case.info, case.slice_offsets,
                              backend="torch", mode=mode)
    assert len(calls) == 1 and calls[0] is case.x
    ref = _reference(case, wq.double() * scale.double(), None)
    assert rel_err(got, ref) <= TOL[torch.float32]


def test_pick_mode_reads_the_table(monkeypatch):
    monkeypatch.setattr(linear, "TABLE", [(16, 1, "serial"), (16, 64, "overlap"), (64, 2**31, "delta")])
    cuda = torch.device("cuda", 0)
    assert linear.pick_mode(1, 16, cuda) == "serial"
    assert linear.pick_mode(64, 8, cuda) == "overlap"
    assert linear.pick_mode(65, 16, cuda) == "delta"
    assert linear.pick_mode(5, 128, cuda) == "delta"  # beyond every row: the last entry
    assert linear.pick_mode(1, 16, torch.device("cpu")) == "serial"


# ---- bad inputs ----

def _small():
    rng = np.random.default_rng(5)
    case = make_case(rng, seg_lens=(2, 3), slice_widths=(24,), in_dim=16)
    w, b = _layer(case, rng, True)
    return case, w, b


def _call(case, w, **kw):
    return lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="torch", **kw)


@pytest.mark.parametrize("what, match", [
    ("weight_in_dim", r"weight must have shape \[out_total, 16\]"),
    ("weight_out_total", r"weight has 30 output rows"),
    ("weight_dtype", r"weight must have dtype"),
    ("weight_device", r"weight must be on cpu"),
    ("weight_1d", r"weight must be 2-D"),
    ("bias_shape", r"bias must have shape \(24,\)"),
    ("bias_dtype", r"bias must have dtype"),
    ("out_shape", r"out must have shape \(5, 24\)"),
    ("out_dtype", r"out must have dtype"),
    ("out_aliases_x", r"out .* overlaps x"),
    ("out_aliases_weight", r"out .* overlaps weight"),
    ("mode", r"mode must be one of"),
    ("rank_mismatch", r"lora_a has 16 rows but num_slices\*R"),
])
def test_bad_input(what, match):
    case, w, b = _small()
    kw = {}
    T, out_total = case.x.shape[0], case.slice_offsets[-1]
    if what == "weight_in_dim":
        w = torch.randn(out_total, 17)
    elif what == "weight_out_total":
        w = torch.randn(30, 16)
    elif what == "weight_dtype":
        w = w.double()
    elif what == "weight_device":
        w = torch.empty(out_total, 16, device="meta")
    elif what == "weight_1d":
        w = w.flatten()
    elif what in ("bias_shape", "bias_dtype"):
        kw["bias"] = b[:-1] if what == "bias_shape" else b.double()
    elif what in ("out_shape", "out_dtype"):
        kw["out"] = torch.empty(T, out_total + 1) if what == "out_shape" else torch.empty(T, out_total).half()
    elif what == "out_aliases_x":
        buf = torch.randn(T * 16 + T * out_total)
        case.x = buf[: T * 16].view(T, 16).copy_(case.x)
        kw["out"] = buf[8 : 8 + T * out_total].view(T, out_total)  # starts inside x
    elif what == "out_aliases_weight":
        kw["out"] = w.view(-1)[: T * out_total].view(T, out_total)
    elif what == "mode":
        kw["mode"] = "fastest"
    elif what == "rank_mismatch":
        case.lora_b = case.lora_b[:, :, :8].contiguous()
    with pytest.raises((ValueError, TypeError), match=match):
        _call(case, w, **kw)


def test_bad_callable_base():
    case, w, _ = _small()
    args = (case.x, case.lora_a, case.lora_b, case.info, case.slice_offsets)
    with pytest.raises(TypeError, match="base must be callable"):
        lk.lora_linear_with(w, *args, backend="torch")
    for mode in ("serial", "overlap"):
        with pytest.raises(ValueError, match=r"base\(x\) must be \[5, out_total\]"):
            lk.lora_linear_with(lambda x: F.linear(x, w)[:3], *args, backend="torch", mode=mode)
        with pytest.raises(ValueError, match=r"slice_offsets must rise from 0 to out_total=23"):
            lk.lora_linear_with(lambda x: F.linear(x, w)[:, :23].contiguous(), *args, backend="torch", mode=mode)
        with pytest.raises(ValueError, match=r"base\(x\) .* overlaps x"):
            lk.lora_linear_with(lambda x: x.view(-1)[:40].view(5, 8), case.x, case.lora_a,
                                case.lora_b[:, :8].contiguous(), case.info, (0, 8), backend="torch", mode=mode)


# ---- GPU ----

def _gpu_problem(rng, dtype, in_dim=512, widths=(384, 128, 128), rank=16, num_slots=8):
    dev = "cuda"
    offs = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
    S = len(widths)
    g = torch.Generator(device=dev).manual_seed(int(rng.integers(2**31)))
    w = (torch.randn(offs[-1], in_dim, device=dev, generator=g) * in_dim ** -0.5).to(dtype)
    a = (torch.randn(num_slots, S * rank, in_dim, device=dev, generator=g) * in_dim ** -0.5).to(dtype)
    b = (torch.randn(num_slots, offs[-1], rank, device=dev, generator=g) * rank ** -0.5).to(dtype)
    ranks = torch.tensor([rank, 3, rank, 0, 7, rank, 1, rank][:num_slots], dtype=torch.int32, device=dev)
    scal = torch.tensor(rng.uniform(0.5, 2.0, num_slots), dtype=torch.float32, device=dev)
    return w, a, b, ranks, scal, offs


def _decode_info(slots, ranks, scal):
    return make_info([1] * len(slots), list(slots), None, ranks, scal, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_reference(dtype, mode, permute):
    rng = np.random.default_rng([dtype.itemsize, MODES.index(mode), permute])
    case = make_case(rng, num_slots=8, max_rank=16, slice_widths=(256, 64, 72), in_dim=328,
                     seg_lens=(1, 1, 7, 1, 133, 2, 0, 300), dtype=dtype, device="cuda", permute=permute, extra_rows=4)
    w, b = _layer(case, rng, True)
    out = torch.full((case.x.shape[0], case.slice_offsets[-1]), float("nan"), dtype=dtype, device="cuda")
    got = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, bias=b, out=out, mode=mode)
    torch.cuda.synchronize()
    assert rel_err(got, _reference(case, w, b)) <= TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["serial", "overlap", "delta", "fused"])
def test_gpu_batch_invariance_same_size(mode):
    """Probe rows keep their position and adapter; every other row (data, adapter) changes: bitwise equal."""
    rng = np.random.default_rng([21, len(mode)])
    T, dtype = 64, torch.bfloat16
    w, a, b, ranks, scal, offs = _gpu_problem(rng, dtype)
    probe = np.sort(rng.choice(T, 9, replace=False))
    x_probe = torch.randn(len(probe), w.shape[1], device="cuda").to(dtype)
    slots_probe = rng.integers(-1, 8, len(probe))
    outs = []
    for trial in range(4):
        slots = rng.integers(-1, 8, T)
        slots[probe] = slots_probe
        x = torch.randn(T, w.shape[1], device="cuda").to(dtype)
        x[torch.from_numpy(probe).cuda()] = x_probe
        y = lk.lora_linear(x, w, a, b, _decode_info(slots, ranks, scal), offs, mode=mode)
        outs.append(y[torch.from_numpy(probe).cuda()])
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["serial", "overlap", "delta"])
def test_gpu_batch_invariance_across_sizes(mode):
    """With a row-wise base (batch-invariant by construction), a row's output is the same in batches of
    different sizes, positions and companions: the LoRA path adds no batch dependence. (cuBLAS itself
    may pick other kernels for other row counts, so lora_linear's invariance across sizes is cuBLAS's.)"""
    rng = np.random.default_rng([22, len(mode)])
    dtype = torch.bfloat16
    w, a, b, ranks, scal, offs = _gpu_problem(rng, dtype)
    out_total, in_dim = w.shape
    x_probe = torch.randn(3, in_dim, device="cuda").to(dtype)
    slots_probe = [0, 5, 2]

    def base(x):  # row-wise: y[t] depends on x[t] only, elementwise
        return (x.repeat(1, -(-out_total // in_dim))[:, :out_total] * 1.5).contiguous()

    outs = []
    for T in (3, 17, 64, 200):
        pos = rng.choice(T, 3, replace=False)
        slots = rng.integers(-1, 8, T)
        slots[pos] = slots_probe
        x = torch.randn(T, in_dim, device="cuda").to(dtype)
        x[torch.from_numpy(pos).cuda()] = x_probe
        y = lk.lora_linear_with(base, x, a, b, _decode_info(slots, ranks, scal), offs, mode=mode)
        outs.append(y[torch.from_numpy(pos).cuda()])
    for y in outs[1:]:
        assert torch.equal(y, outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["serial", "overlap", "delta", "fused"])
def test_gpu_graph_replay_equals_eager_and_no_sync(mode):
    rng = np.random.default_rng([23, len(mode)])
    T, dtype = 48, torch.bfloat16
    w, a, b, ranks, scal, offs = _gpu_problem(rng, dtype)
    bias = torch.randn(w.shape[0], device="cuda").to(dtype)
    builder = lk.BatchInfoBuilder(T, T, ranks, scal, cuda_graph=True)
    x = torch.randn(T, w.shape[1], device="cuda").to(dtype)
    out = torch.empty(T, w.shape[0], device="cuda", dtype=dtype)
    info = builder.build([1] * T, [int(s) for s in rng.integers(-1, 8, T)])

    def step():
        lk.lora_linear(x, w, a, b, info, offs, bias=bias, out=out, mode=mode)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        builder.build([1] * T, [int(s) for s in rng.integers(-1, 8, T)])  # same static tensors, new slots
        x.normal_()
        out.fill_(float("nan"))
        graph.replay()
        replayed = out.clone()
        out.fill_(float("nan"))
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()  # eager, with the host-sync check on
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(replayed, out)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any()


_AOT = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lora_kernels import fused_gemm as fg

def common(dt):
    return {"bias_ptr": f"*{dt}", "v_ptr": "*fp32", "b_ptr": f"*{dt}", "seg_indptr": "*i32", "weight_indices": "*i32",
            "lora_ranks": "*i32", "scalings": "*fp32", "M": "i32", "N": "i32", "K": "i32", "cap": "i32",
            "NR": "i32", "R": "i32", "o1": "i32", "o2": "i32", "o3": "i32"}

out = []
for tma, S, block_r, bias in [(True, 3, 16, False), (True, 1, 64, True), (False, 2, 64, True)]:
    cfg = dict(fg._config(torch.bfloat16, 6144, 4096, block_r, tma))
    nw, ns = cfg.pop("num_warps"), cfg.pop("num_stages")
    consts = dict(HAS_BIAS=bias, S=S, DOT_PREC="tf32", BLOCK_R=block_r, R_CHUNK=min(block_r, 32), **cfg)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if tma:
        sig = {"x_desc": f"tensordesc<bf16[{bm}, {bk}]>", "w_desc": f"tensordesc<bf16[{bn}, {bk}]>",
               "out_desc": f"tensordesc<bf16[{bm}, {bn}]>", **common("bf16")}
        consts["NUM_PROGRAMS"] = 132
        fn = fg._gemm_lora_tma_kernel
    else:
        c = list(common("bf16").items())
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", **dict(c[:3]), "out_ptr": "*bf16", **dict(c[3:])}
        fn = fg._gemm_lora_kernel
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": nw, "num_stages": ns})
    out.append({"tma": tma, "shared": k.metadata.shared, "wgmma": "wgmma" in k.asm["ptx"],
                "tma_ops": "cp.async.bulk.tensor" in k.asm["ptx"]})
print(json.dumps(out))
'''


def test_fused_gemm_compiles_for_sm90():
    """The fused GEMMs compile for an H100/H200 (sm90) on this GPU-less machine: triton.compile to a cubin
    (ptxas included) in a subprocess without the interpreter; the TMA kernel uses wgmma and TMA and fits
    the 227 KB of shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    kernels = compile_for_sm90(_AOT)
    for k in kernels:
        assert k["wgmma"] and 0 < k["shared"] <= 227 * 1024
        assert k["tma_ops"] == k["tma"]


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("group", [1, 4])
def test_first_mode_writes_the_delta_then_adds_the_base(monkeypatch, permute, group):
    """mode "first" on the Triton tall path: the expand stores the delta into out without reading it (out starts
    as NaN, so a read would show), rows of slot -1 and of a rank-0 slot get 0, then addmm adds x Wᵀ. fp32 under
    the interpreter, bf16 on a GPU; against float64 and against F.linear + apply_lora."""
    from lora_kernels import backends
    from lora_kernels.backends.triton import plan

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if backends.unavailable("triton", dev) is not None:
        pytest.skip("Triton backend unavailable")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**plan.tall_config(), "min_rows": 1, "min_rank": 0,
                                                               "dense_tiles": 0, "min_items": 0,
                                                               "shrink_group": group, "expand_group": group,
                                                               "expand_group_wide": group}})
    plan.clear_cache()
    rng = np.random.default_rng([41, permute, group])
    case = make_case(rng, num_slots=5, max_rank=16, ranks=[16, 0, 5, 16, 9], slice_widths=(32, 16, 16), in_dim=48,
                     seg_lens=(20, 13, 1, 0, 17, 9), slots=[0, 1, -1, 2, 3, 4], dtype=dtype, device=dev,
                     permute=permute)
    w, _ = _layer(case, rng, False)
    out = torch.full((case.x.shape[0], case.slice_offsets[-1]), float("nan"), dtype=dtype, device=dev)
    got = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, out=out,
                         backend="triton", mode="first")
    assert got is out and torch.isfinite(got).all()
    assert rel_err(got.cpu(), _reference(case, w.cpu(), None)) <= TOL[dtype]
    plain = lk.apply_lora(case.x, F.linear(case.x, w), case.lora_a, case.lora_b, case.info, case.slice_offsets,
                          backend="triton")
    assert rel_err(got, plain) <= TOL[dtype]
    base = F.linear(case.x, w)
    no_lora = [p for p, s in zip(case.perm, [s for s, n in zip(case.slots, case.seg_lens) for _ in range(n)])
               if s in (-1, 1)]
    assert no_lora and torch.equal(got[no_lora], torch.addmm(torch.zeros_like(base[no_lora]), case.x[no_lora], w.t()))
    recipes = [k for k in plan._cache if k[0] == "delta"]
    assert len(recipes) == 1, "the first mode did not take the tall path"
    plan.clear_cache()


def test_first_mode_falls_back_where_it_cannot_run():
    """With a bias, or rows past every segment, "first" runs serial."""
    rng = np.random.default_rng(43)
    for extra, bias in ((3, False), (0, True)):
        case = make_case(rng, seg_lens=(4, 6), slice_widths=(24,), in_dim=16, extra_rows=extra)
        w, b = _layer(case, rng, bias)
        got = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, bias=b,
                             backend="torch", mode="first")
        want = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, bias=b,
                              backend="torch", mode="serial")
        assert torch.equal(got, want)
