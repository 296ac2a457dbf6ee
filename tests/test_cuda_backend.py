"""The `cuda` backend (the compiled extension's kernels over the builder's work list) vs float64 ground truth.

Covers both kernel families, chosen from shapes only: tensor-core kernels (fp16/bf16, 16-byte-aligned rows
and pointers; split-K shrink into fp32 planes summed in order) and CUDA-core kernels (fp32, odd sizes),
over adapter popularity, permutations, odd sizes, capacity-padded infos, Llama-3-8B shapes, stale weights
beyond the rank, CUDA-graph replay (bit-equal to eager), batch invariance (torch.equal of the same rows in
other batches), determinism and opcheck. On a CPU-only machine the CPU kernels of the schemas, their
opcheck, torch.compile(fullgraph=True) over the fake kernels, and the C++/Python limits are checked.
`-k small` selects the small-shape tests that scripts/sanitize.sh runs under compute-sanitizer.
"""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import (POPULARITY, TOL, batch_rows, llama_case, make_case, make_info, popularity_slots, rel_err,
                   rowloop_expand, rowloop_shrink)
from lora_kernels import reference
from lora_kernels.batch_info import TILE_M

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


# Shapes over both kernel families: (max_len, in_dim, R, widths); for fp16/bf16 all but "odd" take the
# tensor-core kernels ("long_rank_chunks": three rank slabs in the expand), fp32 the CUDA-core ones.
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
    """Nothing a multiple of 8: CUDA-core kernels with scalar loads; up to 4 slices, one of width 0."""
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
    """v may be the input dtype instead of fp32 (decode-sized and multi-tile segments)."""
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


def _graph_batches(rng, decode, cap_seg, cap_tok, num_slots):
    """Three batches of one graph family: decode (one row per request) or general (any counts)."""
    out = []
    for _ in range(3):
        n = int(rng.integers(1, cap_seg + 1))
        counts = [1] * n if decode else [int(c) for c in rng.multinomial(cap_tok - 7, np.ones(n) / n)]
        out.append((counts, [int(s) for s in rng.integers(-1, num_slots, n)]))
    return out


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["decode", "general", "sorted"])
def test_cuda_graph_replay_equals_eager(mode, dtype):
    """Capture shrink, expand and apply once with graph-mode infos; replay for 3 other batches of the
    family; bit-equal to eager calls on the same infos."""
    rng = np.random.default_rng([600, ["decode", "general", "sorted"].index(mode), dtype == torch.float32])
    cap_seg, cap_tok, R, widths, in_dim = 16, 160, 16, (128, 64), 1104  # in_dim 1104: 5 K splits (16-bit)
    case = make_case(rng, num_slots=6, max_rank=R, slice_widths=widths, in_dim=in_dim, seg_lens=[cap_tok],
                     slots=[0], dtype=dtype, device="cuda")
    x, a, b, offs = case.x, _poison_stale(case).lora_a, case.lora_b, case.slice_offsets
    builder = lk.BatchInfoBuilder(cap_tok, cap_seg, case.info.lora_ranks, case.info.scalings, cuda_graph=True)
    decode, sort = mode == "decode", mode == "sorted"
    batches = _graph_batches(rng, decode, cap_seg, cap_tok, 6)
    info = builder.build(*batches[0], sort_by_adapter=sort)
    v = torch.zeros(cap_tok, 2 * R, device="cuda")
    v_in = torch.randn(cap_tok, 2 * R, device="cuda")
    out_e, out_a = case.base.clone(), case.base.clone()

    def step(inf):
        lk.sgmv_shrink(x, a, inf, 2, out=v, backend="cuda")
        lk.sgmv_expand(v_in, b, inf, offs, out_e, backend="cuda")
        lk.apply_lora(x, out_a, a, b, inf, offs, backend="cuda")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(info)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(info)
    for trial, (counts, slots) in enumerate(batches):
        info2 = builder.build(counts, slots, sort_by_adapter=sort)
        assert builder.graph_family(info2) == builder.graph_family(info)
        results = []
        for run in (graph.replay, lambda: step(info2)):
            v.fill_(float("nan"))
            out_e.copy_(case.base)
            out_a.copy_(case.base)
            run()
            torch.cuda.synchronize()
            results.append((v.clone(), out_e.clone(), out_a.clone()))
        for g, e in zip(*results):
            assert torch.equal(g.nan_to_num(7.0), e.nan_to_num(7.0)), f"trial {trial}: replay != eager"
        if any(s >= 0 and case.ranks[s] > 0 for s in slots):
            assert not torch.equal(results[1][2], case.base), "the batch changed nothing: the test cannot fail"


