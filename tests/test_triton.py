"""Triton backend vs the float64 row loop of cases.py, over ranks, slices, dtypes, adapter popularity,
odd sizes, permutations, capacity-padded infos and every launch regime (decode / mixed / prefill,
split-K on and off, one tile per segment or many).

Without a GPU the kernels run under TRITON_INTERPRET=1 (conftest.py) on small shapes in fp32/fp16
(bf16 tl.dot is wrong in the interpreter, so bf16 runs on the GPU only). On a GPU the same tests run
natively, plus a larger grid marked `gpu`.
"""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import (POPULARITY, TOL, batch_rows, llama_case, make_case, make_info, popularity_slots, rel_err,
                   rowloop_expand, rowloop_shrink)
from lora_kernels import backends, reference
from lora_kernels.backends.triton import plan

pytestmark = pytest.mark.skipif(backends.unavailable("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
                                is not None, reason="Triton backend unavailable")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [torch.float32, torch.float16]
GPU = pytest.mark.gpu

# Tiny blocks: on small shapes they force several column tiles, K splits, rank chunks and (with one
# program per SM) persistent programs that walk several work items.
SMALL_TABLE = {
    "shrink": {"block_n": 16, "block_k": 16, "block_k_wide": 16, "k_chunk_min": 16, "max_split": 8, "num_warps": 4,
               "num_stages": 2, "ctas_per_sm": 1},
    "reduce": {"block_n": 16, "num_warps": 4, "min_rows": 1024},
    "expand": {"block_n": 16, "tile_elems": 256, "num_warps": 4, "num_stages": 1, "ctas_per_sm": 1},
}


# fp16 does not change which paths the tiny table reaches: it runs with fp32 only (the interpreter is slow).
TABLE_DTYPES = [("default", torch.float32), ("default", torch.float16), ("small", torch.float32)]


@pytest.fixture(params=["default", "small"])
def table(request, monkeypatch):
    """Runs a test with the tuned block table and with tiny blocks (many tiles, split-K)."""
    if request.param == "small":
        monkeypatch.setattr(plan, "TABLE", SMALL_TABLE)
    plan.clear_cache()
    yield request.param
    plan.clear_cache()


def _capacity_info(case, cap_segments, max_seg_len):
    """The case's batch as a graph-mode builder would hand it out: padded segments, a capacity bound."""
    return make_info(case.seg_lens, case.slots, case.perm if case.info.permutation is not None else None,
                     case.info.lora_ranks, case.info.scalings, case.x.device, cap_segments=cap_segments,
                     max_seg_len=max_seg_len)


def _untouched_rows(case):
    untouched = torch.ones(case.x.shape[0], dtype=torch.bool)
    for t, slot in zip(case.perm, np.repeat(case.slots, case.seg_lens)):
        if slot >= 0:
            untouched[t] = False
    return untouched.to(case.x.device)


class RowLoop:
    """Ground truth for small shapes: the independent float64 row loop of cases.py."""

    def __init__(self, case, info):
        self.case = case

    def shrink(self):
        return rowloop_shrink(self.case)

    def expand(self, v, base):
        return rowloop_expand(self.case, v, base)


class Reference64:
    """Ground truth for large GPU shapes: reference.py (itself tested against the row loop) in float64."""

    def __init__(self, case, info):
        self.case, self.info = case, info

    def _args(self):
        i = self.info
        return i.seg_indptr, i.weight_indices, i.lora_ranks

    def shrink(self):
        c = self.case
        v = torch.full((c.x.shape[0], c.lora_a.shape[1]), float("nan"), dtype=torch.float64, device=c.x.device)
        reference.sgmv_shrink(c.x.double(), c.lora_a.double(), *self._args(), self.info.permutation, c.num_slices, v)
        covered = torch.zeros(c.x.shape[0], dtype=torch.bool)
        covered[c.perm] = True
        return v.cpu(), covered

    def expand(self, v, base):
        c = self.case
        out = base.double().clone()
        reference.sgmv_expand(v.double().to(out.device), c.lora_b.double(), *self._args(), self.info.scalings,
                              self.info.permutation, c.slice_offsets, out)
        return out.cpu()


def check_case(case, info=None, truth=RowLoop):
    """shrink (poisoned out), expand (given v), apply vs a float64 ground truth; untouched rows bit-equal."""
    info = info or case.info
    tol = TOL[case.x.dtype]
    dev = case.x.device
    ref = truth(case, info)
    v_ref, covered = ref.shrink()

    v = torch.full((case.x.shape[0], case.lora_a.shape[1]), float("nan"), device=dev)
    lk.sgmv_shrink(case.x, case.lora_a, info, case.num_slices, out=v, backend="triton")
    assert torch.isnan(v[~covered.to(dev)]).all(), "shrink wrote rows outside every segment"
    if covered.any():
        assert rel_err(v[covered.to(dev)], v_ref[covered]) <= tol * 0.1 + 1e-12
        zero = v_ref[covered] == 0  # columns >= rank and rows of slot -1: exactly 0
        assert (v[covered.to(dev)][zero.to(dev)] == 0).all()

    v_in = torch.randn(case.x.shape[0], case.lora_a.shape[1], device=dev)
    out = case.base.clone()
    lk.sgmv_expand(v_in, case.lora_b, info, case.slice_offsets, out, backend="triton")
    assert rel_err(out, ref.expand(v_in, case.base)) <= tol
    untouched = _untouched_rows(case)
    assert torch.equal(out[untouched], case.base[untouched]), "expand changed rows it must not touch"

    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, info, case.slice_offsets, backend="triton")
    assert rel_err(out, ref.expand(v_ref.nan_to_num(0), case.base)) <= tol
    assert torch.equal(out[untouched], case.base[untouched]), "apply_lora changed rows it must not touch"


