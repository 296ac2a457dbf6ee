"""The cuda backend's tensor-core shrink runs CTAs of 1, 2 or 4 warps by the batch (csrc/ops/sgmv_plan.h,
plan_shrink): one warp for a few rows x columns of v, 4 up to 16 rows and for prefill, 2 between. Each warp computes
its 16 columns alone, so a row has the same bits under every shape: a row's v and its apply_lora output are
torch.equal inside batches of 1, 8, 40 and 4287 rows, and right against float64. At 4287 rows (prefill) each item also
runs its K splits in turn and writes v itself, where smaller batches write fp32 planes that a kernel sums in order: the
same bits; on sm_90a that item is a warpgroup MMA (wgmma) of 64 rows, whose sums are mma.sync's bit for bit. Weights
past each slot's rank are NaN, so a shape that read them would fail."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import lora_kernels as lk
import lora_kernels._build_meta as build_meta
from cases import TOL, launched_sgmv_kernels, make_info, rel_err

HAS_EXT = lk.HAS_CUDA_EXT and torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_EXT, reason="needs the CUDA extension and a GPU")]

SEGMENTS = ([5, 17, 33, 1, 0, 100, 64, 3, 16, 48, 4000], [0, 1, 2, -1, 3, 1, 1, 4, 0, 2, 5])  # 4287 rows (prefill_plan)
ROWS = (1, 8, 40)  # with the whole batch: one warp (r16), one warp or 4 (r64), 2 warps, 4 warps (prefill)
SHAPES = {  # R, slice widths, pool ranks (some below R)
    "qkv_r16": (16, (512, 128, 128), [16, 8, 16, 3, 16, 12]),
    "qkv_r64": (64, (512, 128, 128), [64, 32, 64, 5, 64, 40]),
}


def _first_rows(k):
    """The segments of SEGMENTS cut to their first k rows."""
    lens, slots, left = [], [], k
    for n, s in zip(*SEGMENTS):
        if left == 0:
            break
        lens.append(min(n, left))
        slots.append(s)
        left -= lens[-1]
    return lens, slots


def _problem(g, dtype, shape, in_dim=1024):
    R, widths, ranks = SHAPES[shape]
    offs = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
    n_slots, n = len(ranks), sum(SEGMENTS[0])
    a = (torch.randn(n_slots, len(widths) * R, in_dim, generator=g) * in_dim ** -0.5).to(dtype)
    b = (torch.randn(n_slots, offs[-1], R, generator=g) * R ** -0.5).to(dtype)
    for s, r in enumerate(ranks):  # NaN past each slot's rank: it must never reach an output
        b[s, :, r:] = float("nan")
        for i in range(len(widths)):
            a[s, i * R + r:(i + 1) * R] = float("nan")
    x = torch.randn(n, in_dim, generator=g).to(dtype)
    base = torch.randn(n, offs[-1], generator=g).to(dtype)
    scal = torch.rand(n_slots, generator=g) + 0.5
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    return [t.cuda() for t in (a, b, x, base, scal, ranks_t)] + [offs]


def _reference_v(x, a, info, num_slices):
    from lora_kernels import reference

    v = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64, device="cuda")
    reference.sgmv_shrink(x.double(), a.double().nan_to_num(0), info.seg_indptr, info.weight_indices,
                          info.lora_ranks, info.permutation, num_slices, v)
    return v


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_shrink_shapes_have_the_same_bits(dtype, shape):
    g = torch.Generator().manual_seed(7 + list(SHAPES).index(shape))
    a, b, x, base, scal, ranks, offs = _problem(g, dtype, shape)
    num_slices = len(offs) - 1
    info = make_info(*SEGMENTS, None, ranks, scal, "cuda")
    v_all = torch.full((x.shape[0], a.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
    names = launched_sgmv_kernels(lambda: lk.sgmv_shrink(x, a, info, num_slices, out=v_all, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # prefill: the warpgroup-MMA or the folded shrink, no reduction
        wgmma = torch.cuda.get_device_capability() == (9, 0) and "9.0a" in build_meta.CUDA_ARCHS
        kernel = (lambda n: "shrink_wgmma" in n) if wgmma else (lambda n: "shrink_mma" in n and "true>" in n)
        assert any(kernel(n) for n in names) and not any("reduce" in n for n in names), names
    assert rel_err(v_all, _reference_v(x, a, info, num_slices)) <= TOL[dtype]
    out_all = base.clone()
    lk.apply_lora(x, out_all, a, b, info, offs, backend="cuda")
    shapes = set()
    for k in ROWS:
        lens, slots = _first_rows(k)
        one = make_info(lens, slots, None, ranks, scal, "cuda")
        v = torch.full((k, a.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
        names = launched_sgmv_kernels(lambda: lk.sgmv_shrink(x[:k], a, one, num_slices, out=v, backend="cuda"))
        shapes.update(n for n in names if "shrink_mma" in n)
        assert torch.equal(v, v_all[:k]), k
        out = base[:k].clone()
        lk.apply_lora(x[:k], out, a, b, one, offs, backend="cuda")
        assert torch.equal(out, out_all[:k]), k
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert len(shapes) >= 2, shapes  # the rows above took more than one CTA shape


@pytest.mark.parametrize("stages", [4, 6])
def test_wgmma_stage_forms_have_the_same_bits(stages):
    """On sm_90a the prefill shrink's stages follow its items (64-row groups x 64-column tiles of v) and the SMs
    (csrc/ops/sgmv_plan.h, shrink_wgmma_stages): 8 up to one item an SM, 6 up to two, else 4. Batches sized to take 4
    and 6 stages give every row the bits of the same row in a batch of 37 or 40 rows (the mma.sync kernels, K split
    into planes)."""
    if not (torch.cuda.get_device_capability() == (9, 0) and "9.0a" in build_meta.CUDA_ARCHS):
        pytest.skip("the wgmma shrink needs sm_90a")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    R, in_dim, ranks = 64, 512, [64, 40, 64, 5]
    n_tiles = {4: 3, 6: 2}[stages]  # column tiles of v (S slices of R = 64)
    groups = {4: 2 * sms // n_tiles + 1, 6: sms // n_tiles + 1}[stages]  # items in (2 sms, ...] or (sms, 2 sms]
    rows = 64 * groups
    g = torch.Generator().manual_seed(11 + stages)
    a = (torch.randn(len(ranks), n_tiles * R, in_dim, generator=g) * in_dim ** -0.5).to(torch.bfloat16)
    for s, r in enumerate(ranks):  # NaN past each slot's rank
        for i in range(n_tiles):
            a[s, i * R + r:(i + 1) * R] = float("nan")
    x = torch.randn(rows, in_dim, generator=g).to(torch.bfloat16)
    a, x = a.cuda(), x.cuda()
    ranks_t, scal = torch.tensor(ranks, dtype=torch.int32, device="cuda"), torch.ones(len(ranks), device="cuda")
    lens = [1000, 37, rows - 1037 - 400, 400]
    slots = [0, 1, 2, 3]
    v_all = torch.full((rows, a.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
    info = make_info(lens, slots, None, ranks_t, scal, "cuda")
    names = launched_sgmv_kernels(lambda: lk.sgmv_shrink(x, a, info, n_tiles, out=v_all, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):
        assert any("shrink_wgmma" in n and f", {stages}>" in n for n in names), names
    assert rel_err(v_all, _reference_v(x, a, info, n_tiles)) <= TOL[torch.bfloat16]
    for start, n, slot in ((0, 40, 0), (1000, 37, 1), (1101, 40, 2), (rows - 40, 40, 3)):  # inside one segment
        one = make_info([n], [slot], None, ranks_t, scal, "cuda")
        v = torch.full((n, a.shape[1]), float("nan"), dtype=torch.float32, device="cuda")
        lk.sgmv_shrink(x[start:start + n], a, one, n_tiles, out=v, backend="cuda")
        assert torch.equal(v, v_all[start:start + n]), start
