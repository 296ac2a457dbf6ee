"""lora_linear(mode="gemv"): the one-launch decode linear (csrc/kernels/lora_gemv.cuh, lora_kernels/_gemv.py).

GPU (marked gpu): against a float64 ground truth (x Wᵀ + bias + the per-row LoRA loop) with NaN-poisoned
weights past each slot's rank and a NaN-poisoned out, 1..16 rows, permuted rows, rows of slot -1 and rows outside
every segment, bf16 and fp16, ranks 8..64, unequal slices, several W items per CTA, x staged in shared memory
(past 8 rows at ranks up to 32) and x too wide for it; bitwise batch invariance across batch sizes, positions and
companions, and a column block's bits wherever it falls in the launch; graph replay equal to eager, with no host
sync; the sync words back at zero after every launch; bad inputs. CPU: the mode's fallback where the kernel cannot
run.
"""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import TOL, make_case, make_info, rel_err
from lora_kernels import _gemv
from test_cuda_backend import _poison_stale
from test_lora_linear import _layer, _reference


GPU_CASES = {  # name: make_case kwargs (in_dim a multiple of 256)
    "one_row": dict(seg_lens=(1,), slice_widths=(256, 64, 64), in_dim=512),
    "qkv_sixteen_distinct": dict(seg_lens=(1,) * 16, slice_widths=(512, 128, 128), in_dim=768, num_slots=16),
    "gate_up_shared": dict(seg_lens=(5, 3, 8), slice_widths=(344, 344), in_dim=256),
    "permuted_padded": dict(seg_lens=(2, 1, 3, 0, 4), slice_widths=(136, 24, 24, 40), in_dim=1024, permute=True,
                            extra_rows=5),
    "wide_k_rank64": dict(seg_lens=(3, 4), slice_widths=(200,), in_dim=3584, max_rank=64),
    # Several W items per CTA (a grid holds at most a few hundred CTAs), an odd out_total; 16 rows at rank 64.
    "many_items_odd": dict(seg_lens=(2, 3, 1), slice_widths=(9000, 2049, 3001), in_dim=256),
    "many_items_sixteen": dict(seg_lens=(1,) * 16, slice_widths=(7168, 7168), in_dim=512, num_slots=16,
                               max_rank=64),
    # 16 rows at a small rank with x too wide for shared memory (16 x 6144 bf16): the path that reads x through L1.
    "wide_k_sixteen": dict(seg_lens=(1,) * 16, slice_widths=(264, 40), in_dim=6144, num_slots=16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_reference(name, dtype, bias):
    rng = np.random.default_rng([len(name), dtype.itemsize, bias])
    kw = dict(GPU_CASES[name])
    kw.setdefault("max_rank", 16)
    case = _poison_stale(make_case(rng, dtype=dtype, device="cuda", **kw))
    w, b = _layer(case, rng, bias)
    out = torch.full((case.x.shape[0], case.slice_offsets[-1]), float("nan"), dtype=dtype, device="cuda")
    assert _gemv.run(case.x, w, b, case.lora_a, case.lora_b, case.info, case.slice_offsets, out)
    torch.cuda.synchronize()
    assert rel_err(out, _reference(case, w, b)) <= TOL[dtype]
    got = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, bias=b, mode="gemv")
    assert torch.equal(got, out)  # the mode runs the same launch
    words, _ = _gemv._sync_slot(case.x.device)
    assert int(words.abs().sum()) == 0  # every launch leaves its sync words at zero


def _problem(rng, dtype, in_dim=1024, widths=(384, 128, 128), rank=32, num_slots=8):
    offs = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
    g = torch.Generator(device="cuda").manual_seed(int(rng.integers(2**31)))
    w = (torch.randn(offs[-1], in_dim, device="cuda", generator=g) * in_dim ** -0.5).to(dtype)
    a = (torch.randn(num_slots, len(widths) * rank, in_dim, device="cuda", generator=g) * in_dim ** -0.5).to(dtype)
    b = (torch.randn(num_slots, offs[-1], rank, device="cuda", generator=g) * rank ** -0.5).to(dtype)
    ranks = torch.tensor([rank, 3, rank, 0, 7, rank, 16, rank][:num_slots], dtype=torch.int32, device="cuda")
    scal = torch.tensor(rng.uniform(0.5, 2.0, num_slots), dtype=torch.float32, device="cuda")
    return w, a, b, ranks, scal, offs


@pytest.mark.gpu
def test_gpu_batch_invariance_across_sizes():
    """A row's output is bit-equal in batches of 1..16 rows, at any position, beside any companions, sorted or not."""
    rng = np.random.default_rng(31)
    dtype = torch.bfloat16
    w, a, b, ranks, scal, offs = _problem(rng, dtype)
    x_probe = torch.randn(2, w.shape[1], device="cuda").to(dtype)
    slots_probe = [2, 6]
    bias = torch.randn(w.shape[0], device="cuda").to(dtype)
    outs = []
    for T in (2, 3, 9, 16, 16):
        pos = rng.choice(T, 2, replace=False)
        slots = rng.integers(-1, 8, T)
        slots[pos] = slots_probe
        x = torch.randn(T, w.shape[1], device="cuda").to(dtype)
        x[torch.from_numpy(pos).cuda()] = x_probe
        builder = lk.BatchInfoBuilder(T, T, ranks, scal)
        info = builder.build([1] * T, [int(s) for s in slots], sort_by_adapter=bool(T % 2))
        y = lk.lora_linear(x, w, a, b, info, offs, bias=bias, mode="gemv")
        outs.append(y[torch.from_numpy(pos).cuda()])
    alone = make_info([1], [slots_probe[0]], None, ranks, scal, "cuda")
    y1 = lk.lora_linear(x_probe[:1].contiguous(), w, a, b, alone, offs, bias=bias, mode="gemv")
    for y in outs[1:]:
        assert torch.equal(y, outs[0])
    assert torch.equal(y1[0], outs[0][0])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [5, 13])
