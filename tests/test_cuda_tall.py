"""The cuda backend's expand kernels chosen by rows (csrc/ops/sgmv_plan.h): from 1024 rows of out, where the work list
is dense and has 64 folded items or more (prefill_plan), the flat expand (R <= 16), the warpgroup-MMA expand (R <= 64,
v of out's dtype, sm_90a), the register expand (R <= 64) or the tall expand (items of four work-list tiles), the
streaming warps (R <= 16) from 2 rows (R <= 64 where every tile is one row, from 128 rows), the 16-row kernel (8-warp
CTAs at one row, else 4) at one row and beyond R = 16.
Every row has the same bits under each (batch invariance across the switches), right against float64, rows without
LoRA untouched. Item groups that mix slots, slot -1, short tiles, ranks below the pool rank and several rank
slabs all occur here, and persistent CTAs that take many items each."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import lora_kernels as lk
import lora_kernels._build_meta as build_meta
from cases import TOL, launched_sgmv_kernels, make_info, poisoned_weights, reference_apply, rel_err

HAS_EXT = lk.HAS_CUDA_EXT and torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_EXT, reason="needs the CUDA extension and a GPU")]

TALL_ROWS = 1024  # kTallExpandRows (csrc/ops/sgmv_plan.h)
REGS_MAX_R = 64  # kRegsMaxR (csrc/kernels/sgmv_expand_regs.cuh)
FLAT_MAX_R = 16  # kFlatMaxR (csrc/kernels/sgmv_expand_flat.cuh)
SM90A = HAS_EXT and torch.cuda.get_device_capability() == (9, 0) and "9.0a" in build_meta.CUDA_ARCHS


def prefill_expand(R: int, v_of_t: bool = True) -> str:
    """The name of the expand kernel the prefill plans launch at pool rank R (16-byte aligned v): up to R = 64 the
    warpgroup-MMA form where v is of out's dtype on sm_90a (csrc/ops/sgmv_expand.cu), else the register expand."""
    if R <= FLAT_MAX_R:
        return "expand_flat"
    if R <= REGS_MAX_R:
        return "expand_wgmma" if v_of_t and SM90A else "expand_regs"
    return "expand_tall"


SEGMENTS = ([5, 17, 33, 1, 0, 100, 64, 3, 16, 48], [0, 1, 2, -1, 3, 1, 1, 4, 0, 2])  # 287 rows: tiles of mixed slots
SHAPES = {  # R, slice widths, pool ranks (some below R, several 64-wide rank slabs where R > 64)
    "qkv_r16": (16, (4096, 1024, 1024), [16, 8, 16, 3, 16, 12]),
    "narrow_r136": (136, (24, 200, 128), [136, 70, 1, 136, 64, 100]),
    "gate_up_r64": (64, (512, 136), [64, 32, 64, 5, 64, 64]),
}


def _problem(g, dtype, shape, in_dim=256):
    """Weights of SHAPES[shape] (NaN past each slot's rank), scalings, and x, base out and v for the rows of
    SEGMENTS, fresh from g."""
    R, widths, ranks = SHAPES[shape]
    a, b, offs = poisoned_weights(g, dtype, in_dim, R, widths, ranks)
    scal = (torch.rand(len(ranks), generator=g) + 0.5).cuda()
    n = sum(SEGMENTS[0])
    x = torch.randn(n, in_dim, generator=g).to(dtype).cuda()
    base = torch.randn(n, offs[-1], generator=g).to(dtype).cuda()
    v = torch.randn(n, len(widths) * R, generator=g).cuda()
    return a, b, offs, scal, x, base, v


def _info(seg_lens, slots, ranks, scal):
    return make_info(seg_lens, slots, None, torch.tensor(ranks, dtype=torch.int32, device="cuda"), scal, "cuda")


