"""The `cuda` backend (the compiled extension's fast kernels) vs float64 ground truth on the GPU.

Covers both kernel families: CUDA-core kernels (segments of <= 8 rows, fp32, rows that are not
16-byte aligned) and tensor-core kernels (longer fp16/bf16 segments with aligned dims), over adapter
popularity, permutations, odd sizes, capacity-padded infos, Llama-3-8B shapes, stale weights beyond
the rank, CUDA-graph replay (bit-equal to eager), determinism and opcheck. On a CPU-only machine only
the opcheck of the fused op's CPU kernel runs.
"""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import (POPULARITY, TOL, llama_case, make_case, make_info, popularity_slots, rel_err, rowloop_expand,
                   rowloop_shrink)
from lora_kernels import reference

HAS_EXT = lk.HAS_CUDA_EXT
GPU = pytest.mark.gpu
pytestmark = pytest.mark.skipif(not HAS_EXT, reason="CUDA extension not built")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _poison_stale(case):
    """NaN in every weight entry beyond each slot's rank: kernels must never let it reach an output."""
    R = case.max_rank
    for slot, r in enumerate(case.ranks):
        for i in range(case.num_slices):
            case.lora_a[slot, i * R + r:(i + 1) * R] = float("nan")
        case.lora_b[slot, :, r:] = float("nan")
    return case


def _untouched(case):
    mask = torch.ones(case.x.shape[0], dtype=torch.bool)
    for t, slot in zip(case.perm, np.repeat(case.slots, case.seg_lens)):
        if 0 <= slot < len(case.ranks) and case.ranks[slot] > 0:
            mask[t] = False
    return mask.to(case.x.device)


def _truth_small(case, info):
    v_ref, covered = rowloop_shrink(case)
    return v_ref, covered, lambda v, base: rowloop_expand(case, v, base)


def _truth_large(case, info):
    """reference.py in float64 (itself checked against the row loop in test_reference.py)."""
    c, dev = case, case.x.device
    args = (info.seg_indptr, info.weight_indices, info.lora_ranks)
    v = torch.full((c.x.shape[0], c.lora_a.shape[1]), float("nan"), dtype=torch.float64, device=dev)
    reference.sgmv_shrink(c.x.double(), c.lora_a.double().nan_to_num(0), *args, info.permutation, c.num_slices, v)
    covered = torch.zeros(c.x.shape[0], dtype=torch.bool)
    covered[c.perm] = True

    def expand(v_in, base):
        out = base.double().clone()
        reference.sgmv_expand(v_in.double().to(dev), c.lora_b.double().nan_to_num(0), *args, info.scalings,
                              info.permutation, c.slice_offsets, out)
        return out.cpu()

    return v.cpu(), covered, expand


def check_case(case, info=None, truth=_truth_small, v_dtype=torch.float32):
    """shrink (into a NaN-poisoned v), expand (given v), apply; untouched rows stay bit-identical."""
    info = info or case.info
    tol = TOL[case.x.dtype]
    dev = case.x.device
    v_ref, covered, expand_ref = truth(case, info)
    cov = covered.to(dev)

    v = torch.full((case.x.shape[0], case.lora_a.shape[1]), float("nan"), dtype=v_dtype, device=dev)
    lk.sgmv_shrink(case.x, case.lora_a, info, case.num_slices, out=v, backend="cuda")
    assert torch.isnan(v[~cov]).all(), "shrink wrote rows outside every segment"
    if covered.any():
        shrink_tol = tol * 0.1 + 1e-12 if v_dtype == torch.float32 else TOL[v_dtype]
        assert rel_err(v[cov], v_ref[covered]) <= shrink_tol
        zero = (v_ref[covered] == 0).to(dev)  # columns >= rank and rows of slot -1: exactly 0
        assert (v[cov][zero] == 0).all()

    untouched = _untouched(case)
    v_in = torch.randn(case.x.shape[0], case.lora_a.shape[1], device=dev).to(v_dtype)
    out = case.base.clone()
    lk.sgmv_expand(v_in, case.lora_b, info, case.slice_offsets, out, backend="cuda")
    assert rel_err(out, expand_ref(v_in.float(), case.base)) <= tol
    assert torch.equal(out[untouched], case.base[untouched]), "expand changed rows it must not touch"

    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, info, case.slice_offsets, backend="cuda")
    assert rel_err(out, expand_ref(v_ref.nan_to_num(0), case.base)) <= tol
    assert torch.equal(out[untouched], case.base[untouched]), "apply_lora changed rows it must not touch"
    if v_dtype == torch.float32:  # the fused op is shrink + expand through an fp32 v, bit for bit
        v2 = torch.empty_like(v)
        lk.sgmv_shrink(case.x, case.lora_a, info, case.num_slices, out=v2, backend="cuda")
        out2 = case.base.clone()
        lk.sgmv_expand(v2, case.lora_b, info, case.slice_offsets, out2, backend="cuda")
        assert torch.equal(out, out2)