def _popularity_case(rng, pop, dtype, permute, device=DEVICE, n_seg=6, max_len=5, **kw):
    num_slots = kw.pop("num_slots", 5)
    seg_lens = [int(v) for v in rng.integers(1, max_len + 1, n_seg)]
    slots = [int(s) for s in popularity_slots(pop, n_seg, num_slots, rng)]
    slots[int(rng.integers(n_seg))] = -1  # always one segment without LoRA
    return make_case(rng, num_slots=num_slots, seg_lens=seg_lens, slots=slots, dtype=dtype, device=device,
                     permute=permute, extra_rows=2, **kw)


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("pop", POPULARITY)
@pytest.mark.parametrize("table, dtype", TABLE_DTYPES, indirect=["table"])
def test_popularity(pop, dtype, permute, table):
    rng = np.random.default_rng([POPULARITY.index(pop), CPU_DTYPES.index(dtype), permute, table == "small"])
    case = _popularity_case(rng, pop, dtype, permute, max_rank=16, slice_widths=(40, 8, 16), in_dim=48)
    check_case(case)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("table, dtype", TABLE_DTYPES, indirect=["table"])
def test_odd_sizes(seed, dtype, table):
    """Odd in_dim / slice widths / ranks (nothing a multiple of 16), up to 4 slices, one of width 0."""
    rng = np.random.default_rng([seed, CPU_DTYPES.index(dtype), table == "small"])
    widths = [int(w) for w in rng.choice([1, 7, 33], int(rng.integers(1, 5)))]
    if seed == 3:
        widths = [9, 0, 5]
    case = make_case(rng, num_slots=4, max_rank=int(rng.choice([1, 5, 24])), slice_widths=tuple(widths),
                     in_dim=int(rng.choice([1, 19, 111])), seg_lens=[int(v) for v in rng.integers(0, 7, 4)],
                     dtype=dtype, device=DEVICE, permute=bool(seed % 2), extra_rows=1)
    check_case(case)


@pytest.mark.parametrize("table, dtype", TABLE_DTYPES, indirect=["table"])
def test_decode_capacity(dtype, table):
    """Graph-mode pure decode: every segment one row, max_seg_len 1, padded with empty slot -1 segments."""
    rng = np.random.default_rng([11, CPU_DTYPES.index(dtype)])
    n = 7
    slots = [int(s) for s in popularity_slots("uniform", n, 4, rng)]
    slots[2] = -1
    case = make_case(rng, num_slots=4, ranks=[3, 16, 0, 9], max_rank=16, slice_widths=(24, 8, 8), in_dim=40,
                     seg_lens=[1] * n, slots=slots, dtype=dtype, device=DEVICE, extra_rows=3)
    check_case(case, _capacity_info(case, cap_segments=12, max_seg_len=1))


