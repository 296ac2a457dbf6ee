"""CUDA graphs (GPU): the Triton ops captured once replay correctly for other batches of the same
capacity, bit for bit equal to eager calls, with infos from the graph-mode BatchInfoBuilder."""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import TOL, popularity_slots, rel_err
from lora_kernels import reference

pytestmark = pytest.mark.gpu

MAX_TOKENS, MAX_SEGMENTS, NUM_SLOTS, RANK = 48, 12, 6, 16
IN_DIM, OFFSETS = 256, (0, 256, 320, 384)


def _batches(family, rng):
    """Three different batches of one graph family (decode: one row per request)."""
    out = []
    for n in (5, MAX_SEGMENTS, 8):
        slots = [int(s) for s in popularity_slots("uniform", n, NUM_SLOTS, rng)]
        slots[int(rng.integers(n))] = -1
        counts = [1] * n if family == "decode" else [int(c) for c in rng.multinomial(MAX_TOKENS - 3, [1 / n] * n)]
        out.append((counts, slots))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", ["decode", "general", "sorted"])
def test_graph_replay_equals_eager(family, dtype):
    rng = np.random.default_rng([len(family), dtype.itemsize])
    dev = "cuda"
    ranks = torch.tensor([RANK, 3, 0, 9, RANK, 1], dtype=torch.int32, device=dev)
    scalings = torch.tensor(rng.uniform(0.5, 2, NUM_SLOTS), dtype=torch.float32, device=dev)
    builder = lk.BatchInfoBuilder(MAX_TOKENS, MAX_SEGMENTS, ranks, scalings, cuda_graph=True)
    S = len(OFFSETS) - 1
    lora_a = torch.randn(NUM_SLOTS, S * RANK, IN_DIM, device=dev).div_(IN_DIM ** 0.5).to(dtype)
    lora_b = torch.randn(NUM_SLOTS, OFFSETS[-1], RANK, device=dev).div_(RANK ** 0.5).to(dtype)
    x = torch.empty(MAX_TOKENS, IN_DIM, dtype=dtype, device=dev)
    out = torch.empty(MAX_TOKENS, OFFSETS[-1], dtype=dtype, device=dev)
    v = torch.empty(MAX_TOKENS, S * RANK, dtype=torch.float32, device=dev)
    sort = family == "sorted"
    batches = _batches("decode" if family == "decode" else "general", rng)

    def step(info):
        lk.sgmv_shrink(x, lora_a, info, S, out=v, backend="triton")
        lk.apply_lora(x, out, lora_a, lora_b, info, OFFSETS, backend="triton")

    info0 = builder.build(*batches[0], sort_by_adapter=sort)
    x.normal_()
    out.normal_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        step(info0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(info0)

    for counts, slots in batches:
        info = builder.build(counts, slots, sort_by_adapter=sort)
        assert builder.graph_family(info) == builder.graph_family(info0)
        x.normal_()
        base = torch.randn_like(out)
        # eager, on the same static tensors
        out.copy_(base)
        v.fill_(float("nan"))
        step(info)
        eager_out, eager_v = out.clone(), v.clone()
        # replay
        out.copy_(base)
        v.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out), f"replay differs from eager for batch {counts} {slots}"
        assert torch.equal(v.nan_to_num(7.0), eager_v.nan_to_num(7.0))
        # and both are right
        ref = base.double().clone()
        v_ref = torch.zeros(MAX_TOKENS, S * RANK, dtype=torch.float64, device=dev)
        args = (info.seg_indptr, info.weight_indices, info.lora_ranks)
        reference.sgmv_shrink(x.double(), lora_a.double(), *args, info.permutation, S, v_ref)
        reference.sgmv_expand(v_ref, lora_b.double(), *args, info.scalings, info.permutation, OFFSETS, ref)
        assert rel_err(out, ref) <= TOL[dtype]
        rows = torch.zeros(MAX_TOKENS, dtype=torch.bool, device=dev)
        rows[: sum(counts)] = True  # rows of this batch; v of the others is unspecified
        assert rel_err(v[rows], v_ref[rows]) <= TOL[dtype] * 0.1 + 1e-12