def _capacity_info(case, cap_segments, max_seg_len):
    return make_info(case.seg_lens, case.slots, case.perm if case.info.permutation is not None else None,
                     case.info.lora_ranks, case.info.scalings, case.x.device, cap_segments=cap_segments,
                     max_seg_len=max_seg_len)


def _popularity_case(rng, pop, dtype, permute, n_seg=6, max_len=5, num_slots=5, **kw):
    seg_lens = [int(v) for v in rng.integers(1, max_len + 1, n_seg)]
    slots = [int(s) for s in popularity_slots(pop, n_seg, num_slots, rng)]
    slots[int(rng.integers(n_seg))] = -1  # always one segment without LoRA
    return make_case(rng, num_slots=num_slots, seg_lens=seg_lens, slots=slots, dtype=dtype, device="cuda",
                     permute=permute, extra_rows=2, **kw)


# Shapes that reach each kernel family: (max_len, in_dim, R, widths); "aligned long" takes the
# tensor-core path for fp16/bf16, the others the CUDA-core path (16-byte or scalar loads).
FAMILIES = {
    "decode_aligned": (1, 64, 16, (40, 8, 16)),
    "short_aligned": (5, 128, 32, (64, 32)),
    "long_aligned": (70, 96, 16, (136, 64, 8)),
    "long_rank_chunks": (150, 64, 136, (24, 128)),
    "odd": (40, 37, 5, (9, 0, 7)),
}


@GPU
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("pop", POPULARITY)
@pytest.mark.parametrize("dtype", DTYPES)
def test_popularity_families(dtype, pop, permute, family):
    max_len, in_dim, R, widths = FAMILIES[family]
    rng = np.random.default_rng([DTYPES.index(dtype), POPULARITY.index(pop), permute, list(FAMILIES).index(family)])
    case = _popularity_case(rng, pop, dtype, permute, max_len=max_len, max_rank=R, slice_widths=widths,
                            in_dim=in_dim)
    check_case(_poison_stale(case), truth=_truth_small if max_len < 100 else _truth_large)


@GPU
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_sizes(seed, dtype):
    """Nothing a multiple of 8: scalar-load kernels; up to 4 slices, one of width 0."""
    rng = np.random.default_rng([200 + seed, DTYPES.index(dtype)])
    widths = [int(w) for w in rng.choice([1, 7, 33, 129], int(rng.integers(1, 5)))]
    if seed == 3:
        widths = [9, 0, 5]
    case = make_case(rng, num_slots=4, max_rank=int(rng.choice([1, 5, 24, 33])), slice_widths=tuple(widths),
                     in_dim=int(rng.choice([1, 19, 111, 2049])),
                     seg_lens=[int(v) for v in rng.integers(0, 30, 4)], dtype=dtype, device="cuda",
                     permute=bool(seed % 2), extra_rows=1)
    check_case(_poison_stale(case))


@GPU
@pytest.mark.parametrize("dtype", DTYPES)
def test_v_in_input_dtype(dtype):
    """v may be the input dtype instead of fp32, on both kernel families."""
    for max_len in (1, 80):
        rng = np.random.default_rng([300 + max_len, DTYPES.index(dtype)])
        case = _popularity_case(rng, "uniform", dtype, True, max_len=max_len, max_rank=16, slice_widths=(64, 32),
                                in_dim=128)
        check_case(case, v_dtype=dtype)


@GPU
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_capacity_infos(dtype):
    """Graph-mode infos: padded slot -1 segments; decode (max_seg_len 1) and general (= token capacity)."""
    rng = np.random.default_rng([400, DTYPES.index(dtype)])
    n = 9
    slots = [int(s) for s in popularity_slots("uniform", n, 4, rng)]
    slots[2] = -1
    case = make_case(rng, num_slots=4, ranks=[3, 16, 0, 9], max_rank=16, slice_widths=(24, 8, 8), in_dim=40,
                     seg_lens=[1] * n, slots=slots, dtype=dtype, device="cuda", extra_rows=3)
    check_case(_poison_stale(case), _capacity_info(case, cap_segments=14, max_seg_len=1))
    case = make_case(rng, num_slots=3, max_rank=16, slice_widths=(64, 32), in_dim=64, seg_lens=[37, 0, 2, 90],
                     slots=[1, 0, -1, 2], dtype=dtype, device="cuda", permute=True, extra_rows=5)
    check_case(_poison_stale(case), _capacity_info(case, cap_segments=6, max_seg_len=case.x.shape[0]))


