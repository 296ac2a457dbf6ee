"""The tall-tile path of the Triton backend (backends/triton/tall.py), for long segments.

It must give the bits of the split-K path (so that choosing it by the number of rows keeps batch
invariance) and be right against float64, for segments of every length around the 16-row tile and the
4-tile group, slot -1 segments, several slices, split-K and not, sorted rows. CPU: the interpreter (fp32 /
fp16); GPU: bf16 at the Llama shapes of a prefill.
"""

import dataclasses

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
    monkeypatch.setattr(plan, "TABLE", {**base, "tall": {**plan.TALL_DEFAULT, **base.get("tall", {}),
                                                         "min_rows": min_rows, "min_rank": 0, **tall}})
    assert plan.apply_path(case.x.shape[0], case.lora_b.shape[2])[0] == ("tall" if min_rows else "split")
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
    return out


CASES = [  # (seg_lens, in_dim, widths, max_rank, permute): lengths around 16 and 64, split-K or not, slices
    ((1, 15, 16, 17), 96, (32, 16), 16, False),
    ((63, 64, 65, 3), 64, (48,), 8, True),
    ((130, 1, 47, 80), 40, (24, 8, 8), 16, False),
    ((100, 2, 33), 130, (16, 16, 16, 16), 4, True),
]


@pytest.mark.parametrize("shrink", ["tall", "split"])
@pytest.mark.parametrize("table", ["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", range(len(CASES)))
def test_tall_equals_split_path_and_reference(monkeypatch, table, dtype, k, shrink):
    """shrink "split": below the table's shrink_min_rank the split-K shrink writes v and the tall expand reads it."""
    if table == "small" and dtype != torch.float32:
        pytest.skip("the tiny table reaches the same paths in fp32 (the interpreter is slow)")
    plan.clear_cache()  # recipes of earlier tests in this process (the table's own tall entry makes some)
    seg_lens, in_dim, widths, max_rank, permute = CASES[k]
    rng = np.random.default_rng([k, dtype.itemsize, 4])
    case = make_case(rng, num_slots=5, max_rank=max_rank, slice_widths=widths, in_dim=in_dim, seg_lens=seg_lens,
                     dtype=dtype, device=DEVICE, permute=permute, extra_rows=3)
    base = SMALL_TABLE if table == "small" else dict(plan.TABLE)
    split = _apply(monkeypatch, base, case, 0)
    tall = _apply(monkeypatch, base, case, 1, shrink_min_rank=0 if shrink == "tall" else 1 << 30)
    assert torch.equal(tall, split), "the tall-tile path changed bits"
    recipes = [r for k, r in plan._cache.items() if k[0] == "apply" and k[-1][0] == "tall"]
    assert len(recipes) == 1 and recipes[0].steps[-1].kernel is tb._tall_expand_kernel
    assert (recipes[0].mode == "tall") == (shrink == "tall")
    ref = RowLoop(case, case.info)
    v_ref, _ = ref.shrink()
    assert rel_err(tall, ref.expand(v_ref.nan_to_num(0), case.base)) <= TOL[dtype]
    untouched = torch.ones(case.x.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[torch.tensor(case.perm, dtype=torch.long, device=DEVICE)] = False
    assert torch.equal(tall[untouched], case.base[untouched]), "rows outside the batch were written"
    plan.clear_cache()


def test_recipes_follow_the_tall_entry(monkeypatch):
    """A cached launch recipe is keyed by the path and its table entry: changing one_dot or shrink_min_rank
    between calls (bench variants, --tune) takes effect without a cache clear."""
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**plan.TALL_DEFAULT, "min_rows": 1}})
    a = plan.apply_path(64, 16)
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**plan.TALL_DEFAULT, "min_rows": 1, "one_dot": False}})
    b = plan.apply_path(64, 16)
    assert a[0] == b[0] == "tall" and a != b
    monkeypatch.setattr(plan, "TABLE", {**plan.TABLE, "tall": {**plan.TALL_DEFAULT, "min_rows": 1, "min_rank": 32}})
    assert plan.apply_path(64, 16) == ("split",) and plan.apply_path(64, 32)[0] == "tall"  # by the pool's rank


