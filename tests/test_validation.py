"""Bad inputs raise clear errors naming the argument, its shape and dtype (one test each)."""

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import make_case


@pytest.fixture
def case():
    return make_case(np.random.default_rng(0), dtype=torch.float16, in_dim=32, slice_widths=(16, 8))


def test_wrong_dtype(case):
    with pytest.raises(ValueError, match=r"lora_a must have dtype .*float16.*got torch.float32"):
        lk.sgmv_shrink(case.x, case.lora_a.float(), case.info, 2)


def test_wrong_tensor_rank(case):
    with pytest.raises(ValueError, match=r"x must be 2-D \[T, in_dim\], got shape \(9, 1, 32\)"):
        lk.sgmv_shrink(case.x.unsqueeze(1), case.lora_a, case.info, 2)


def test_mismatched_in_dim(case):
    with pytest.raises(ValueError, match=r"lora_a in_dim 32 != x in_dim 31"):
        lk.sgmv_shrink(case.x[:, :31].contiguous(), case.lora_a, case.info, 2)


def test_mismatched_out_total(case):
    with pytest.raises(ValueError, match=r"slice_offsets must rise from 0 to out_total=24"):
        lk.apply_lora(case.x, case.base, case.lora_a, case.lora_b, case.info, (0, 16, 25))


def test_slot_out_of_range_in_builder(case):
    builder = lk.BatchInfoBuilder(64, 8, case.info.lora_ranks, case.info.scalings)
    with pytest.raises(ValueError, match=r"slot 6 out of range: slots must be -1 or in \[0, 6\)"):
        builder.build([1, 2], [0, 6])


def test_slot_out_of_range_in_reference(case):
    case.info.weight_indices[0] = 6
    with pytest.raises(ValueError, match=r"weight_indices\[0\]=6 is out of range for 6 slots"):
        lk.apply_lora(case.x, case.base, case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="torch")


def test_pool_size_mismatch(case):
    with pytest.raises(ValueError, match=r"info.lora_ranks/scalings have 6/6 slots but the weights have 5"):
        lk.sgmv_shrink(case.x, case.lora_a[:5].contiguous(), case.info, 2)


def test_non_contiguous(case):
    x = torch.randn(case.x.shape[1], case.x.shape[0], dtype=case.x.dtype).T
    with pytest.raises(ValueError, match=r"x must be contiguous, got shape \(9, 32\) strides \(1, 9\)"):
        lk.sgmv_shrink(x, case.lora_a, case.info, 2)


def test_rank_too_large():
    case = make_case(np.random.default_rng(1), max_rank=257, ranks=[1] * 6, in_dim=8)
    with pytest.raises(ValueError, match=r"max rank R=257 exceeds 256"):
        lk.sgmv_shrink(case.x, case.lora_a, case.info, 1)


def test_cpu_tensor_to_cuda_backend(case):
    if not lk.HAS_CUDA_EXT:
        with pytest.raises(RuntimeError, match=r"backend='cuda' requested but the CUDA extension is not available"):
            lk.sgmv_shrink(case.x, case.lora_a, case.info, 2, backend="cuda")
    else:
        with pytest.raises(ValueError, match=r"backend='cuda' needs CUDA tensors, got tensors on cpu"):
            lk.sgmv_shrink(case.x, case.lora_a, case.info, 2, backend="cuda")


def test_unknown_backend(case):
    with pytest.raises(ValueError, match=r"backend must be one of"):
        lk.sgmv_shrink(case.x, case.lora_a, case.info, 2, backend="cublas")


def test_v_wrong_dtype(case):
    v = torch.zeros(case.x.shape[0], case.lora_a.shape[1], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"v must have dtype .*got torch.float64"):
        lk.sgmv_expand(v, case.lora_b, case.info, case.slice_offsets, case.base)


def test_apply_lora_checks_every_new_signature(case):
    """apply_lora remembers argument signatures it has validated (shape, strides, dtype, device of each tensor,
    slice offsets); a call that differs in any of them is checked in full."""
    lk.apply_lora(case.x, case.base.clone(), case.lora_a, case.lora_b, case.info, case.slice_offsets, backend="torch")
    with pytest.raises(ValueError, match=r"lora_b must have dtype .*float16.*got torch.float32"):
        lk.apply_lora(case.x, case.base.clone(), case.lora_a, case.lora_b.float(), case.info, case.slice_offsets)
    x = torch.randn(case.x.shape[1], case.x.shape[0], dtype=case.x.dtype).T  # same shape, other strides
    with pytest.raises(ValueError, match=r"x must be contiguous"):
        lk.apply_lora(x, case.base.clone(), case.lora_a, case.lora_b, case.info, case.slice_offsets)
    with pytest.raises(ValueError, match=r"slice_offsets must rise from 0 to out_total=24"):
        lk.apply_lora(case.x, case.base.clone(), case.lora_a, case.lora_b, case.info, (0, 25, 24))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor"):
        lk.apply_lora(case.x.numpy(), case.base.clone(), case.lora_a, case.lora_b, case.info, case.slice_offsets)
