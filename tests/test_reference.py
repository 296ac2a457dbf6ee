"""The torch reference (and the op schemas' CPU kernels) against an independent float64 row loop."""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import TOL, make_case, rel_err, rowloop_expand, rowloop_shrink

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random_config(rng):
    num_slices = int(rng.integers(1, 5))
    max_rank = int(rng.choice([1, 4, 8, 16, 33, 64]))
    widths = tuple(int(w) for w in rng.choice([1, 7, 16, 48, 129], num_slices))
    n_seg = int(rng.integers(1, 7))
    return dict(
        num_slots=int(rng.integers(1, 8)), max_rank=max_rank, slice_widths=widths,
        in_dim=int(rng.choice([1, 5, 64, 111, 2049])), seg_lens=[int(v) for v in rng.integers(0, 6, n_seg)],
        permute=bool(rng.integers(2)), extra_rows=int(rng.integers(0, 3)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(12))
def test_apply_lora_matches_rowloop(seed, dtype, device):
    rng = np.random.default_rng([seed, DTYPES.index(dtype)])
    case = make_case(rng, dtype=dtype, device=device, **_random_config(rng))
    v_ref, covered = rowloop_shrink(case)

    v = torch.full((case.x.shape[0], case.lora_a.shape[1]), float("nan"), device=device)
    lk.sgmv_shrink(case.x, case.lora_a, case.info, case.num_slices, out=v, backend="torch")
    assert torch.isnan(v[~covered.to(device)]).all(), "rows outside every segment must stay untouched"
    if covered.any():
        assert rel_err(v[covered.to(device)], v_ref[covered]) <= TOL[dtype] * 0.1 + 1e-12

    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="torch")
    out_ref = rowloop_expand(case, v_ref.nan_to_num(0), case.base)
    assert rel_err(out, out_ref) <= TOL[dtype]
    untouched = torch.ones(case.x.shape[0], dtype=torch.bool)
    for t, slot in zip(case.perm, np.repeat(case.slots, case.seg_lens)):
        if slot >= 0:
            untouched[t] = False
    assert torch.equal(out[untouched.to(device)], case.base[untouched.to(device)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_expand_with_given_v(dtype):
    rng = np.random.default_rng(7)
    case = make_case(rng, dtype=dtype, max_rank=64, ranks=[1, 2, 17, 64], num_slots=4, slice_widths=(4096 // 64, 16, 16),
                     seg_lens=[2, 3, 1, 4], slots=[0, 3, -1, 2], permute=True)
    v = torch.randn(case.x.shape[0], case.lora_a.shape[1])
    out = case.base.clone()
    lk.sgmv_expand(v, case.lora_b, case.info, case.slice_offsets, out, backend="torch")
    assert rel_err(out, rowloop_expand(case, v, case.base)) <= TOL[dtype]


def test_ops_default_to_torch_on_cpu():
    assert lk.resolve_backend(None, torch.device("cpu")) in ("torch",)