def _assert_alone_equal(i, slot, ranks, scal, x, v, a, b, offs, base, out, e):
    """Row i run alone (one row of `slot`: the one-row kernel) is torch.equal to its batch results `out` (apply_lora)
    and `e` (sgmv_expand on v), and not its base row."""
    one = _info([1], [slot], ranks, scal)
    o1, e1 = base[i:i + 1].clone(), base[i:i + 1].clone()
    lk.apply_lora(x[i:i + 1], o1, a, b, one, offs, backend="cuda")
    lk.sgmv_expand(v[i:i + 1], b, one, offs, e1, backend="cuda")
    assert torch.equal(o1, out[i:i + 1]) and torch.equal(e1, e[i:i + 1]), (i, slot)
    assert not torch.equal(o1, base[i:i + 1])


@pytest.mark.parametrize("in_dim", [256, 1024], ids=["k256", "k1024"])
@pytest.mark.parametrize("filler_first", [False, True], ids=["filler_last", "filler_first"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tall_expand_has_the_16_row_bits(dtype, shape, filler_first, in_dim):
    """The rows of SEGMENTS alone (287 rows: the 16-row or streaming kernel) and inside a batch with a 4100-row
    segment (the register or tall kernel, the rows' tiles grouped differently by where the filler sits): torch.equal,
    for apply_lora and for sgmv_expand on a given v (fp32 and the adapters' dtype); the big batch is right against
    float64 and leaves rows of slot -1 untouched. At in_dim 1024 the shrink splits K, and the big batch's planes are
    summed once into a v of the adapters' dtype before its expand."""
    R, widths, ranks = SHAPES[shape]
    g = torch.Generator().manual_seed(4 * list(SHAPES).index(shape) + 2 * filler_first + (in_dim > 256))
    a, b, offs, scal, x, base, v = _problem(g, dtype, shape, in_dim)
    in_dim = x.shape[1]
    seg_lens, slots = SEGMENTS
    n = sum(seg_lens)
    fill = 4100
    xf = torch.randn(fill, in_dim, generator=g).to(dtype).cuda()
    bf = torch.randn(fill, offs[-1], generator=g).to(dtype).cuda()
    vf = torch.randn(fill, len(widths) * R, generator=g).cuda()
    if filler_first:
        big = ([fill] + seg_lens, [5] + slots, torch.cat([xf, x]), torch.cat([bf, base]), torch.cat([vf, v]))
        mine = slice(fill, fill + n)
    else:
        big = (seg_lens + [fill], slots + [5], torch.cat([x, xf]), torch.cat([base, bf]), torch.cat([v, vf]))
        mine = slice(0, n)
    info_s, info_b = _info(seg_lens, slots, ranks, scal), _info(big[0], big[1], ranks, scal)
    assert n < TALL_ROWS <= big[2].shape[0]

    out_s, out_b = base.clone(), big[3].clone()
    lk.apply_lora(x, out_s, a, b, info_s, offs, backend="cuda")
    names = launched_sgmv_kernels(lambda: lk.apply_lora(big[2], out_b, a, b, info_b, offs, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert any(prefill_expand(R) in k for k in names), names
    assert torch.equal(out_b[mine], out_s)
    for vd in (torch.float32, dtype):  # v in fp32 and in the adapters' dtype: both kernels' V instantiations
        e_s, e_b = base.clone(), big[3].clone()
        lk.sgmv_expand(v.to(vd), b, info_s, offs, e_s, backend="cuda")
        names = launched_sgmv_kernels(lambda: lk.sgmv_expand(big[4].to(vd), b, info_b, offs, e_b, backend="cuda"))
        if not os.environ.get("LORA_KERNELS_SANITIZER"):
            assert any(prefill_expand(R, vd == dtype) in k for k in names), (vd, names)
        assert torch.equal(e_b[mine], e_s)

    no_lora = torch.zeros(n, dtype=torch.bool, device="cuda")
    no_lora[sum(seg_lens[:3]):sum(seg_lens[:4])] = True  # the slot -1 segment
    assert torch.equal(out_s[no_lora], base[no_lora]) and not torch.equal(out_s[~no_lora], base[~no_lora])
    ref = reference_apply(big[2], big[3], a, b, info_b, offs)
    assert rel_err(out_b, ref) <= TOL[dtype]


@pytest.mark.parametrize("shape", ["qkv_r16", "gate_up_r64"])
def test_prefill_expands_need_a_16_byte_aligned_v(shape):
    """sgmv_expand at 4100 rows on a bf16 v that starts 8 bytes past a 16-byte boundary (contiguous, 4-element
    aligned): the tall kernel takes it (the flat, warpgroup-MMA and register expands copy v in 16-byte chunks), with
    the bits of the flat (R = 16) or warpgroup-MMA (R = 64) expand on the aligned copy of the same v."""
    R, widths, ranks = SHAPES[shape]
    g = torch.Generator().manual_seed(77 + list(SHAPES).index(shape))
    a, b, offs, scal, x, base, v = _problem(g, torch.bfloat16, shape)
    rows = 4100
    info = _info([rows], [1], ranks, scal)
    out0 = torch.randn(rows, offs[-1], generator=g).to(torch.bfloat16).cuda()
    v16 = torch.randn(rows, len(widths) * R, generator=g).to(torch.bfloat16).cuda()
    flat = torch.empty(v16.numel() + 4, dtype=torch.bfloat16, device="cuda")
    v8 = flat[4:].view(v16.shape)
    v8.copy_(v16)
    assert v8.is_contiguous() and v8.data_ptr() % 16 == 8
    e16, e8 = out0.clone(), out0.clone()
    n16 = launched_sgmv_kernels(lambda: lk.sgmv_expand(v16, b, info, offs, e16, backend="cuda"))
    n8 = launched_sgmv_kernels(lambda: lk.sgmv_expand(v8, b, info, offs, e8, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert any(prefill_expand(R) in k for k in n16) and any("expand_tall" in k for k in n8), (n16, n8)
    assert torch.equal(e8, e16) and not torch.equal(e16, out0)


@pytest.mark.parametrize("shape", ["qkv_r16", "gate_up_r64"])
def test_prefill_expands_take_permuted_rows_with_the_same_bits(shape):
    """The 4100-row segment and the rows of SEGMENTS in a permuted batch (segmented row i at physical row perm[i], as a
    sorted batch has them): every row torch.equal to the batch in order, for the flat (R = 16) and warpgroup-MMA
    (R = 64) expands, whose out rows are read and written through perm."""
    R, widths, ranks = SHAPES[shape]
    g = torch.Generator().manual_seed(131 + list(SHAPES).index(shape))
    a, b, offs, scal, x, base, _ = _problem(g, torch.bfloat16, shape)
    fill = 4100
    xs = torch.cat([torch.randn(fill, x.shape[1], generator=g).to(x.dtype).cuda(), x])
    bases = torch.cat([torch.randn(fill, offs[-1], generator=g).to(base.dtype).cuda(), base])
    seg_lens, slots = [fill] + SEGMENTS[0], [5] + SEGMENTS[1]
    n = xs.shape[0]
    perm = torch.randperm(n, generator=g)
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    in_order = make_info(seg_lens, slots, None, ranks_t, scal, "cuda")
    permuted = make_info(seg_lens, slots, perm.numpy(), ranks_t, scal, "cuda")
    pc = perm.cuda()
    xp, bp = torch.empty_like(xs), torch.empty_like(bases)
    xp[pc], bp[pc] = xs, bases
    out, outp = bases.clone(), bp.clone()
    lk.apply_lora(xs, out, a, b, in_order, offs, backend="cuda")
    names = launched_sgmv_kernels(lambda: lk.apply_lora(xp, outp, a, b, permuted, offs, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):
        assert any(prefill_expand(R) in k for k in names), names
    assert torch.equal(outp[pc], out) and not torch.equal(out, bases)


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_prefill_step_takes_the_decode_plans_with_the_same_bits(shape):
    """A 4100-row chunk beside 63 one-row segments: 4163 rows but 257 + 63 work-list tiles, a sparse list
    (sgmv_plan.h: prefill_plan), so the decode plans run (split-K planes, no register, tall or warpgroup-MMA kernel).
    The chunk's rows torch.equal to the chunk alone (a dense list: the prefill plans), decode rows to the row alone,
    for apply_lora and sgmv_expand on a given v; right against float64. in_dim 1024: the shrink splits K."""
    R, widths, ranks = SHAPES[shape]
    dtype, chunk, dec = torch.bfloat16, 4100, 63
    g = torch.Generator().manual_seed(97 + list(SHAPES).index(shape))
    a, b, offs = poisoned_weights(g, dtype, 1024, R, widths, ranks)
    scal = (torch.rand(len(ranks), generator=g) + 0.5).cuda()
    n = chunk + dec
    x = torch.randn(n, 1024, generator=g).to(dtype).cuda()
    base = torch.randn(n, offs[-1], generator=g).to(dtype).cuda()
    v = torch.randn(n, len(widths) * R, generator=g).cuda()
    slots = [5] + [int(s) for s in torch.randint(0, len(ranks), (dec,), generator=g)]
    info = _info([chunk] + [1] * dec, slots, ranks, scal)
    assert info.max_tiles == 257 + dec
    out, e = base.clone(), base.clone()
    names = launched_sgmv_kernels(lambda: lk.apply_lora(x, out, a, b, info, offs, backend="cuda"))
    lk.sgmv_expand(v, b, info, offs, e, backend="cuda")
    alone = _info([chunk], [5], ranks, scal)
    out_c, e_c = base[:chunk].clone(), base[:chunk].clone()
    names_c = launched_sgmv_kernels(lambda: lk.apply_lora(x[:chunk], out_c, a, b, alone, offs, backend="cuda"))
    lk.sgmv_expand(v[:chunk], b, alone, offs, e_c, backend="cuda")
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        prefill = ("expand_regs", "expand_flat", "expand_tall", "expand_wgmma", "shrink_wgmma")
        assert not any(p in k for k in names for p in prefill), names
        assert any(p in k for k in names_c for p in prefill[:4]), names_c
    assert torch.equal(out[:chunk], out_c) and torch.equal(e[:chunk], e_c)
    assert rel_err(out, reference_apply(x, base, a, b, info, offs)) <= TOL[dtype]
    for i in (chunk, chunk + 1, chunk + 31, n - 1):
        _assert_alone_equal(i, slots[i - chunk + 1], ranks, scal, x, v, a, b, offs, base, out, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_row_has_the_batch_bits(dtype):
    """A row alone (the 16-row kernel) and inside the 287 rows of SEGMENTS (r16: the streaming warps): torch.equal,
    for apply_lora and sgmv_expand, at each of its slots' ranks."""
    ranks = SHAPES["qkv_r16"][2]
    a, b, offs, scal, x, base, v = _problem(torch.Generator().manual_seed(31), dtype, "qkv_r16")
    seg_lens, slots = SEGMENTS
    info = _info(seg_lens, slots, ranks, scal)
    out, e = base.clone(), base.clone()
    names = launched_sgmv_kernels(lambda: lk.apply_lora(x, out, a, b, info, offs, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert any("expand_stream" in k for k in names), names
    lk.sgmv_expand(v, b, info, offs, e, backend="cuda")
    starts = np.concatenate([[0], np.cumsum(seg_lens)])
    for k, slot in enumerate(slots):
        if seg_lens[k] == 0 or slot < 0:
            continue
        _assert_alone_equal(int(starts[k] + seg_lens[k] // 2), slot, ranks, scal, x, v, a, b, offs, base, out, e)


WIDE = {"r32": (32, (256, 72), [32, 8, 32, 17, 32, 1]), "gate_up_r64": SHAPES["gate_up_r64"]}


@pytest.mark.parametrize("rows", [128, 200])
@pytest.mark.parametrize("in_dim", [256, 1024], ids=["k256", "k1024"])
@pytest.mark.parametrize("shape", WIDE)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_row_tiles_stream_beyond_r16_with_the_16_row_bits(dtype, shape, in_dim, rows):
    """R = 32 / 64, a batch of one-row segments from 128 rows (as many tiles as rows: the streaming warps, 2 or 4 k16
    steps an item) against the same rows in two-row segments (the 16-row kernel): torch.equal for apply_lora (at
    in_dim 1024 the shrink's K splits, summed by a kernel of their own first) and for sgmv_expand on a given v (fp32
    and the adapters' dtype); right against float64; rows of slot -1 untouched."""
    R, widths, ranks = WIDE[shape]
    g = torch.Generator().manual_seed(97 + 4 * list(WIDE).index(shape) + 2 * (in_dim > 256) + (rows > 128))
    a, b, offs = poisoned_weights(g, dtype, in_dim, R, widths, ranks)
    scal = (torch.rand(len(ranks), generator=g) + 0.5).cuda()
    pair_slots = [int(s) for s in torch.randint(-1, len(ranks), (rows // 2,), generator=g)]
    pair_slots[1] = -1
    x = torch.randn(rows, in_dim, generator=g).to(dtype).cuda()
    base = torch.randn(rows, offs[-1], generator=g).to(dtype).cuda()
    v = torch.randn(rows, len(widths) * R, generator=g).cuda()
    ones = _info([1] * rows, [s for s in pair_slots for _ in range(2)], ranks, scal)
    pairs = _info([2] * (rows // 2), pair_slots, ranks, scal)
    assert ones.max_tiles == rows and pairs.max_tiles < rows

    o1, o2 = base.clone(), base.clone()
    n1 = launched_sgmv_kernels(lambda: lk.apply_lora(x, o1, a, b, ones, offs, backend="cuda"))
    n2 = launched_sgmv_kernels(lambda: lk.apply_lora(x, o2, a, b, pairs, offs, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert any("expand_stream" in k for k in n1) and any("expand_mma" in k for k in n2), (n1, n2)
    assert torch.equal(o1, o2)
    for vd in (torch.float32, dtype):  # both V instantiations
        e1, e2 = base.clone(), base.clone()
        lk.sgmv_expand(v.to(vd), b, ones, offs, e1, backend="cuda")
        lk.sgmv_expand(v.to(vd), b, pairs, offs, e2, backend="cuda")
        assert torch.equal(e1, e2) and not torch.equal(e1, base)
    assert torch.equal(o1[2:4], base[2:4]) and not torch.equal(o1, base)  # rows 2, 3: slot -1
    assert rel_err(o1, reference_apply(x, base, a, b, ones, offs)) <= TOL[dtype]


MANY = {"r64": (64, (14336, 14336), [64, 40, 64, 9, 64, 64]), "r136": (136, (14336, 14336), [136, 70, 1, 136, 64, 100])}


@pytest.mark.parametrize("permuted", [False, True], ids=["in_order", "permuted"])
@pytest.mark.parametrize("shape", MANY)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_row_ctas_of_many_items_have_the_one_row_bits(dtype, shape, permuted):
    """The 16-row kernel's CTAs take several items each (2 x 14336 columns: 224 column tiles a work-list tile, ~20
    tiles: some 5000 items over the grid's 8 CTAs an SM), tiles of slot -1 among them (two in a row), one to three
    64-wide rank slabs. Every row torch.equal to the row alone (the one-row kernel), for apply_lora and sgmv_expand on
    a given v; right against float64; slot -1 rows untouched. Permuted: the segments' rows scattered over the batch
    (a sorted batch's permutation)."""
    R, widths, ranks = MANY[shape]
    g = torch.Generator().manual_seed(211 + 4 * list(MANY).index(shape) + 2 * (dtype == torch.float16) + permuted)
    a, b, offs = poisoned_weights(g, dtype, 256, R, widths, ranks)
    scal = (torch.rand(len(ranks), generator=g) + 0.5).cuda()
    seg_lens = [3, 1, 5, 2, 7, 1, 4, 16, 2, 1, 6, 3, 1, 2, 9, 1, 2, 3, 17, 1]
    slots = [int(s) for s in torch.randint(0, len(ranks), (len(seg_lens),), generator=g)]
    slots[2] = slots[9] = slots[10] = -1  # tiles of no LoRA between live ones
    n = sum(seg_lens)
    x = torch.randn(n, 256, generator=g).to(dtype).cuda()
    base = torch.randn(n, offs[-1], generator=g).to(dtype).cuda()
    v = torch.randn(n, len(widths) * R, generator=g).cuda()
    perm = torch.randperm(n, generator=g).numpy() if permuted else np.arange(n)
    info = make_info(seg_lens, slots, perm if permuted else None, torch.tensor(ranks, dtype=torch.int32, device="cuda"),
                     scal, "cuda")
    out, e = base.clone(), base.clone()
    names = launched_sgmv_kernels(lambda: lk.apply_lora(x, out, a, b, info, offs, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert any("expand_mma" in k for k in names), names
    lk.sgmv_expand(v, b, info, offs, e, backend="cuda")
    assert rel_err(out, reference_apply(x, base, a, b, info, offs)) <= TOL[dtype]
    starts = np.concatenate([[0], np.cumsum(seg_lens)])
    for k, slot in enumerate(slots):
        rows = torch.from_numpy(perm[starts[k]:starts[k + 1]]).cuda()
        if slot < 0:
            assert torch.equal(out[rows], base[rows]) and torch.equal(e[rows], base[rows]), k
            continue
        _assert_alone_equal(int(perm[starts[k + 1] - 1]), slot, ranks, scal, x, v, a, b, offs, base, out, e)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_wide_16_row_expand_sums_the_planes_first_with_the_same_bits(dtype):
    """600 rows in segments of several rows (the 16-row kernel at R = 64), 2 x 14336 columns (224 column tiles) and a
    split K: from 512 rows apply_lora sums v's planes in a kernel of their own before the expand (sgmv_plan.h,
    kReduceFirstRowsMma); below, the expand sums them in each column tile. The first 162 rows alone (the latter)
    torch.equal to the same rows in the 600-row batch (the former); right against float64; slot -1 rows untouched."""
    R, widths, ranks = MANY["r64"]
    g = torch.Generator().manual_seed(307 + (dtype == torch.float16))
    a, b, offs = poisoned_weights(g, dtype, 1024, R, widths, ranks)
    scal = (torch.rand(len(ranks), generator=g) + 0.5).cuda()
    seg_lens, slots = [37, 5, 120, 64, 1, 200, 33, 140], [2, -1, 0, 5, 3, 1, -1, 2]
    n, head = sum(seg_lens), sum(seg_lens[:3])
    x = torch.randn(n, 1024, generator=g).to(dtype).cuda()
    base = torch.randn(n, offs[-1], generator=g).to(dtype).cuda()
    info, info_head = _info(seg_lens, slots, ranks, scal), _info(seg_lens[:3], slots[:3], ranks, scal)
    out, out_head = base.clone(), base[:head].clone()
    names = launched_sgmv_kernels(lambda: lk.apply_lora(x, out, a, b, info, offs, backend="cuda"))
    names_head = launched_sgmv_kernels(lambda: lk.apply_lora(x[:head], out_head, a, b, info_head, offs, backend="cuda"))
    if not os.environ.get("LORA_KERNELS_SANITIZER"):  # the profiler records nothing under compute-sanitizer
        assert any("expand_mma" in k for k in names) and any("reduce" in k for k in names), names
        assert any("expand_mma" in k for k in names_head) and not any("reduce" in k for k in names_head), names_head
    assert torch.equal(out[:head], out_head)
    starts = np.concatenate([[0], np.cumsum(seg_lens)])
    for k in (1, 6):  # slot -1
        assert torch.equal(out[starts[k]:starts[k + 1]], base[starts[k]:starts[k + 1]])
    assert rel_err(out, reference_apply(x, base, a, b, info, offs)) <= TOL[dtype]