def _invariance_weights(rng, dtype, in_dim, widths, R, num_slots):
    offs = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
    a = (torch.randn(num_slots, len(widths) * R, in_dim, device="cuda") * in_dim ** -0.5).to(dtype)
    b = (torch.randn(num_slots, offs[-1], R, device="cuda") * R ** -0.5).to(dtype)
    ranks = torch.tensor([int(rng.integers(1, R + 1)) for _ in range(num_slots)], dtype=torch.int32, device="cuda")
    return a, b, ranks, torch.rand(num_slots, device="cuda") + 0.5, offs


def _invariance_batch(rng, builder_args, T, target, xt, bt, sort, graph):
    """x, out (rows under test at `where`) and the info of one batch of T decode requests."""
    ranks, scal, num_slots, in_dim, out_total, dtype = builder_args
    T = max(T, len(target))  # the rows under test need a place each (a "batch of 1" holds 3 requests)
    slots, where = batch_rows(rng, T, num_slots, target)
    cap = max(T, 256) if graph else T
    builder = lk.BatchInfoBuilder(cap, cap, ranks, scal, cuda_graph=graph)
    info = builder.build([1] * T, slots, sort_by_adapter=sort)
    rows = max(info.num_tokens, T)
    x = torch.randn(rows, in_dim, device="cuda").to(dtype)
    out = torch.randn(rows, out_total, device="cuda").to(dtype)
    w = torch.as_tensor(where, device="cuda")
    x[w], out[w] = xt, bt
    return x, out, info, w


@GPU
@pytest.mark.parametrize("shape", ["qkv", "down", "odd_fp32"])
def test_batch_invariance(shape):
    """The same 3 rows inside decode batches of 1..256 requests (shuffled, sorted or not, eager infos,
    graph-mode infos and a graph replay) give bit-identical outputs (torch.equal), for apply and shrink."""
    in_dim, widths, R, dtype = {"qkv": (4096, (4096, 1024, 1024), 16, torch.bfloat16),
                                "down": (14336, (4096,), 64, torch.bfloat16),
                                "odd_fp32": (111, (33, 9), 5, torch.float32)}[shape]
    rng = np.random.default_rng([22, len(shape)])
    num_slots = 32
    a, b, ranks, scal, offs = _invariance_weights(rng, dtype, in_dim, widths, R, num_slots)
    target = [int(s) for s in rng.integers(0, num_slots, 3)]
    xt = torch.randn(3, in_dim, device="cuda").to(dtype)
    bt = torch.randn(3, offs[-1], device="cuda").to(dtype)
    args = (ranks, scal, num_slots, in_dim, offs[-1], dtype)
    outs, vs = [], []
    for k, T in enumerate((1, 16, 64, 256, 100)):
        for sort in (False, True):
            x, out, info, w = _invariance_batch(rng, args, T, target, xt, bt, sort, graph=k in (1, 3))
            lk.apply_lora(x, out, a, b, info, offs, backend="cuda")
            outs.append(out[w])
            vs.append(lk.sgmv_shrink(x, a, info, len(widths), backend="cuda")[w])
    # graph replay: captured on one batch, replayed on another batch of the same family
    x, out, info, w = _invariance_batch(rng, args, 64, target, xt, bt, False, graph=True)
    x2, out2, info2, w2 = _invariance_batch(rng, args, 200, target, xt, bt, False, graph=True)
    lk.apply_lora(x, out.clone(), a, b, info, offs, backend="cuda")  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    saved = out2.clone()
    with torch.cuda.graph(g):
        lk.apply_lora(x, out, a, b, info, offs, backend="cuda")
    x.copy_(x2)
    out.copy_(saved)
    info.work.copy_(info2.work)  # the same static buffers: what the builder's next build writes
    g.replay()
    outs.append(out[w2])
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    for v in vs[1:]:
        assert torch.equal(v, vs[0])
    assert not torch.equal(outs[0], bt), "the rows under test did not change: the test cannot fail"


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