def test_gpu_later_items_have_the_first_items_bits(T):
    """A 16-column block of y has the same bits as the only W item of a launch over those 16 columns, wherever it
    falls in a wide launch: a CTA's first W item (whose epilogue waits for the shrink and stages v) or a later one."""
    rng = np.random.default_rng(33 + T)
    dtype, items = torch.bfloat16, 1000
    if 2 * torch.cuda.get_device_properties(0).multi_processor_count >= items:
        pytest.skip("the grid would give every CTA a single item")
    w, a, b, ranks, scal, offs = _problem(rng, dtype, in_dim=512, widths=(16 * items,))
    bias = torch.randn(w.shape[0], device="cuda").to(dtype)
    x = torch.randn(T, w.shape[1], device="cuda").to(dtype)
    info = make_info([1] * T, [int(s) for s in rng.integers(-1, 8, T)], None, ranks, scal, "cuda")
    y = torch.full((T, w.shape[0]), float("nan"), dtype=dtype, device="cuda")
    assert _gemv.run(x, w, bias, a, b, info, offs, y)
    for blk in (0, 1, items // 2, items - 1):
        cols = slice(16 * blk, 16 * blk + 16)
        alone = torch.full((T, 16), float("nan"), dtype=dtype, device="cuda")
        assert _gemv.run(x, w[cols].contiguous(), bias[cols].contiguous(), a, b[:, cols].contiguous(), info, (0, 16),
                         alone)
        assert torch.equal(alone, y[:, cols]), blk


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager_and_no_sync():
    rng = np.random.default_rng(32)
    T, dtype = 12, torch.bfloat16
    w, a, b, ranks, scal, offs = _problem(rng, dtype, rank=16)
    builder = lk.BatchInfoBuilder(T, T, ranks, scal, cuda_graph=True)
    x = torch.randn(T, w.shape[1], device="cuda").to(dtype)
    out = torch.empty(T, w.shape[0], device="cuda", dtype=dtype)
    info = builder.build([1] * T, [int(s) for s in rng.integers(-1, 8, T)])

    def step():
        for _ in range(3):  # consecutive launches on one stream share their sync words
            lk.lora_linear(x, w, a, b, info, offs, out=out, mode="gemv")

    step()  # eager first: creates the sync words (module docstring)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
        graph.replay()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    info2 = builder.build([1] * T, [int(s) for s in rng.integers(-1, 8, T)])  # new batch, same graph
    graph.replay()
    replayed = out.clone()
    lk.lora_linear(x, w, a, b, info2, offs, out=out, mode="gemv")
    assert torch.equal(out, replayed)
    words, _ = _gemv._sync_slot(x.device)
    torch.cuda.synchronize()
    assert int(words.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("what, match", [
    ("rows", "at most 16 rows"),
    ("in_dim", "multiple of 256"),
    ("rank", "multiple of 8"),
    ("slot", "sync_slot"),
    ("weight", "weight must have shape"),
])
def test_gpu_bad_input_raises(what, match):
    rng = np.random.default_rng(33)
    w, a, b, ranks, scal, offs = _problem(rng, torch.bfloat16, rank=16)
    T = 17 if what == "rows" else 4
    x = torch.randn(T, w.shape[1], device="cuda").to(torch.bfloat16)
    if what == "in_dim":
        x, w, a = x[:, :1000].contiguous(), w[:, :1000].contiguous(), a[:, :, :1000].contiguous()
    if what == "rank":
        b = b[:, :, :12].contiguous()
        a = a[:, :36].contiguous()
    if what == "weight":
        w = w[:-8].contiguous()
    info = make_info([T], [0], None, ranks, scal, "cuda")
    words = torch.zeros(8, dtype=torch.int32, device="cuda")
    out = torch.empty(T, offs[-1], device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.lora_kernels.lora_gemv.default(x, w, None, a, b, info.work, info.lora_ranks, info.scalings, None,
                                                 list(offs), info.max_tiles, words, 9 if what == "slot" else 0, out)


def test_falls_back_where_the_kernel_cannot_run():
    """On the CPU (or with another backend named) mode "gemv" runs "delta": the same values as serial."""
    rng = np.random.default_rng(34)
    case = make_case(rng, seg_lens=(2, 3), slice_widths=(24, 8), in_dim=32)
    w, b = _layer(case, rng, True)
    assert not _gemv.supports(case.x, w, b, case.lora_a, case.lora_b, case.info)
    got = lk.lora_linear(case.x, w, case.lora_a, case.lora_b, case.info, case.slice_offsets, bias=b, mode="gemv",
                         backend="torch")
    assert rel_err(got, _reference(case, w, b)) <= TOL[torch.float32]
    assert not _gemv.backend_allows("triton") and _gemv.backend_allows(None)


def test_sync_slots_per_stream_and_per_capture(monkeypatch):
    """Eager calls on one stream share a slot, streams get their own, each captured call a slot for good; none
    once every slot is taken (lora_linear then runs its fallback)."""
    monkeypatch.setattr(_gemv, "SLOTS", 4)
    words = _gemv._SyncWords(torch.device("cpu"))
    assert words.words.shape == (8,) and int(words.words.abs().sum()) == 0

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    a, b = Stream(11), Stream(22)
    assert words.slot(a, False) == words.slot(a, False) == 0
    assert words.slot(b, False) == 1
    assert words.slot(a, True) == 2 and words.slot(a, True) == 3  # captured: new slots, kept
    assert words.slot(a, False) == 0  # the stream keeps its own
    assert words.slot(Stream(33), False) is None and words.slot(a, True) is None
