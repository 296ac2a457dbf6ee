"""BatchInfoBuilder: layout equals a straightforward reconstruction, the ring never rewrites a staging
buffer in flight, errors are clear, and (GPU) the whole prepare-and-run loop never syncs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import TOL, make_case, rel_err, rowloop_expand, rowloop_shrink
from lora_kernels import batch_info
from lora_kernels.batch_info import BatchInfoBuilder

ROOT = Path(__file__).resolve().parents[1]
NUM_SLOTS = 5


def pool(device="cpu", num_slots=NUM_SLOTS):
    ranks = torch.tensor([(4 * i) % 17 for i in range(num_slots)], dtype=torch.int32, device=device)
    return ranks, torch.linspace(0.5, 2.0, num_slots, device=device)


def expected_layout(counts, slots, sort):
    """Plain-Python reconstruction: (segment lengths, segment slots, physical row of each segmented row)."""
    starts = [sum(counts[:i]) for i in range(len(counts))]
    if not sort:
        return list(counts), list(slots), list(range(sum(counts)))
    lens, seg_slots, perm = [], [], []
    for slot in sorted(set(slots)):
        members = [i for i in range(len(slots)) if slots[i] == slot]
        seg_slots.append(slot)
        lens.append(sum(counts[i] for i in members))
        for i in members:
            perm.extend(range(starts[i], starts[i] + counts[i]))
    return lens, seg_slots, perm


def check_info(builder, info, counts, slots, sort):
    """Every field of info against the reconstruction, in eager and graph layouts."""
    lens, seg_slots, perm = expected_layout(counts, slots, sort)
    S, T = builder.max_segments, builder.max_tokens
    tokens = sum(counts)
    got_lens = info.seg_lens.tolist()
    got_indptr = info.seg_indptr.tolist()
    got_wi = info.weight_indices.tolist()
    decode = builder.cuda_graph and not sort and len(counts) > 0 and all(c == 1 for c in counts)
    if decode:  # precomputed segments: one row each up to min(S, T), padding segments have slot -1
        rows = min(S, T)
        lens = [1] * rows + [0] * (S - rows)
        seg_slots = list(slots) + [-1] * (S - len(slots))
        assert (info.max_seg_len, info.num_tokens) == (1, rows)
    else:
        cap = S if builder.cuda_graph else max(len(lens), 1)
        lens = lens + [0] * (cap - len(lens))
        seg_slots = seg_slots + [-1] * (cap - len(seg_slots))
        assert info.num_tokens == tokens
        assert info.max_seg_len == (T if builder.cuda_graph else max(lens, default=0))
    assert got_lens == lens
    assert got_wi == seg_slots
    assert got_indptr == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert info.num_segments == (len(set(slots)) if sort else len(slots))
    if not sort:
        assert info.permutation is None
    else:
        got_perm = info.permutation.tolist()
        if builder.cuda_graph:
            assert got_perm == perm + list(range(tokens, T))
        else:
            assert got_perm == perm
    for t in (info.seg_lens, info.seg_indptr, info.weight_indices, info.work):
        assert t.dtype == torch.int32 and t.device == builder.device
    assert info.lora_ranks is builder.lora_ranks and info.scalings is builder.scalings
    check_work(info, lens, seg_slots, len(counts) if decode else None)


def check_work(info, lens, seg_slots, decode_rows):
    """The work list: TILE_M-row tiles of every non-empty segment in segment order, slot -1 ones included
    (graph-mode decode: one tile per request, padding segments left out)."""
    from lora_kernels.batch_info import TILE_M

    m = info.max_tiles
    work = info.work.tolist()
    assert len(work) == 1 + 3 * m
    expected = []
    start = 0
    for s, (n, slot) in enumerate(zip(lens, seg_slots)):
        if decode_rows is not None and s >= decode_rows:
            break
        expected += [(slot, r, start + n) for r in range(start, start + n, TILE_M)]
        start += n
    count = work[0]
    got = list(zip(work[1:1 + count], work[1 + m:1 + m + count], work[1 + 2 * m:1 + 2 * m + count]))
    assert got == expected


def row_slots(info, num_rows):
    """Slot that info applies to each physical row (-2 = no segment covers it), read back for checking."""
    out = [-2] * num_rows
    perm = info.permutation.tolist() if info.permutation is not None else None
    indptr, wi = info.seg_indptr.tolist(), info.weight_indices.tolist()
    for s, slot in enumerate(wi):
        for i in range(indptr[s], indptr[s + 1]):
            row = perm[i] if perm is not None else i
            assert out[row] == -2, f"row {row} covered twice"
            out[row] = slot
    return out


def random_batch(rng, n, max_count, slot_lo=-1):
    counts = [int(c) for c in rng.integers(0, max_count + 1, n)]
    slots = [int(s) for s in rng.integers(slot_lo, NUM_SLOTS, n)]
    return counts, slots


def edge_batches(S, T):
    yield [], []  # no requests at all
    yield [3], [2]  # one request
    yield [0, 2, 0], [1, 1, -1]  # empty requests
    yield [1] * S, [i % NUM_SLOTS for i in range(S)]  # decode, capacity-full segments
    yield [T // S] * (S - 1) + [T - (T // S) * (S - 1)], [-1, 3] * (S // 2)  # capacity-full tokens
    yield [2, 5, 1], [-1, -1, -1]  # all without LoRA
    yield [1, 1], [0, 0]  # short decode
    yield [T], [4]  # one request of max_tokens rows


@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("sort", [False, True])
def test_layout_matches_reconstruction(cuda_graph, sort):
    S, T = 8, 24
    rng = np.random.default_rng(7 + cuda_graph + 2 * sort)
    builder = BatchInfoBuilder(T, S, *pool(), cuda_graph=cuda_graph)
    batches = list(edge_batches(S, T))
    for _ in range(40):
        n = int(rng.integers(0, S + 1))
        counts, slots = random_batch(rng, n, 2 * T // max(n, 1))
        if sum(counts) <= T:
            batches.append((counts, slots))
    for counts, slots in batches:
        info = builder.build(counts, slots, sort_by_adapter=sort)
        check_info(builder, info, counts, slots, sort)
        # Independently of the layout: every row of the batch gets its request's slot, exactly once.
        covered = row_slots(info, T)
        want = [s for c, s in zip(counts, slots) for _ in range(c)]
        assert covered[: len(want)] == want
        assert all(s in (-2, -1) for s in covered[len(want):])
    assert builder.builds == len(batches) and builder.stalls == 0


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_one_row_builder_ignores_the_sort(graph):
    """max_tokens == 1: sort_by_adapter=True gives the unsorted info (no permutation, the same segments, work list
    and graph family), since the sorted order of one row is the identity."""
    builder = BatchInfoBuilder(1, 3, *pool(), cuda_graph=graph)
    for counts, slots in (([1], [4]), ([0, 1, 0], [2, 2, -1]), ([1], [-1])):
        plain = builder.build(counts, slots)
        plain = {f: getattr(plain, f) for f in ("seg_lens", "seg_indptr", "weight_indices", "work", "num_segments",
                                                 "max_seg_len", "num_tokens", "max_tiles")}
        info = builder.build(counts, slots, sort_by_adapter=True)
        assert info.permutation is None
        for f, want in plain.items():
            got = getattr(info, f)
            assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), f
        if graph:
            assert builder.graph_family(info)[1] is False

def test_input_types_are_equivalent():
    builder = BatchInfoBuilder(32, 6, *pool())
    counts, slots = [3, 0, 7, 1], [2, -1, 2, 4]
    ref = builder.build(counts, slots, sort_by_adapter=True)
    for c, s in [(tuple(counts), tuple(slots)), (np.array(counts), np.array(slots, np.int64)),
                 (torch.tensor(counts), torch.tensor(slots, dtype=torch.int32)), (np.array(counts, np.uint8), slots)]:
        info = builder.build(c, s, sort_by_adapter=True)
        for f in ("seg_lens", "seg_indptr", "weight_indices", "permutation"):
            assert torch.equal(getattr(info, f), getattr(ref, f)), f
        assert (info.num_segments, info.max_seg_len, info.num_tokens) == (ref.num_segments, ref.max_seg_len,
                                                                          ref.num_tokens)


def test_eager_infos_are_independent():
    builder = BatchInfoBuilder(64, 8, *pool())
    first = builder.build([4, 2], [1, 3])
    snapshot = [t.clone() for t in (first.seg_lens, first.seg_indptr, first.weight_indices)]
    for i in range(3 * builder.ring_size):  # wraps the ring several times
        builder.build([1 + i % 5, 9, 2], [0, -1, 4])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (first.seg_lens, first.seg_indptr, first.weight_indices)))


def test_graph_mode_addresses_never_change():
    builder = BatchInfoBuilder(32, 8, *pool(), cuda_graph=True)
    seen = {}
    batches = [([1, 1, 1], [0, 1, 2], False), ([5, 1, 9], [0, -1, 2], False), ([5, 1, 9], [0, -1, 2], True),
               ([1] * 8, [4] * 8, False), ([], [], False), ([2] * 8, [1] * 8, True), ([1, 1], [3, 2], True)]
    for _ in range(2 * builder.ring_size // len(batches) + 1):
        for counts, slots, sort in batches:
            info = builder.build(counts, slots, sort_by_adapter=sort)
            family = builder.graph_family(info)
            ptrs = tuple(None if t is None else t.data_ptr() for t in
                         (info.seg_lens, info.seg_indptr, info.weight_indices, info.permutation, info.work))
            assert seen.setdefault(family, ptrs) == ptrs, family
            check_info(builder, info, counts, slots, sort)
    assert set(seen) == {("decode", False), ("general", False), ("general", True)}


def test_graph_decode_copies_only_weight_indices():
    builder = BatchInfoBuilder(16, 4, *pool(), cuda_graph=True)
    builder.build([3, 4], [1, 2])  # general segments in the static buffers
    info = builder.build([1, 1, 1], [0, 2, -1])
    assert info.max_seg_len == 1 and info.num_tokens == 4 and info.num_segments == 3
    # The general buffers were not rewritten by the decode build.
    assert builder._g.lens.tolist() == [3, 4, 0, 0]
    assert info.seg_lens.tolist() == [1, 1, 1, 1] and info.weight_indices.tolist() == [0, 2, -1, -1]


class _FakeEvent:
    """Stands in for a CUDA event: a copy that is 'in flight' until the test completes it."""

    def __init__(self, staging, log):
        self.done = True
        self.staging = staging
        self.log = log
        self.recorded = None

    def query(self):
        return self.done

    def synchronize(self):
        # Called before the buffer is reused: it must still hold the record of its in-flight copy.
        self.log.append(np.array_equal(self.staging.array, self.recorded))
        self.done = True

    def record(self, stream=None):
        self.recorded = self.staging.array.copy()
        self.done = False


def test_ring_never_overwrites_a_buffer_in_flight():
    class SmallRing(BatchInfoBuilder):
        ring_size = 2

    builder = SmallRing(32, 4, *pool())
    log = []
    for st in builder._ring:
        st.event = _FakeEvent(st, log)
    builder.build([3, 1], [0, 1])  # staging 0, in flight
    builder.build([2], [4])  # staging 1, in flight
    assert builder.stalls == 0 and log == []
    builder._ring[1].event.done = True  # the second copy finished; the first did not
    info = builder.build([5, 5, 5], [2, 2, -1])  # back to staging 0: must wait for its copy first
    assert builder.stalls == 1 and log == [True]
    info2 = builder.build([1], [3])  # staging 1: its copy completed, no wait
    assert builder.stalls == 1 and log == [True]
    check_info(builder, info, [5, 5, 5], [2, 2, -1], False)
    check_info(builder, info2, [1], [3], False)
    assert builder.builds == 4


@pytest.mark.parametrize("counts, slots, kwargs, message", [
    ([1, 2], [0, 5], {}, r"slot 5 out of range: slots must be -1 or in \[0, 5\)"),
    ([1, 2], [-2, 0], {}, r"slot -2 out of range"),
    ([1, -1], [0, 0], {}, r"seg_token_counts must be >= 0, got -1"),
    ([1, 2, 3], [0, 0], {}, r"seg_token_counts has 3 entries but slots has 2"),
    ([1] * 9, [0] * 9, {}, r"9 requests exceed max_segments=8"),
    ([20, 20], [0, 1], {}, r"40 tokens exceed max_tokens=32"),
    ([33], [0], {}, r"33 tokens exceed max_tokens=32"),
    ([20, 20], [0, 1], {"sort_by_adapter": True}, r"40 tokens exceed max_tokens=32"),
    ([2**40], [0], {}, r"seg_token_counts holds values outside int32"),
    (np.array([2**40]), [0], {}, r"seg_token_counts holds values outside int32"),
    ([1.5], [0], {}, r"seg_token_counts must hold integers|holds values"),
    ([1], torch.zeros(1, device="meta", dtype=torch.int32), {}, r"slots must be host ints .* on meta"),
])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_bad_batches_raise_and_leave_the_builder_usable(counts, slots, kwargs, message, cuda_graph):
    builder = BatchInfoBuilder(32, 8, *pool(), cuda_graph=cuda_graph)
    if isinstance(counts, list) and counts and isinstance(counts[0], float):
        counts = np.array(counts)
    with pytest.raises(ValueError, match=message):
        builder.build(counts, slots, **kwargs)
    assert builder.builds == 0
    info = builder.build([2, 3], [1, -1])
    check_info(builder, info, [2, 3], [1, -1], False)


def test_bad_construction():
    ranks, scal = pool()
    with pytest.raises(ValueError, match=r"lora_ranks must be int32\[num_slots\], got \(5,\) torch.int64"):
        BatchInfoBuilder(8, 2, ranks.long(), scal)
    with pytest.raises(ValueError, match=r"scalings must be float32\[5\], got \(4,\) torch.float32"):
        BatchInfoBuilder(8, 2, ranks, scal[:4])
    with pytest.raises(ValueError, match=r"max_tokens and max_segments must be >= 1, got 0, 2"):
        BatchInfoBuilder(0, 2, ranks, scal)


def _ops_case(rng, counts, slots, rows, device="cpu", dtype=torch.float32):
    """A random problem over `rows` rows whose first sum(counts) rows form the batch (request order)."""
    return make_case(rng, num_slots=NUM_SLOTS, max_rank=8, slice_widths=(16, 8), in_dim=24, seg_lens=counts,
                     slots=slots, dtype=dtype, device=device, extra_rows=rows - sum(counts))


@pytest.mark.parametrize("cuda_graph, sort, counts, slots", [
    (False, False, [3, 0, 5, 1], [2, 4, -1, 2]),
    (False, True, [3, 0, 5, 1, 2], [2, 4, -1, 2, 4]),
    (True, False, [1, 1, 1], [3, -1, 3]),  # decode: padding segments cover the rows up to capacity
    (True, False, [4, 1, 6], [0, 1, 0]),
    (True, True, [4, 1, 6, 2], [0, 1, 0, -1]),
])
def test_builder_infos_drive_the_ops(cuda_graph, sort, counts, slots):
    rng = np.random.default_rng(11)
    T, S = 16, 6
    case = _ops_case(rng, counts, slots, T)
    builder = BatchInfoBuilder(T, S, case.info.lora_ranks, case.info.scalings, cuda_graph=cuda_graph)
    info = builder.build(counts, slots, sort_by_adapter=sort)
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, info, case.slice_offsets, backend="torch")
    v_ref, covered = rowloop_shrink(case)
    ref = rowloop_expand(case, torch.nan_to_num(v_ref), case.base)
    assert rel_err(out, ref) <= TOL[torch.float32]
    assert torch.equal(out[sum(counts):], case.base[sum(counts):])  # rows outside the batch untouched


# ----------------------------------------------------------------------------------------------- GPU


def _gpu_batches(rng, S, T, steps):
    """A scheduler-like stream: decode steps, mixed prefill+decode steps, some sorted."""
    out = []
    for i in range(steps):
        n = int(rng.integers(1, S + 1))
        slots = [int(s) for s in rng.integers(-1, NUM_SLOTS, n)]
        if i % 3 == 0:
            counts = [1] * n
        else:
            counts = [int(c) if rng.random() < 0.3 else 1 for c in rng.integers(2, 12, n)]
            while sum(counts) > T:
                counts[int(np.argmax(counts))] //= 2
        out.append((counts, slots, i % 4 == 3))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_thousand_builds_and_kernels_never_sync(cuda_graph):
    rng = np.random.default_rng(5)
    T, S = 64, 16
    case = _ops_case(rng, [1], [0], T, device="cuda", dtype=torch.float16)
    builder = BatchInfoBuilder(T, S, case.info.lora_ranks, case.info.scalings, cuda_graph=cuda_graph)
    batches = _gpu_batches(rng, S, T, 1000)
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, builder.build([1], [0]), case.slice_offsets)  # warm up
    torch.cuda.synchronize()
    results = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, (counts, slots, sort) in enumerate(batches):
            info = builder.build(counts, slots, sort_by_adapter=sort)
            out.copy_(case.base)
            lk.apply_lora(case.x, out, case.lora_a, case.lora_b, info, case.slice_offsets)
            if i >= len(batches) - 3:
                results.append(out.clone())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert builder.builds == 1001
    for (counts, slots, _), got in zip(batches[-3:], results):  # the loop computed the right thing
        ref_case = dataclasses.replace(case, seg_lens=counts, slots=slots, perm=list(range(sum(counts))))
        v_ref, _ = rowloop_shrink(ref_case)
        ref = rowloop_expand(ref_case, torch.nan_to_num(v_ref), case.base)
        assert rel_err(got, ref) <= TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["decode", "mixed", "sorted"])
def test_graph_captured_once_replays_three_batches(family):
    rng = np.random.default_rng(9)
    T, S = 64, 16
    case = _ops_case(rng, [1], [0], T, device="cuda", dtype=torch.float16)
    builder = BatchInfoBuilder(T, S, case.info.lora_ranks, case.info.scalings, cuda_graph=True)
    sort = family == "sorted"

    def batch():
        n = int(rng.integers(2, S + 1))
        slots = [int(s) for s in rng.integers(-1, NUM_SLOTS, n)]
        counts = [1] * n if family == "decode" else [int(c) for c in rng.integers(0, T // n + 1, n)]
        return counts, slots

    x, base, out = case.x, case.base.clone(), torch.empty_like(case.base)
    counts, slots = batch()
    info = builder.build(counts, slots, sort_by_adapter=sort)
    key = builder.graph_family(info)

    def step():
        out.copy_(base)
        lk.apply_lora(x, out, case.lora_a, case.lora_b, info, case.slice_offsets)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up (Triton compiles, autotuning) outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        counts, slots = batch()
        new = builder.build(counts, slots, sort_by_adapter=sort)
        assert builder.graph_family(new) == key
        x.copy_(torch.randn_like(x))
        base.copy_(torch.randn_like(base))
        out.fill_(float("nan"))  # poison: the replayed graph must rewrite every row
        graph.replay()
        torch.cuda.synchronize()
        ref_case = dataclasses.replace(case, x=x.clone(), seg_lens=counts, slots=slots,
                                       perm=list(range(sum(counts))))
        v_ref, _ = rowloop_shrink(ref_case)
        ref = rowloop_expand(ref_case, torch.nan_to_num(v_ref), base)
        assert rel_err(out, ref) <= TOL[torch.float16]


@pytest.mark.gpu
def test_ring_reuse_waits_for_copies_in_flight():
    class SmallRing(BatchInfoBuilder):
        ring_size = 2

    builder = SmallRing(64, 8, *pool("cuda"))
    batches = [([i + 1, 2, 3], [i % NUM_SLOTS, -1, 1]) for i in range(6)]
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: every copy below queues behind it
    infos = [builder.build(c, s) for c, s in batches]
    assert builder.stalls >= 1  # the third build found staging buffer 0 still waiting for its copy
    torch.cuda.synchronize()
    for info, (c, s) in zip(infos, batches):
        check_info(builder, info, c, s, False)


@pytest.mark.gpu
def test_cuda_tensor_inputs_are_rejected():
    builder = BatchInfoBuilder(8, 4, *pool("cuda"))
    with pytest.raises(ValueError, match=r"seg_token_counts must be host ints .* on cuda:0"):
        builder.build(torch.ones(2, dtype=torch.int32, device="cuda"), [0, 1])


@pytest.mark.gpu
def test_profiler_script_finds_no_sync_in_batch_prep(tmp_path):
    script = ROOT / "bench" / "profile" / "torch_profile.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run([sys.executable, str(script), "--steps", "12", "--out", str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "synchronizing calls in batch preparation: 0" in ok.stdout
    assert list(tmp_path.glob("*.json")), "no Chrome trace written"
    # The same script must catch the syncs of the straightforward builder (the check can fail).
    bad = subprocess.run([sys.executable, str(script), "--steps", "12", "--baseline", "--out", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1, bad.stdout + bad.stderr


def test_profile_analysis_counts_syncs_only_inside_batch_prep():
    """The trace analysis of torch_profile.py on a hand-made trace: it must see a sync inside batch_prep
    (including a device-to-host copy), ignore one outside, and measure the GPU gap across preparation."""
    sys.path.insert(0, str(ROOT / "bench" / "profile"))
    import torch_profile

    def x(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}

    events = [
        x("kernel", "k0", 0, 10, tid=7), x("kernel", "k1", 50, 10, tid=7), x("kernel", "k2", 61, 5, tid=7),
        x("user_annotation", "batch_prep", 20, 20),
        x("cuda_runtime", "cudaMemcpyAsync", 22, 2, correlation=5), x("cuda_runtime", "cudaEventRecord", 25, 1),
        x("cuda_runtime", "cudaStreamSynchronize", 45, 3),  # after the range: the per-step read-back
        x("cuda_runtime", "cudaStreamSynchronize", 30, 1, tid=2),  # another thread
    ]
    clean = torch_profile.analyze({"traceEvents": events})
    assert (clean["prep_ranges"], clean["calls_in_prep"], clean["syncs"]) == (1, 2, 0)
    assert (clean["gaps"], clean["idle_total"], clean["prep_bubble_median"], clean["prep_median"]) == (2, 41, 40, 20)
    dirty = torch_profile.analyze({"traceEvents": events + [
        x("cuda_runtime", "cudaStreamSynchronize", 30, 1), x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 28, 1,
                                                              tid=7, correlation=5)]})
    assert dirty["syncs"] == 2 and dirty["sync_names"] == {"cudaStreamSynchronize": 1, "cudaMemcpyAsync": 1}
    assert dirty["prep_bubble_median"] == 39  # the copy's 1 us of GPU work inside the bubble is not idle


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_more_segments_than_tokens(cuda_graph):
    builder = BatchInfoBuilder(4, 8, *pool(), cuda_graph=cuda_graph)
    for counts, slots in [([1, 1, 1], [0, 1, -1]), ([1] * 4, [2] * 4), ([2, 0, 0, 0, 0, 1], [1, 2, 3, 4, 0, 1])]:
        for sort in (False, True):
            check_info(builder, builder.build(counts, slots, sort_by_adapter=sort), counts, slots, sort)
    with pytest.raises(ValueError, match=r"6 tokens exceed max_tokens=4"):
        builder.build([1] * 6, [0] * 6)


def tiles_of(info):
    m, w = info.max_tiles, info.work.tolist()
    return [(w[1 + t], w[1 + m + t], w[1 + 2 * m + t]) for t in range(w[0])]


@pytest.mark.skipif(batch_info._fill_record is None, reason="the extension (its C++ record filler) is not built")
@pytest.mark.parametrize("graph", [False, True])
def test_native_record_equals_numpy_path(graph, monkeypatch):
    """The C++ fill_batch_record and the numpy path write the same infos (every field, the work list included)
    for random batches: decode, mixed, empty requests, slot -1, sorted or not."""
    rng = np.random.default_rng(31)
    native = BatchInfoBuilder(300, 40, *pool(), cuda_graph=graph)
    numpy_b = BatchInfoBuilder(300, 40, *pool(), cuda_graph=graph)
    for trial in range(60):
        n = int(rng.integers(0, 41))
        counts = [1] * n if trial % 3 == 0 else [int(c) for c in rng.integers(0, 20, n)]
        slots = [int(s) for s in rng.integers(-1, pool()[0].shape[0], n)]
        sort = bool(trial % 2)
        if sum(counts) > 300:
            continue
        a = native.build(counts, slots, sort_by_adapter=sort)
        with monkeypatch.context() as m:
            m.setattr(batch_info, "_fill_record", None)
            b = numpy_b.build(counts, slots, sort_by_adapter=sort)
        for f in ("seg_lens", "seg_indptr", "weight_indices", "permutation"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (trial, f)
        assert tiles_of(a) == tiles_of(b), trial  # entries past the tile count are not part of the list
        assert (a.num_segments, a.max_seg_len, a.num_tokens, a.max_tiles) == (b.num_segments, b.max_seg_len,
                                                                               b.num_tokens, b.max_tiles)
        check_info(native, a, counts, slots, sort)


@pytest.mark.skipif(batch_info._fill_record is None, reason="the extension (its C++ record filler) is not built")
@pytest.mark.parametrize("counts, slots, match", [([1, 2], [0, 9], "slot 9 out of range"),
                                                  ([1, -2], [0, 1], "must be >= 0"),
                                                  ([1, 400], [0, 1], "exceed max_tokens"),
                                                  ([200, 200], [0, 1], "400 tokens exceed"),
                                                  ([1, 2**40], [0, 1], "outside int32"),
                                                  ([1, "2"], [0, 1], "")])
def test_native_record_rejects_bad_input(counts, slots, match):
    builder = BatchInfoBuilder(300, 8, *pool())
    with pytest.raises((ValueError, TypeError), match=match):
        builder.build(counts, slots)


@pytest.mark.skipif(batch_info._fill_record is None or torch.cuda.is_available(),
                    reason="needs the extension and no GPU (on a GPU the copy runs: see the GPU test below)")
def test_native_copy_without_a_gpu_raises():
    """The one-call graph build's copy reports a CUDA failure as a RuntimeError, never a silent record."""
    rec = np.zeros(64, np.int32)
    with pytest.raises(RuntimeError, match="record copy failed"):
        batch_info._fill_record([1], [0], rec, rec, 4, 16, False, 8, 8, 8, 16, (0, 0, 0, 0, 0, 36, 0, 36, 0, 256))