def _work(info):
    return info.work, info.lora_ranks, info.permutation


@GPU
def test_unsupported_inputs_name_every_parameter():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(2, 16, 64, device="cuda", dtype=torch.bfloat16)
    info = make_info([4], [0], None, torch.tensor([8, 8], dtype=torch.int32, device="cuda"),
                     torch.ones(2, device="cuda"), "cuda")
    v = torch.zeros(4, 16, device="cuda", dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"dtype=BFloat16 v dtype=Half max_rank=16 num_slices=1 in_dim=64"):
        torch.ops.lora_kernels.sgmv_shrink(x, a, *_work(info), 1, info.max_tiles, v)
    big = torch.randn(2, 300, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="max rank R=lora_a.shape.1./num_slices=300 exceeds 256"):
        torch.ops.lora_kernels.sgmv_shrink(x, big, *_work(info), 1, info.max_tiles, torch.zeros(4, 300, device="cuda"))
    with pytest.raises(RuntimeError, match="work must have 1 \\+ 3\\*max_tiles = 7 entries"):
        torch.ops.lora_kernels.sgmv_shrink(x, a, *_work(info), 1, 2, torch.zeros(4, 16, device="cuda"))


def _apply_args(device, dtype=torch.float32, seg_lens=(3, 1, 5), slots=(1, -1, 2), cap_segments=None):
    case = make_case(np.random.default_rng(800), dtype=dtype, device=device, max_rank=8, slice_widths=(16, 8),
                     in_dim=32, seg_lens=list(seg_lens), slots=list(slots), permute=True, extra_rows=3)
    i = case.info
    if cap_segments:
        i = _capacity_info(case, cap_segments, case.x.shape[0])
    return case, (case.x, case.lora_a, case.lora_b, *_work(i)[:2], i.scalings, i.permutation,
                  list(case.slice_offsets), i.max_tiles, case.base.clone())


def test_opcheck_apply_cpu():
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_apply.default, _apply_args("cpu")[1])


def test_cpu_kernels_follow_the_work_list():
    """The CPU kernels of the schemas (CI's path) equal the float64 row loop: permutation, slot -1,
    a segment of several tiles (70 rows), an out-of-range slot in one of its tiles, capacity padding."""
    case, args = _apply_args("cpu", seg_lens=(70, 1, 5, 2), slots=(1, -1, 2, 0), cap_segments=9)
    info = _capacity_info(case, 9, case.x.shape[0])
    v_ref, covered = rowloop_shrink(case)
    v = torch.full_like(v_ref, float("nan"), dtype=torch.float32)
    torch.ops.lora_kernels.sgmv_shrink(case.x, case.lora_a, *_work(info), 2, info.max_tiles, v)
    assert torch.isnan(v[~covered]).all() and rel_err(v[covered], v_ref[covered]) <= 1e-6
    out = case.base.clone()
    torch.ops.lora_kernels.sgmv_apply(*args[:-1], out)
    assert rel_err(out, rowloop_expand(case, v_ref.nan_to_num(0), case.base)) <= 1e-5
    out2 = case.base.clone()
    torch.ops.lora_kernels.sgmv_expand(v.nan_to_num(0), case.lora_b, *_work(info)[:2], info.scalings,
                                       info.permutation, list(case.slice_offsets), info.max_tiles, out2)
    assert torch.equal(out, out2)
    bad = _capacity_info(case, 9, case.x.shape[0])
    bad.work[1 + 1] = 99  # tile 1 (the second tile of the 70-row segment): a slot the pool does not have
    out3 = case.base.clone()
    torch.ops.lora_kernels.sgmv_apply(case.x, case.lora_a, case.lora_b, *_work(bad)[:2], bad.scalings,
                                      bad.permutation, list(case.slice_offsets), bad.max_tiles, out3)
    rows, others = case.perm[TILE_M:2 * TILE_M], case.perm[:TILE_M] + case.perm[2 * TILE_M:]
    assert torch.equal(out3[rows], case.base[rows]) and torch.equal(out3[others], out[others])