@GPU
@pytest.mark.parametrize("max_len", [1, 64])
def test_slot_out_of_range_is_no_lora(max_len):
    """A slot >= num_slots (which the builder rejects) acts like -1 on the device: no illegal access."""
    rng = np.random.default_rng(500 + max_len)
    case = make_case(rng, num_slots=3, max_rank=16, slice_widths=(32,), in_dim=64, seg_lens=[max_len, max_len],
                     slots=[1, 0], dtype=torch.bfloat16, device="cuda")
    info = make_info(case.seg_lens, [7, 0], None, case.info.lora_ranks, case.info.scalings, "cuda")
    v = torch.full((case.x.shape[0], 16), float("nan"), device="cuda")
    lk.sgmv_shrink(case.x, case.lora_a, info, 1, out=v, backend="cuda")
    assert (v[:max_len] == 0).all() and not torch.isnan(v[max_len:]).any()
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, info, case.slice_offsets, backend="cuda")
    torch.cuda.synchronize()
    assert torch.equal(out[:max_len], case.base[:max_len]) and not torch.equal(out[max_len:], case.base[max_len:])


@GPU
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("shape", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("batch", ["decode1", "decode64", "prefill"])
def test_llama_shapes_bf16(batch, shape, rank):
    """Llama-3-8B module shapes in bf16 in each regime, mixed ranks (stale weights poisoned)."""
    check_case(_poison_stale(llama_case(batch, shape, rank)), truth=_truth_large)


def _static_info(cap_segments, cap_tokens, lora_ranks, scalings, max_seg_len, with_perm):
    dev = lora_ranks.device
    return lk.LoRABatchInfo(
        seg_lens=torch.zeros(cap_segments, dtype=torch.int32, device=dev),
        seg_indptr=torch.zeros(cap_segments + 1, dtype=torch.int32, device=dev),
        weight_indices=torch.full((cap_segments,), -1, dtype=torch.int32, device=dev),
        permutation=torch.arange(cap_tokens, dtype=torch.int32, device=dev) if with_perm else None,
        num_segments=cap_segments, max_seg_len=max_seg_len, num_tokens=cap_tokens, lora_ranks=lora_ranks,
        scalings=scalings)


def _load_batch(info, seg_lens, slots, perm):
    """Writes a batch into the static metadata tensors in place (addresses unchanged)."""
    cap = info.weight_indices.shape[0]
    lens = torch.zeros(cap, dtype=torch.int32)
    lens[:len(seg_lens)] = torch.tensor(seg_lens, dtype=torch.int32)
    wi = torch.full((cap,), -1, dtype=torch.int32)
    wi[:len(slots)] = torch.tensor(slots, dtype=torch.int32)
    info.seg_lens.copy_(lens)
    info.seg_indptr.copy_(torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]))
    info.weight_indices.copy_(wi)
    if info.permutation is not None:
        info.permutation.copy_(torch.tensor(perm, dtype=torch.int32))


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["decode", "general"])
def test_cuda_graph_replay_equals_eager(mode, dtype):
    """Capture shrink, expand and apply once; replay for 3 different batches; bit-equal to eager."""
    rng = np.random.default_rng([600, mode == "decode", dtype == torch.float32])
    cap_seg, cap_tok, R, widths, in_dim = 16, 160, 16, (128, 64), 256
    decode = mode == "decode"
    case = make_case(rng, num_slots=6, max_rank=R, slice_widths=widths, in_dim=in_dim, seg_lens=[cap_tok],
                     slots=[0], dtype=dtype, device="cuda")
    x, a, b = case.x, _poison_stale(case).lora_a, case.lora_b
    info = _static_info(cap_seg, cap_tok, case.info.lora_ranks, case.info.scalings, 1 if decode else cap_tok,
                        not decode)
    offs = case.slice_offsets
    v = torch.zeros(cap_tok, 2 * R, device="cuda")
    v_in = torch.randn(cap_tok, 2 * R, device="cuda")
    out_e, out_a = case.base.clone(), case.base.clone()

    def step():
        lk.sgmv_shrink(x, a, info, 2, out=v, backend="cuda")
        lk.sgmv_expand(v_in, b, info, offs, out_e, backend="cuda")
        lk.apply_lora(x, out_a, a, b, info, offs, backend="cuda")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for trial in range(3):
        n = int(rng.integers(1, cap_seg + 1))
        seg_lens = [1] * n if decode else [int(s) for s in rng.multinomial(cap_tok - 7, np.ones(n) / n)]
        slots = [int(s) for s in rng.integers(-1, 6, n)]
        perm = [int(p) for p in rng.permutation(cap_tok)]
        _load_batch(info, seg_lens, slots, perm)
        results = []
        for run in (graph.replay, step):
            v.fill_(float("nan"))
            out_e.copy_(case.base)
            out_a.copy_(case.base)
            run()
            torch.cuda.synchronize()
            results.append((v.clone(), out_e.clone(), out_a.clone()))
        for g, e in zip(*results):
            assert torch.equal(g.nan_to_num(7.0), e.nan_to_num(7.0)), f"trial {trial}: replay != eager"
        assert not torch.equal(results[1][2], case.base), "the batch changed nothing: the test cannot fail"