@pytest.mark.gpu
@pytest.mark.skipif(batch_info._fill_record is None, reason="the extension (its C++ record filler) is not built")
def test_native_copy_equals_torch_copy(monkeypatch):
    """Graph mode with LORA_KERNELS_NATIVE_COPY (fill, copy and event in one C++ call) writes the same device
    buffers as fill + copy_ + Event.record, over more batches than the staging ring holds, with no host sync; a
    sorted batch after a longer one leaves the identity in the permutation past its rows."""
    rng = np.random.default_rng(41)
    ranks, scal = pool()
    ranks, scal = ranks.cuda(), scal.cuda()
    plain = BatchInfoBuilder(300, 40, ranks, scal, cuda_graph=True)
    monkeypatch.setattr(batch_info, "NATIVE_COPY", True)
    native = BatchInfoBuilder(300, 40, ranks, scal, cuda_graph=True)
    assert native._g.native and not plain._g.native
    torch.cuda.synchronize()
    for trial in range(80):
        n = int(rng.integers(0, 41))
        counts = [1] * n if trial % 3 == 0 else [int(c) for c in rng.integers(0, 8, n)]
        slots = [int(s) for s in rng.integers(-1, ranks.shape[0], n)]
        sort = trial % 4 >= 2
        torch.cuda.set_sync_debug_mode("error")
        try:
            a = native.build(counts, slots, sort_by_adapter=sort)
            b = plain.build(counts, slots, sort_by_adapter=sort)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        for f in ("seg_lens", "seg_indptr", "weight_indices", "permutation", "work"):
            x, y = getattr(a, f), getattr(b, f)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (trial, f)
        assert (a.num_segments, a.max_seg_len, a.num_tokens, a.max_tiles) == (b.num_segments, b.max_seg_len,
                                                                               b.num_tokens, b.max_tiles)
        check_info(native, a, counts, slots, sort)  # the permutation past the rows included
    assert native.builds == plain.builds == 80 and native.stalls == 0