@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("table, dtype", TABLE_DTYPES, indirect=["table"])
def test_general_capacity(dtype, permute, table):
    """Graph-mode general batch: max_seg_len = the token capacity, so segments span many row tiles."""
    rng = np.random.default_rng([12, CPU_DTYPES.index(dtype), permute])
    case = make_case(rng, num_slots=3, max_rank=8, slice_widths=(16, 16), in_dim=32, seg_lens=[37, 0, 2, 18],
                     slots=[1, 0, -1, 2], dtype=dtype, device=DEVICE, permute=permute, extra_rows=5)
    check_case(case, _capacity_info(case, cap_segments=6, max_seg_len=case.x.shape[0]))


def test_reduce_first(monkeypatch):
    """apply_lora with the partials reduced once before the expand (large batches), reached on a small shape
    by lowering the row bar; the result is bit-identical to the expand summing them itself."""
    monkeypatch.setattr(plan, "TABLE", SMALL_TABLE)
    plan.clear_cache()
    rng = np.random.default_rng(13)
    case = make_case(rng, num_slots=3, max_rank=16, ranks=[16, 5, 11], slice_widths=(32, 17), in_dim=64,
                     seg_lens=[40, 25], slots=[0, 2], dtype=torch.float32, device=DEVICE, permute=True)
    assert not plan.reduce_first(case.x.shape[0])
    out_summed = case.base.clone()
    lk.apply_lora(case.x, out_summed, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
    monkeypatch.setattr(plan, "TABLE", {**SMALL_TABLE, "reduce": {**SMALL_TABLE["reduce"], "min_rows": 16}})
    plan.clear_cache()
    assert plan.reduce_first(case.x.shape[0])
    check_case(case)
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
    assert torch.equal(out, out_summed)
    plan.clear_cache()


@pytest.mark.parametrize("table", ["small", "default"])
def test_expand_prefetch_same_bits(monkeypatch, table):
    """The expand's `prefetch` form (the next column tile's B block and base rows loaded before this one is
    computed) writes the bits of the plain loop, with ragged column tiles, slot -1 and a permutation."""
    base = SMALL_TABLE if table == "small" else dict(plan.TABLE)
    rng = np.random.default_rng(14)
    case = make_case(rng, num_slots=4, max_rank=16, ranks=[16, 7, 0, 12], slice_widths=(40, 24, 9), in_dim=96,
                     seg_lens=[3, 18, 1, 5], slots=[0, 1, -1, 3], dtype=torch.float32, device=DEVICE, permute=True,
                     extra_rows=2)
    outs = []
    for prefetch in (False, True):
        monkeypatch.setattr(plan, "TABLE", {**base, "expand": {**base["expand"], "prefetch": prefetch}})
        plan.clear_cache()
        assert plan.expand_plan(case.slice_offsets, 16, torch.float32, True, 1, case.x.device).kw["PREFETCH"] is prefetch
        out = case.base.clone()
        lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    check_case(case)  # and the prefetch form against the reference
    plan.clear_cache()


def test_rank_zero_slot_untouched():
    """A slot of rank 0 (empty) behaves like slot -1: expand leaves its rows bit-identical, shrink writes 0."""
    rng = np.random.default_rng(14)
    case = make_case(rng, num_slots=2, ranks=[0, 4], max_rank=8, slice_widths=(8,), in_dim=16, seg_lens=[3, 2],
                     slots=[0, 1], dtype=torch.float32, device=DEVICE)
    v = torch.full((5, 8), float("nan"), device=DEVICE)
    lk.sgmv_shrink(case.x, case.lora_a, case.info, 1, out=v, backend="triton")
    assert (v[:3] == 0).all()
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
    assert torch.equal(out[:3], case.base[:3]) and not torch.equal(out[3:], case.base[3:])


def test_shrink_into_input_dtype():
    """v may be asked for in the input dtype instead of fp32."""
    rng = np.random.default_rng(15)
    case = make_case(rng, max_rank=8, slice_widths=(8, 8), in_dim=32, seg_lens=[2, 3], slots=[1, 0],
                     dtype=torch.float16, device=DEVICE)
    v_ref, _ = rowloop_shrink(case)
    v = torch.full((5, 16), float("nan"), dtype=torch.float16, device=DEVICE)
    lk.sgmv_shrink(case.x, case.lora_a, case.info, 2, out=v, backend="triton")
    assert rel_err(v, v_ref) <= TOL[torch.float16]


def test_plans_depend_on_shapes_only():
    """Split-K and blocks are functions of the shapes: the same plan for any batch, capacity or sort."""
    dev = torch.device(DEVICE)
    p1 = plan.shrink_plan(4096, 3, 16, torch.bfloat16, True, dev)
    assert p1 is plan.shrink_plan(4096, 3, 16, torch.bfloat16, True, dev)
    assert p1.split == 8 and p1.k_chunk == 512 and p1.kw["BLOCK_M"] == lk.batch_info.TILE_M
    assert plan.shrink_plan(14336, 1, 64, torch.bfloat16, False, dev).split == 8
    e = plan.expand_plan((0, 4096, 5120, 6144), 16, torch.bfloat16, False, 8, dev)
    assert e.n_tiles == 48 and e.kw["SPLIT"] == 8


@pytest.mark.parametrize("dtype", [torch.float32])
def test_batch_invariance_interpreter(dtype):
    """The same rows inside batches of other sizes, orders, sorted or not, eager or graph-mode infos: outputs
    bit-identical (torch.equal). CPU interpreter on a small shape; the GPU test covers bf16 and real sizes."""
    _check_invariance(np.random.default_rng(21), dtype, DEVICE, in_dim=96, widths=(32, 16), max_rank=16,
                      sizes=(1, 3, 8, 13, 20), num_slots=5)
    # (Longer segments, where rows move between sub-tile positions, run on the GPU only: the interpreter's
    # numpy matmul rounds a row differently by its position in the operand, the GPU's mma does not.)


def _check_invariance(rng, dtype, device, in_dim, widths, max_rank, sizes, num_slots, cuda_graph_sizes=()):
    S, R = len(widths), max_rank
    offs = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
    a = torch.randn(num_slots, S * R, in_dim, device=device).mul_(in_dim ** -0.5).to(dtype)
    b = torch.randn(num_slots, offs[-1], R, device=device).mul_(R ** -0.5).to(dtype)
    ranks = torch.tensor([int(rng.integers(1, R + 1)) for _ in range(num_slots)], dtype=torch.int32, device=device)
    scal = torch.rand(num_slots, device=device) + 0.5
    target_slots = [int(s) for s in rng.integers(0, num_slots, 3)]
    xt = torch.randn(3, in_dim, device=device).to(dtype)
    bt = torch.randn(3, offs[-1], device=device).to(dtype)
    results = []
    for k, n in enumerate(sizes):
        for sort in (False, True):
            graph = k in cuda_graph_sizes
            slots, where = batch_rows(rng, max(n, 3), num_slots, target_slots)
            T = len(slots)
            x = torch.randn(T, in_dim, device=device).to(dtype)
            out = torch.randn(T, offs[-1], device=device).to(dtype)
            x[torch.as_tensor(where, device=device)] = xt
            out[torch.as_tensor(where, device=device)] = bt
            builder = lk.BatchInfoBuilder(max(T, 64) if graph else T, max(T, 64) if graph else T, ranks, scal,
                                          cuda_graph=graph)
            info = builder.build([1] * T, slots, sort_by_adapter=sort)
            if graph:  # the graph-mode info covers capacity rows
                pad = info.num_tokens - T
                x = torch.cat([x, torch.randn(pad, in_dim, device=device).to(dtype)])
                out = torch.cat([out, torch.randn(pad, offs[-1], device=device).to(dtype)])
            lk.apply_lora(x, out, a, b, info, offs, backend="triton")
            results.append(out[torch.as_tensor(where, device=device)])
    for r in results[1:]:
        assert torch.equal(r, results[0])


# ---- GPU: the full grid, bf16 included, at realistic sizes ----

def _gpu_config(rng):
    num_slices = int(rng.integers(1, 5))
    max_rank = int(rng.choice([1, 8, 16, 33, 64, 128, 256]))
    widths = tuple(int(w) for w in rng.choice([1, 48, 129, 1024, 4096], num_slices))
    n_seg = int(rng.integers(1, 40))
    max_len = int(rng.choice([1, 4, 64, 700]))
    return dict(num_slots=int(rng.integers(1, 12)), max_rank=max_rank, slice_widths=widths,
                in_dim=int(rng.choice([16, 111, 2049, 4096])), n_seg=n_seg, max_len=max_len)


@GPU
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_grid(seed, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    rng = np.random.default_rng([100 + seed, [torch.float32, torch.float16, torch.bfloat16].index(dtype)])
    cfg = _gpu_config(rng)
    pop = POPULARITY[seed % len(POPULARITY)]
    case = _popularity_case(rng, pop, dtype, permute=bool(seed % 2), device="cuda", **cfg)
    check_case(case, truth=Reference64)
    if seed % 3 == 0:  # the same batch as a graph-mode info (capacity-padded)
        check_case(case, _capacity_info(case, cap_segments=len(case.seg_lens) + 5, max_seg_len=case.x.shape[0]),
                   truth=Reference64)


@GPU
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("shape", ["qkv", "gate_up", "down"])
@pytest.mark.parametrize("batch", ["decode1", "decode64", "prefill"])
def test_gpu_llama_shapes_bf16(batch, shape, rank):
    """Llama-3-8B module shapes in bf16 through each regime's real block table."""
    check_case(llama_case(batch, shape, rank), truth=Reference64)


@GPU
def test_gpu_fast_launch_reuse_and_alignment(monkeypatch):
    """Later launches reuse the compiled kernel (launch.py): same bits as the first, JIT-launched
    call; a pointer of another alignment (a view 1 element into its storage) gets its own compiled kernel."""
    import importlib

    launch = importlib.import_module("lora_kernels.backends.triton.launch")  # the package re-exports a function of that name
    monkeypatch.setattr(launch, "FAST", True)
    rng = np.random.default_rng(16)
    case = make_case(rng, num_slots=4, max_rank=16, slice_widths=(64, 32), in_dim=256, seg_lens=[1, 1, 1, 1],
                     slots=[0, 3, -1, 1], dtype=torch.bfloat16, device="cuda")
    plan.clear_cache()
    outs = []
    for _ in range(3):
        out = case.base.clone()
        lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    storage = torch.empty(case.x.numel() + 1, dtype=case.x.dtype, device="cuda")
    x_odd = storage[1:].view_as(case.x).copy_(case.x)
    assert x_odd.data_ptr() % 16 != 0
    out = case.base.clone()
    lk.apply_lora(x_odd, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
    assert rel_err(out, outs[0]) <= TOL[torch.bfloat16]  # other vector widths may sum in another order
    p = plan.shrink_plan(256, 2, 16, torch.bfloat16, False, torch.device("cuda"))
    assert len(p.runs) == 2
    check_case(case, truth=Reference64)  # shrink with its reduction, expand: 2-D grids through the cache
    check_case(case, truth=Reference64)
    plan.clear_cache()


@GPU
def test_gpu_eager_workspace_reuse_keeps_every_calls_bits():
    """Eager calls take their split-K workspace from one buffer per (thread, stream) (triton/__init__.py _workspace),
    grown when a bigger batch needs more: a call between two others of another size, on the same stream and on a
    second one, and from a second thread, gives each batch the bits it gets alone; a graph capture takes its own."""
    import threading

    from lora_kernels.backends import triton as tb

    rng = np.random.default_rng(29)
    small, big = (make_case(rng, num_slots=4, max_rank=16, slice_widths=(64, 32), in_dim=1024, seg_lens=lens,
                            slots=slots, dtype=torch.bfloat16, device="cuda")
                  for lens, slots in (([1, 1], [0, 3]), ([7, 20, 9, 12], [1, 0, 3, 2])))

    def run(case):
        out = case.base.clone()
        lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
        return out

    tb._ws.clear()
    first_small, first_big = run(small), run(big)
    assert len(tb._ws) == 1  # one (thread, device, stream) buffer, grown for the big batch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = [run(small), run(big), run(small)]
    torch.cuda.current_stream().wait_stream(side)
    results = {}
    worker = threading.Thread(target=lambda: results.setdefault("t", [run(big), run(small)]))
    worker.start()
    worker.join()
    torch.cuda.synchronize()
    assert len(tb._ws) == 3
    for got, want in zip(on_side + results["t"] + [run(small)],
                         [first_small, first_big, first_small, first_big, first_small, first_small]):
        assert torch.equal(got, want)
    graph, out = torch.cuda.CUDAGraph(), small.base.clone()
    with torch.cuda.graph(graph):
        lk.apply_lora(small.x, out, small.lora_a, small.lora_b, small.info, small.slice_offsets, backend="triton")
    assert len(tb._ws) == 3  # the capture allocated from its graph's pool
    out.copy_(small.base)
    graph.replay()
    assert torch.equal(out, first_small)
    check_case(big, truth=Reference64)


def test_c_launch_only_for_the_scratch_free_triton_36_launcher(monkeypatch):
    """launch.py calls a compiled launcher's C launch directly only where its __call__ is Triton 3.6's (which adds
    the cooperative and PDL flags and two scratch buffers, None when the kernel needs none). A cached launch through
    launch.launch then hands the C launch exactly what __call__ would; another form, or a kernel with scratch
    memory, keeps __call__."""
    import importlib

    launch = importlib.import_module("lora_kernels.backends.triton.launch")
    seen = []

    class Launcher36:
        launch_cooperative_grid, launch_pdl = False, True
        global_scratch_size = profile_scratch_size = 0

        def launch(self, *args):
            seen.append(args)

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None,
                        None, *args)

    class LauncherOther(Launcher36):
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, *args):
            raise AssertionError("not called")

    class Tensor:  # what launch() reads of a tensor
        device = torch.device("cuda", 0)

        def __init__(self, ptr):
            self.ptr = ptr

        def data_ptr(self):
            return self.ptr

    monkeypatch.setattr(launch, "FAST", True)
    monkeypatch.setattr(launch, "_hooks_empty", lambda: True)
    monkeypatch.setattr(launch, "_raw_stream", lambda dev: "stream")
    run = Launcher36()
    c = launch._c_launch(run)
    assert c is not None and c[1:] == (False, True)
    tensors, grid = (Tensor(4096), Tensor(8192)), (6,)
    runs = {("tag", 0, grid): (None, ("const",), run, (6, 1, 1), "function", "meta", c)}
    launch.launch(None, runs, "tag", grid, tensors, (7, 8), {})
    run(6, 1, 1, "stream", "function", "meta", None, None, None, 4096, 8192, 7, 8, "const")  # the __call__ form
    assert len(seen) == 2 and seen[0] == seen[1]
    assert launch._c_launch(LauncherOther()) is None
    scratch = Launcher36()
    scratch.global_scratch_size = 256
    assert launch._c_launch(scratch) is None
    assert launch._c_launch(object()) is None


@GPU
def test_gpu_fast_launch_skips_the_runner_unless_a_hook_is_registered(monkeypatch):
    """Cached launches call Triton's C launch directly (no launch metadata, no hook calls); while a launch hook is
    registered (a profiler) they go through the runner, so the hook sees every launch. All give the first call's
    bits."""
    import importlib

    from triton import knobs

    launch = importlib.import_module("lora_kernels.backends.triton.launch")
    monkeypatch.setattr(launch, "FAST", True)
    case = make_case(np.random.default_rng(17), num_slots=4, max_rank=16, slice_widths=(64, 32), in_dim=256,
                     seg_lens=[1, 2, 1], slots=[0, 3, 1], dtype=torch.bfloat16, device="cuda")
    plan.clear_cache()

    def run():
        out = case.base.clone()
        lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
        return out

    first = run()  # compiles and caches the launchers
    seen = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not launch._hooks_empty()
        hooked = run()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) >= 2, "the registered hook saw no launch"
    assert launch._hooks_empty()
    direct = run()
    assert torch.equal(hooked, first) and torch.equal(direct, first)
    check_case(case, truth=Reference64)
    plan.clear_cache()


