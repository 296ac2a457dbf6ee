"""The tall-tile path of the Triton backend (backends/triton/tall.py), for long segments.

It must give the bits of the split-K path (so that choosing it by the number of rows keeps batch
invariance) and be right against float64, for segments of every length around the 16-row tile and the
groups of tiles (runs that start and end inside a group, several segments in one group), slot -1 segments,
several slices, split-K and not, sorted rows. CPU: the interpreter (fp32 / fp16; its numpy dots depend on the
tile height, so exact bits there with groups of one tile, float64 checks with taller ones); GPU: bf16 bits at
the Llama shapes of a prefill.
"""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import TOL, compile_for_sm90, make_case, rel_err
from lora_kernels import backends
from lora_kernels.backends import triton as tb
from lora_kernels.backends.triton import plan
from test_triton import SMALL_TABLE, RowLoop

pytestmark = pytest.mark.skipif(backends.unavailable("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
                                is not None, reason="Triton backend unavailable")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _apply(monkeypatch, base: dict, case, min_rows: int, **tall):
    monkeypatch.setattr(plan, "TABLE", {**base, "tall": {**plan.tall_config(), "min_rows": min_rows, "min_rank": 0,
                                                         "dense_tiles": 0, "min_items": 0, **tall}})
    path = plan.apply_path(case.x.shape[0], case.lora_b.shape[2], case.lora_a.shape[1], case.info.max_tiles)
    assert path[0] == ("tall" if min_rows else "split")
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
    return out


CASES = [  # (seg_lens, in_dim, widths, max_rank, permute): lengths around 16, 32 and 64, split-K or not, slices
    ((1, 15, 16, 17), 96, (32, 16), 16, False),
    ((63, 64, 65, 3), 64, (48,), 8, True),
    ((130, 1, 47, 80), 40, (24, 8, 8), 16, False),
    ((100, 2, 33), 130, (16, 16, 16, 16), 4, True),
]
GROUPS = {"one": dict(shrink_group=1, expand_group=1, expand_group_wide=1),  # 16-row dots: the split path's bits
          "table": {},  # the tall entry's groups (2 and 4 tiles by default)
          "eight": dict(shrink_group=8, expand_group=8, expand_group_wide=8)}


def _check(case, out) -> None:
    ref = RowLoop(case, case.info)
    v_ref, _ = ref.shrink()
    assert rel_err(out, ref.expand(v_ref.nan_to_num(0), case.base)) <= TOL[case.x.dtype]
    untouched = torch.ones(case.x.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[torch.tensor(case.perm, dtype=torch.long, device=DEVICE)] = False
    assert torch.equal(out[untouched], case.base[untouched]), "rows outside the batch were written"


@pytest.mark.parametrize("groups", list(GROUPS))
@pytest.mark.parametrize("table", ["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", range(len(CASES)))
def test_tall_equals_split_path_and_reference(monkeypatch, table, dtype, k, groups):
    if table == "small" and dtype != torch.float32:
        pytest.skip("the tiny table reaches the same paths in fp32 (the interpreter is slow)")
    plan.clear_cache()  # recipes of earlier tests in this process (the table's own tall entry makes some)
    seg_lens, in_dim, widths, max_rank, permute = CASES[k]
    rng = np.random.default_rng([k, dtype.itemsize, 4])
    case = make_case(rng, num_slots=5, max_rank=max_rank, slice_widths=widths, in_dim=in_dim, seg_lens=seg_lens,
                     dtype=dtype, device=DEVICE, permute=permute, extra_rows=3)
    base = SMALL_TABLE if table == "small" else dict(plan.TABLE)
    split = _apply(monkeypatch, base, case, 0)
    # The interpreter's dots are exact only between tiles of one shape: the small table's column tiles too.
    tiles = dict(shrink_n=16, expand_n=16) if table == "small" else {}
    tall = _apply(monkeypatch, base, case, 1, **GROUPS[groups], **tiles)
    if DEVICE == "cuda" or groups == "one":
        assert torch.equal(tall, split), "the tall-tile path changed bits"
    recipes = [r for k, r in plan._cache.items() if k[0] == "apply" and k[-1][0] == "tall"]
    assert len(recipes) == 1 and recipes[0].mode == "tall"
    assert [s.kernel for s in recipes[0].steps] == [tb._tall_shrink_kernel, tb._tall_expand_kernel]
    _check(case, tall)
    plan.clear_cache()


@pytest.mark.parametrize("out_dtype", ["fp32", "input"])
@pytest.mark.parametrize("k", [0, 2])
def test_sgmv_shrink_takes_the_tall_shrink_with_the_same_bits(monkeypatch, k, out_dtype):
    """sgmv_shrink on as many rows as the tall path's: the tall shrink alone (one launch, no partials), the split
    path's bits into an fp32 v or one of x's dtype (fp16), zeros for slot -1 rows and columns beyond the rank, rows
    outside the batch untouched."""
    plan.clear_cache()
    seg_lens, in_dim, widths, max_rank, permute = CASES[k]
    dtype = torch.float32 if out_dtype == "fp32" else torch.float16
    case = make_case(np.random.default_rng([k, 7]), num_slots=5, max_rank=max_rank, slice_widths=widths,
                     in_dim=in_dim, seg_lens=seg_lens, dtype=dtype, device=DEVICE, permute=permute, extra_rows=3)
    S, T = len(widths), case.x.shape[0]
    outs = []
    for min_rows in (0, 1):
        tiles = dict(shrink_n=16, shrink_group=1) if DEVICE == "cpu" else {}  # the interpreter: one tile shape
        monkeypatch.setattr(plan, "TABLE", {**SMALL_TABLE, "tall": {**plan.tall_config(), "min_rows": min_rows,
                                                                    "min_rank": 0, "dense_tiles": 0, "min_items": 0,
                                                                    **tiles}})
        out = torch.full((T, S * max_rank), float("nan"), dtype=dtype, device=DEVICE)
        lk.sgmv_shrink(case.x, case.lora_a, case.info, S, out=out, backend="triton")
        outs.append(out)
    recipes = [r for key, r in plan._cache.items() if key[0] == "shrink" and key[-1][0] == "tall"]
    assert len(recipes) == 1 and [s.kernel for s in recipes[0].steps] == [tb._tall_shrink_kernel]
    v_ref, covered = RowLoop(case, case.info).shrink()
    covered = covered.to(DEVICE)
    assert torch.equal(outs[1][covered], outs[0][covered]), "the tall shrink changed bits"
    assert outs[1][~covered].isnan().all(), "rows outside the batch were written"
    assert rel_err(outs[1][covered].double().cpu(), v_ref[covered.cpu()].double().cpu()) <= TOL[dtype]
    plan.clear_cache()


def test_recipes_follow_the_tall_entry(monkeypatch):
    """A cached launch recipe is keyed by the path and its table entry: changing a group size between calls (bench
    variants, --tune) takes effect without a cache clear; the path is chosen by rows, the pool's rank, and the work
    list's density and items (off here: test_tall_path_needs_a_dense_work_list_and_items)."""
    anywhere = {**plan.TALL_DEFAULT, "min_rows": 1, "dense_tiles": 0, "min_items": 0}
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": anywhere})
    a = plan.apply_path(64, 16, 48, 4)
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**anywhere, "expand_group": 4}})
    b = plan.apply_path(64, 16, 48, 4)
    assert a[0] == b[0] == "tall" and a != b
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**anywhere, "min_rank": 32}})
    assert plan.apply_path(64, 16, 48, 4) == ("split",) and plan.apply_path(64, 32, 96, 4)[0] == "tall"  # pool rank
    assert plan.apply_path(64, 64, 192, 4)[0] == "tall" and plan.apply_path(64, 65, 195, 4) == ("split",)  # max_rank