def test_torch_compile_fullgraph_cpu():
    """The fake kernels let torch.compile(fullgraph=True) trace the cuda backend's ops; same result."""
    case, args = _apply_args("cpu")
    info = case.info

    def f(x, a, b, out):
        torch.ops.lora_kernels.sgmv_apply(x, a, b, *_work(info)[:2], info.scalings, info.permutation,
                                          list(case.slice_offsets), info.max_tiles, out)
        return out * 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(case.x, case.lora_a, case.lora_b, case.base.clone())
    assert torch.equal(got, f(case.x, case.lora_a, case.lora_b, case.base.clone()))


def test_cpp_limits_match_python():
    """csrc/ops/limits.h mirrors lora_kernels/limits.py and batch_info.TILE_M; csrc/ops/dtypes.h lists
    exactly limits.DTYPES."""
    import re
    from pathlib import Path

    from lora_kernels import limits
    from lora_kernels.batch_info import TILE_M

    csrc = Path(__file__).resolve().parent.parent / "csrc" / "ops"
    consts = dict(re.findall(r"constexpr int (k\w+) = (\d+);", (csrc / "limits.h").read_text()))
    assert {k: int(v) for k, v in consts.items()} == {"kMaxRank": limits.MAX_RANK, "kMaxSlices": limits.MAX_SLICES,
                                                      "kTileM": TILE_M}
    names = re.findall(r"F\(at::k(\w+), \w+\)", (csrc / "dtypes.h").read_text())
    assert sorted(names) == sorted({torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float"}[d]
                                   for d in limits.DTYPES)


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
                          (case.x, case.lora_a, *_work(i), 2, i.max_tiles, v))
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_expand.default,
                          (v + 1, case.lora_b, *_work(i)[:2], i.scalings, i.permutation, list(case.slice_offsets),
                           i.max_tiles, case.base.clone()))
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_apply.default,
                          (case.x, case.lora_a, case.lora_b, *_work(i)[:2], i.scalings, i.permutation,
                           list(case.slice_offsets), i.max_tiles, case.base.clone()))


# Small shapes for scripts/sanitize.sh (compute-sanitizer is slow): every kernel (tensor-core shrink
# with and without split-K and its reduction, tensor-core expand with several rank slabs, the CUDA-core
# kernels with and without 16-byte loads), permutations, padding, slot -1, multi-tile segments.
SMALL = {  # dtype, in_dim, R, widths, segment lengths
    "mma_split": (torch.bfloat16, 1104, 16, (64, 32, 8), [70, 1, 3, 0, 2]),  # 5 K splits, a partial last slab
    "mma_split_reduce_first": (torch.float16, 1104, 8, (16,), [1030, 1, 2, 0, 5]),  # >= 1024 rows
    "mma_nosplit": (torch.float16, 64, 136, (24, 128), [70, 1, 3, 0, 2]),  # 3 rank slabs in the expand
    "simt_vec": (torch.float32, 64, 16, (40, 8), [70, 1, 3, 0, 2]),
    "simt_scalar": (torch.bfloat16, 37, 5, (9, 0, 7), [70, 1, 3, 0, 2]),
}


@GPU
@pytest.mark.parametrize("kind", SMALL)
def test_small_paths(kind):
    dtype, in_dim, R, widths, seg_lens = SMALL[kind]
    rng = np.random.default_rng([1000, list(SMALL).index(kind)])
    case = make_case(rng, num_slots=4, max_rank=R, slice_widths=widths, in_dim=in_dim, seg_lens=seg_lens,
                     slots=[1, 0, -1, 2, 3], dtype=dtype, device="cuda", permute=True, extra_rows=3)
    truth = _truth_small if sum(seg_lens) < 200 else _truth_large
    check_case(_poison_stale(case), truth=truth)
    check_case(case, _capacity_info(case, cap_segments=8, max_seg_len=case.x.shape[0]), truth=truth)