@pytest.mark.parametrize("table", ["default", "small"])
@pytest.mark.parametrize("k", [1, 2])
def test_one_dot_form_in_the_interpreter_against_float64(monkeypatch, k, table):
    """The one-dot form (the GPU's default) runs in the interpreter only when forced; there its numpy dots depend
    on the tile height, so it is checked against float64 here and for bits on the GPU."""
    seg_lens, in_dim, widths, max_rank, permute = CASES[k]
    rng = np.random.default_rng([k, 9])
    case = make_case(rng, num_slots=5, max_rank=max_rank, slice_widths=widths, in_dim=in_dim, seg_lens=seg_lens,
                     device=DEVICE, permute=permute, extra_rows=3)
    made = plan.tall_plan

    def one_dot(sp, ep, nr):
        tp = made(sp, ep, nr)
        return dataclasses.replace(tp, shrink_kw={**tp.shrink_kw, "ONE_DOT": True},
                                   expand_kw={**tp.expand_kw, "ONE_DOT": True}, runs={})

    monkeypatch.setattr(plan, "tall_plan", one_dot)
    tall = _apply(monkeypatch, SMALL_TABLE if table == "small" else dict(plan.TABLE), case, 1)
    ref = RowLoop(case, case.info)
    v_ref, _ = ref.shrink()
    assert rel_err(tall, ref.expand(v_ref.nan_to_num(0), case.base)) <= TOL[torch.float32]
    untouched = torch.ones(case.x.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[torch.tensor(case.perm, dtype=torch.long, device=DEVICE)] = False
    assert torch.equal(tall[untouched], case.base[untouched])
    plan.clear_cache()


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tl.dot is wrong in the interpreter; GPU only")
@pytest.mark.parametrize("one_dot", [True, False])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("shape", [(4096, (4096, 1024, 1024)), (14336, (4096,))])
def test_gpu_tall_bits_llama_prefill(monkeypatch, rank, shape, one_dot):
    """bf16 prefill-like batch (long segments and a few decode rows, sorted): the tall path's bits equal the
    split-K path's, which the batch-invariance tests tie to every other batch."""
    in_dim, widths = shape
    rng = np.random.default_rng(rank)
    case = make_case(rng, num_slots=8, max_rank=rank, ranks=[rank] * 8, slice_widths=widths, in_dim=in_dim,
                     seg_lens=(700, 1, 1, 333, 64, 1024, 5), dtype=torch.bfloat16, device="cuda", permute=True)
    base = {**plan.TABLE, "tall": {**plan.TALL_DEFAULT, "one_dot": one_dot}}
    split = _apply(monkeypatch, base, case, 0)
    tall = _apply(monkeypatch, base, case, 1)
    assert torch.equal(tall, split)
    plan.clear_cache()


_AOT = r'''
import json
from lora_kernels.backends.triton import kernels, plan, tall
out = []
for S, R, sp, offs, ep in llama_plans(True, expand_split=1):
    tp = plan.tall_plan(sp, ep, S * R)
    jobs = [(fn, {**kw, "ONE_DOT": one}, ptrs, ints) for one in (False, True) for fn, kw, ptrs, ints in (
            (tall._tall_shrink_kernel, tp.shrink_kw, ("x_ptr:bf16", "a_ptr:bf16", "out_ptr:fp32"),
             ("MT", "K", "R", "NR", "k_chunk")),
            (tall._tall_expand_kernel, tp.expand_kw, ("v_ptr:fp32", "b_ptr:bf16", "out_ptr:bf16"),
             ("MT", "R", "NR", "OUT", "off1", "off2", "off3", "t1", "t2", "t3")))]
    jobs.append(
            (kernels._shrink_kernel, {**sp.kw, "PARTIAL": True}, ("x_ptr:bf16", "a_ptr:bf16", "out_ptr:fp32"),
             ("MT", "K", "R", "NR", "num_rows", "k_chunk")))
    for fn, kw, ptrs, ints in jobs:
        k = compile90(fn, {**kw, "PDL": True}, ptrs, ints, scalings=fn is tall._tall_expand_kernel)
        ptx = k.asm["ptx"]
        out.append({"S": S, "R": R, "kernel": fn.fn.__name__, "one_dot": kw.get("ONE_DOT"), "shared": k.metadata.shared,
                    "mma_sync": "mma.sync" in ptx, "wgmma": "wgmma" in ptx})
print(json.dumps(out))
'''


def test_tall_kernels_compile_for_sm90():
    """The tall kernels compile for sm90 (cubin, ptxas included) at the Llama-3-8B shapes, bf16, PDL. The four-dot
    form uses mma.sync like the 16-row kernels; the one-dot form wgmma, whose per-row bits equal mma.sync's on
    the H200 (scripts/triton_dot_bits.py; the GPU tests assert the bits)."""
    pytest.importorskip("triton.backends.nvidia")
    ks = compile_for_sm90(_AOT)
    assert len(ks) == 15
    for k in ks:
        assert k["wgmma"] if k["one_dot"] else (k["mma_sync"] and not k["wgmma"]), k
        assert 0 < k["shared"] <= 227 * 1024, k