def test_tall_path_needs_a_dense_work_list_and_items(monkeypatch):
    """A chunked-prefill step (a 4096-row chunk beside 63 decode rows: 260 tiles that the rows fill, 319 in the list)
    takes the split path, as does a short chunk (fewer than min_items, 64, shrink items of 4 tiles x 64 columns of v);
    a prefill batch whose list has at most one tile in dense_tiles (16) beyond the filled ones takes the tall path, in
    graph mode (capacity: the rows' tiles + the segments) as in eager mode."""
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**plan.TALL_DEFAULT, "min_rows": 1024}})
    assert plan.apply_path(4159, 16, 48, 256 + 63) == ("split",)
    assert plan.apply_path(4159, 16, 48, 260 + 64) == ("split",)  # graph capacity for 64 segments
    assert plan.apply_path(8192, 16, 16, 512 + 8)[0] == "tall"  # 8 x 1024, graph capacity: 128 items
    assert plan.apply_path(8192, 64, 64, 512 + 32)[0] == "tall" and plan.apply_path(8192, 64, 64, 545) == ("split",)
    assert plan.apply_path(4096, 16, 16, 256)[0] == "tall"  # 64 items
    assert plan.apply_path(2048, 16, 48, 128) == ("split",)  # 32 items
    assert plan.apply_path(2048, 64, 192, 128)[0] == "tall" and plan.apply_path(2048, 64, 64, 128) == ("split",)
    assert plan.apply_path(1000, 16, 64 * 64, 63) == ("split",)  # below min_rows
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**plan.TALL_DEFAULT, "min_rows": 1024,
                                                               "dense_tiles": 0, "min_items": 0}})
    assert plan.apply_path(1087, 16, 48, 132)[0] == "tall"  # no bounds


def test_tall_config_ignores_keys_it_does_not_know(monkeypatch):
    """A table written for an older tall form (one_dot, block_n...) still loads: unknown keys are dropped."""
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {"min_rows": 1024, "one_dot": True, "block_n": 64}})
    assert plan.tall_config() == {**plan.TALL_DEFAULT, "min_rows": 1024}


