"""The tall-tile path of the Triton backend (backends/triton/tall.py), for long segments.

It must give the bits of the split-K path (so that choosing it by the number of rows keeps batch
invariance) and be right against float64, for segments of every length around the 16-row tile and the
4-tile group, slot -1 segments, several slices, split-K and not, sorted rows. CPU: the interpreter (fp32 /
fp16); GPU: bf16 at the Llama shapes of a prefill.
"""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import TOL, make_case, rel_err
from lora_kernels import backends
from lora_kernels.backends.triton import plan
from test_triton import SMALL_TABLE, RowLoop

pytestmark = pytest.mark.skipif(backends.unavailable("triton", torch.device("cuda" if torch.cuda.is_available() else "cpu"))
                                is not None, reason="Triton backend unavailable")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _apply(monkeypatch, base: dict, case, min_rows: int):
    monkeypatch.setattr(plan, "TABLE", {**base, "tall": {**plan.TALL_DEFAULT, **base.get("tall", {}),
                                                         "min_rows": min_rows}})
    assert plan.apply_path(case.x.shape[0]) == ("tall" if min_rows else "split")
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="triton")
    return out


CASES = [  # (seg_lens, in_dim, widths, max_rank, permute): lengths around 16 and 64, split-K or not, slices
    ((1, 15, 16, 17), 96, (32, 16), 16, False),
    ((63, 64, 65, 3), 64, (48,), 8, True),
    ((130, 1, 47, 80), 40, (24, 8, 8), 16, False),
    ((100, 2, 33), 130, (16, 16, 16, 16), 4, True),
]


@pytest.mark.parametrize("table", ["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", range(len(CASES)))
def test_tall_equals_split_path_and_reference(monkeypatch, table, dtype, k):
    if table == "small" and dtype != torch.float32:
        pytest.skip("the tiny table reaches the same paths in fp32 (the interpreter is slow)")
    seg_lens, in_dim, widths, max_rank, permute = CASES[k]
    rng = np.random.default_rng([k, dtype.itemsize, 4])
    case = make_case(rng, num_slots=5, max_rank=max_rank, slice_widths=widths, in_dim=in_dim, seg_lens=seg_lens,
                     dtype=dtype, device=DEVICE, permute=permute, extra_rows=3)
    base = SMALL_TABLE if table == "small" else dict(plan.TABLE)
    split = _apply(monkeypatch, base, case, 0)
    tall = _apply(monkeypatch, base, case, 1)
    assert torch.equal(tall, split), "the tall-tile path changed bits"
    ref = RowLoop(case, case.info)
    v_ref, _ = ref.shrink()
    assert rel_err(tall, ref.expand(v_ref.nan_to_num(0), case.base)) <= TOL[dtype]
    untouched = torch.ones(case.x.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[torch.tensor(case.perm, dtype=torch.long, device=DEVICE)] = False
    assert torch.equal(tall[untouched], case.base[untouched]), "rows outside the batch were written"
    plan.clear_cache()


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 tl.dot is wrong in the interpreter; GPU only")
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("shape", [(4096, (4096, 1024, 1024)), (14336, (4096,))])
def test_gpu_tall_bits_llama_prefill(monkeypatch, rank, shape):
    """bf16 prefill-like batch (long segments and a few decode rows, sorted): the tall path's bits equal the
    split-K path's, which the batch-invariance tests tie to every other batch."""
    in_dim, widths = shape
    rng = np.random.default_rng(rank)
    case = make_case(rng, num_slots=8, max_rank=rank, ranks=[rank] * 8, slice_widths=widths, in_dim=in_dim,
                     seg_lens=(700, 1, 1, 333, 64, 1024, 5), dtype=torch.bfloat16, device="cuda", permute=True)
    base = dict(plan.TABLE)
    split = _apply(monkeypatch, base, case, 0)
    tall = _apply(monkeypatch, base, case, 1)
    assert torch.equal(tall, split)
    plan.clear_cache()