@GPU
@pytest.mark.parametrize("shape", ["qkv", "down"])
def test_gpu_batch_invariance(shape):
    """The same 3 rows inside decode batches of 1..256 requests (shuffled, sorted or not, eager infos and
    graph-mode infos) give bit-identical outputs in bf16 on Llama-3-8B shapes."""
    in_dim, widths = {"qkv": (4096, (4096, 1024, 1024)), "down": (14336, (4096,))}[shape]
    _check_invariance(np.random.default_rng(22), torch.bfloat16, "cuda", in_dim=in_dim, widths=widths, max_rank=16,
                      sizes=(1, 16, 64, 256, 100), num_slots=32, cuda_graph_sizes=(1, 3))


@GPU
def test_gpu_graph_replay_equals_eager_bitwise():
    """A graph captured once with graph-mode infos replays later batches (other sizes, sorted) bit-identically
    to eager calls on the same infos."""
    rng = np.random.default_rng(23)
    in_dim, offs, R, slots_n = 1024, (0, 512, 640, 768), 16, 8
    a = (torch.randn(slots_n, 3 * R, in_dim, device="cuda") * in_dim ** -0.5).bfloat16()
    b = (torch.randn(slots_n, offs[-1], R, device="cuda") * R ** -0.5).bfloat16()
    ranks = torch.tensor([int(r) for r in rng.integers(1, R + 1, slots_n)], dtype=torch.int32, device="cuda")
    scal = torch.rand(slots_n, device="cuda") + 0.5
    builder = lk.BatchInfoBuilder(256, 64, ranks, scal, cuda_graph=True)
    x = torch.randn(256, in_dim, device="cuda").bfloat16()
    out = torch.empty(256, offs[-1], device="cuda", dtype=torch.bfloat16)
    base = torch.randn_like(out)
    for sort in (False, True):
        info = builder.build([3, 1, 7], [0, 5, -1], sort_by_adapter=sort)
        out.copy_(base)
        lk.apply_lora(x, out, a, b, info, offs, backend="triton")  # warm-up (compiles)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            lk.apply_lora(x, out, a, b, info, offs, backend="triton")
        for counts in ([5, 9, 1, 30], [64] * 4, [2] * 32 + [1] * 32):
            slots = [int(s) for s in rng.integers(-1, slots_n, len(counts))]
            info2 = builder.build(counts, slots, sort_by_adapter=sort)
            assert builder.graph_family(info2) == builder.graph_family(info)
            out.copy_(base)
            g.replay()
            replayed = out.clone()
            out.copy_(base)
            lk.apply_lora(x, out, a, b, info2, offs, backend="triton")
            assert torch.equal(replayed, out)