def test_shrink_stages_fit_the_shared_memory_bound():
    sp = plan.shrink_plan(4096, 2, 64, torch.bfloat16, False, torch.device("cpu"))
    tp, _ = plan.tall_plan(sp, (0, 14336, 28672), 64, torch.bfloat16)
    c = plan.tall_config()
    s = tp.shrink_kw
    assert 2 <= s["num_stages"] <= c["shrink_stages"]
    assert s["num_stages"] == 2 or (s["GROUP"] * 16 + s["BLOCK_N"]) * s["BLOCK_K"] * 2 * s["num_stages"] <= c["shrink_smem"]


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tl.dot is wrong in the interpreter; GPU only")
@pytest.mark.parametrize("groups", ["table", "eight"])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("shape", [(4096, (4096, 1024, 1024)), (14336, (4096,))])
def test_gpu_tall_bits_llama_prefill(monkeypatch, rank, shape, groups):
    """bf16 prefill-like batch (long segments and a few decode rows, sorted): the tall path's bits equal the
    split-K path's, which the batch-invariance tests tie to every other batch."""
    in_dim, widths = shape
    rng = np.random.default_rng(rank)
    case = make_case(rng, num_slots=8, max_rank=rank, ranks=[rank] * 8, slice_widths=widths, in_dim=in_dim,
                     seg_lens=(700, 1, 1, 333, 64, 1024, 5), dtype=torch.bfloat16, device="cuda", permute=True)
    base = dict(plan.TABLE)
    split = _apply(monkeypatch, base, case, 0)
    tall = _apply(monkeypatch, base, case, 1, **GROUPS[groups])
    assert torch.equal(tall, split)
    plan.clear_cache()


_AOT = r'''
import json
import torch
from lora_kernels.backends.triton import plan, tall
out = []
for S, R, sp, offs, ep in llama_plans(True, expand_split=1):
    tp, _ = plan.tall_plan(sp, offs, R, torch.bfloat16)
    for fn, kw, ptrs, ints in (
            (tall._tall_shrink_kernel, tp.shrink_kw, ("x_ptr:bf16", "a_ptr:bf16", "out_ptr:fp32"),
             ("MT", "K", "R", "NR", "k_chunk")),
            (tall._tall_expand_kernel, {**tp.expand_kw, "ASSIGN": False}, ("v_ptr:fp32", "b_ptr:bf16", "out_ptr:bf16"),
             ("MT", "R", "NR", "OUT", "off1", "off2", "off3", "t1", "t2", "t3")),
            (tall._tall_expand_kernel, {**tp.expand_kw, "ASSIGN": True}, ("v_ptr:fp32", "b_ptr:bf16", "out_ptr:bf16"),
             ("MT", "R", "NR", "OUT", "off1", "off2", "off3", "t1", "t2", "t3"))):
        k = compile90(fn, {**kw, "PDL": True}, ptrs, ints, scalings=fn is tall._tall_expand_kernel)
        ptx = k.asm["ptx"]
        out.append({"S": S, "R": R, "kernel": fn.fn.__name__, "rows": kw["GROUP"] * 16, "shared": k.metadata.shared,
                    "mma_sync": "mma.sync" in ptx, "wgmma": "wgmma" in ptx})
print(json.dumps(out))
'''


def test_tall_kernels_compile_for_sm90():
    """The tall kernels compile for sm90 (cubin, ptxas included) at the Llama-3-8B shapes, bf16, PDL: 64-row dots
    take wgmma, narrower ones mma.sync (per-row bits equal on the H200,
    scripts/triton_dot_bits.py; the GPU tests assert them)."""
    pytest.importorskip("triton.backends.nvidia")
    ks = compile_for_sm90(_AOT)
    assert len(ks) == 9
    for k in ks:
        assert k["wgmma"] or k["mma_sync"], k
        assert 0 < k["shared"] <= 227 * 1024, k


def test_register_cap_only_where_the_accumulator_fits(monkeypatch):
    """The tuned expand_maxnreg applies to the table's tile, not to a group whose fp32 accumulator alone needs more
    registers than it leaves (ptxas failed on groups of 8 under a cap of 64: H200 suite of 74fcf68)."""
    monkeypatch.setattr(plan, "INTERPRET", False)
    sp = plan.shrink_plan(4096, 3, 16, torch.bfloat16, True, torch.device("cpu"))
    caps = {}
    for group in (2, 8):
        monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**plan.tall_config(), "expand_maxnreg": 64,
                                                                   "expand_group": group}})
        plan.clear_cache()
        caps[group] = plan.tall_plan(sp, (0, 4096, 5120, 6144), 16, torch.bfloat16)[0].expand_kw.get("maxnreg")
    plan.clear_cache()
    assert caps == {2: 64, 8: None}