@GPU
@pytest.mark.parametrize("max_len", [1, 4, 600])
def test_deterministic_bits(max_len):
    """Identical bits over 10 runs with deterministic algorithms on (every kernel reduces in a fixed
    order, no atomics, so the default mode is the deterministic one)."""
    rng = np.random.default_rng(700 + max_len)
    case = make_case(rng, num_slots=4, max_rank=64, slice_widths=(512, 128), in_dim=2048,
                     seg_lens=[max_len, max_len, 1], slots=[0, 3, 1], dtype=torch.bfloat16, device="cuda",
                     permute=True)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        outs = []
        for _ in range(10):
            out = case.base.clone()
            lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="cuda")
            outs.append(out)
    finally:
        torch.use_deterministic_algorithms(prev)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert not torch.equal(outs[0], case.base)


@GPU
def test_unsupported_inputs_name_every_parameter():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(2, 16, 64, device="cuda", dtype=torch.bfloat16)
    info = make_info([4], [0], None, torch.tensor([8, 8], dtype=torch.int32, device="cuda"),
                     torch.ones(2, device="cuda"), "cuda")
    v = torch.zeros(4, 16, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"dtype=BFloat16 v dtype=Half max_rank=16 num_slices=1 in_dim=64"):
        torch.ops.lora_kernels.sgmv_shrink(x, a, info.seg_indptr, info.weight_indices, info.lora_ranks, None, 1, 4, v)
    big = torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="max rank R=lora_a.shape.1./num_slices=300 exceeds 256"):
        torch.ops.lora_kernels.sgmv_shrink(x, big, info.seg_indptr, info.weight_indices, info.lora_ranks, None, 1, 4,
                                           torch.zeros(4, 300, device="cuda"))


def _apply_args(device):
    case = make_case(np.random.default_rng(800), dtype=torch.float32, device=device, max_rank=8,
                     slice_widths=(16, 8), in_dim=32, seg_lens=[3, 1, 5], slots=[1, -1, 2], permute=True,
                     extra_rows=1)
    i = case.info
    return (case.x, case.lora_a, case.lora_b, i.seg_indptr, i.weight_indices, i.lora_ranks, i.scalings,
            i.permutation, list(case.slice_offsets), i.max_seg_len, case.base.clone())


def test_opcheck_apply_cpu():
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_apply.default, _apply_args("cpu"))


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_len", [1, 40])
def test_opcheck_cuda(dtype, max_len):
    """opcheck of every SGMV op on the GPU, on both kernel families."""
    rng = np.random.default_rng(900 + max_len)
    case = make_case(rng, dtype=dtype, device="cuda", max_rank=16, slice_widths=(64, 32), in_dim=64,
                     seg_lens=[max_len, 2, max_len], slots=[1, -1, 2], permute=True, extra_rows=1)
    i = case.info
    v = torch.zeros(case.x.shape[0], 32, device="cuda")
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_shrink.default,
                          (case.x, case.lora_a, i.seg_indptr, i.weight_indices, i.lora_ranks, i.permutation, 2,
                           i.max_seg_len, v))
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_expand.default,
                          (v + 1, case.lora_b, i.seg_indptr, i.weight_indices, i.lora_ranks, i.scalings,
                           i.permutation, list(case.slice_offsets), i.max_seg_len, case.base.clone()))
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_apply.default,
                          (case.x, case.lora_a, case.lora_b, i.seg_indptr, i.weight_indices, i.lora_ranks,
                           i.scalings, i.permutation, list(case.slice_offsets), i.max_seg_len, case.base.clone()))