def test_jit_functions_take_no_default_arguments():
    """Triton 3.6 (the GPU machine's) hands a called @triton.jit function's default values to it unwrapped: a
    string constexpr default failed every Triton kernel's compilation there (H200 run of 6eeb8e0: 176 tests),
    while the local Triton accepts it. So no jit function in the package declares a default."""
    import ast
    from pathlib import Path

    found = []
    for path in sorted((Path(__file__).resolve().parent.parent / "lora_kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                if node.args.defaults or any(d is not None for d in node.args.kw_defaults):
                    found.append(f"{path.name}:{node.lineno} {node.name}")
    assert not found, found


_VECTOR_AOT = r'''
import json, re
from lora_kernels.backends.triton import kernels
out = []
for S, R, sp, offs, ep in llama_plans(True, modules=LLAMA_MODULES[:2]):
    k = compile90(kernels._expand_kernel, {**ep.kw, "PDL": True}, ("v_ptr:fp32", "b_ptr:bf16", "out_ptr:bf16"),
                  ("MT", "R", "NR", "OUT", "num_rows", "off1", "off2", "off3", "t1", "t2", "t3"), scalings=True,
                  div16=("R", "NR", "OUT", "off1", "off2", "off3"))
    ptx = k.asm["ptx"]
    out.append({"R": R, "b16": len(re.findall(r"ld\.global(\.\w+)*\.b16", ptx)),
                "vector": len(re.findall(r"ld\.global(\.\w+)*\.v[24]\.", ptx))})
print(json.dumps(out))
'''


def test_expand_loads_are_vectorized_for_sm90():
    """The expand's B blocks and v partials are read with vector loads at the Llama shapes (compiled for sm90 with
    the divisibility the runtime specializes on). Their mask once used the rank read from memory, which left
    every B element a scalar 2-byte load (and the column loop unpipelinable); the H200 A/B of the fix: r64 decode
    bs256 167 -> 136 µs per layer."""
    pytest.importorskip("triton.backends.nvidia")
    from cases import compile_for_sm90

    for k in compile_for_sm90(_VECTOR_AOT):
        assert k["b16"] == 0 and k["vector"] > 0, k
