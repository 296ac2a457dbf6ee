"""The extension's `sgmv_linear` op: linear(x, weight, bias) with sgmv_apply added into it, in one host call (the HF
integration's eager decode path). It must equal the composition F.linear + sgmv_apply: bit for bit on the GPU
(the same cuBLAS GEMM and the same kernels), and against float64 on the CPU kernels; its fake kernel, opcheck and
argument checks."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lora_kernels as lk
from cases import make_case, rel_err, rowloop_expand, rowloop_shrink

pytestmark = pytest.mark.skipif(not lk.HAS_CUDA_EXT, reason="CUDA extension not built")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _problem(device, dtype=torch.float32, lead=(3,), with_bias=True, seed=0):
    """A case whose base is x Wᵀ + bias, x reshaped to lead + [T / prod(lead), in_dim] (HF passes [batch, seq, in])."""
    case = make_case(np.random.default_rng(1200 + seed), dtype=dtype, device=device, max_rank=8, slice_widths=(16, 8),
                     in_dim=32, seg_lens=[4, 2, 5, 1], slots=[1, -1, 2, 0], permute=True)
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(24, 32, generator=g, dtype=torch.float64) / 6).to(dtype).to(device)
    bias = (torch.randn(24, generator=g, dtype=torch.float64)).to(dtype).to(device) if with_bias else None
    x = case.x.view(*lead, -1, 32)
    i = case.info
    args = (x, weight, bias, case.lora_a, case.lora_b, i.work, i.lora_ranks, i.scalings, i.permutation,
            list(case.slice_offsets), i.max_tiles)
    return case, args


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_linear.default, _problem(device)[1])
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_linear.default, _problem(device, with_bias=False, lead=())[1])
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_linear.default, (*_problem(device)[1], True))  # one_launch


def test_cpu_equals_float64():
    """CPU kernels (CI's path): base GEMM + bias + every covered row's delta, against the float64 row loop."""
    case, args = _problem("cpu")
    y = torch.ops.lora_kernels.sgmv_linear(*args)
    x, weight, bias = args[:3]
    assert y.shape == (*x.shape[:-1], 24) and y.is_contiguous()
    base = F.linear(case.x.double(), weight.double(), bias.double())
    v, _ = rowloop_shrink(case)
    ref = rowloop_expand(case, v, base)
    assert rel_err(y.view(-1, 24), ref) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("lead", [(), (3,), (3, 1)])
def test_gpu_equals_the_composition(dtype, with_bias, lead):
    """torch.equal with F.linear then sgmv_apply on the same inputs, x of 2, 3 (the op's own GEMM call) and 4 dims
    (at::linear's); and within tolerance of float64."""
    case, args = _problem("cuda", dtype, lead=lead, with_bias=with_bias, seed=1)
    x, weight, bias = args[:3]
    y = torch.ops.lora_kernels.sgmv_linear(*args)
    assert y.shape == (*x.shape[:-1], 24)
    comp = F.linear(x, weight, bias).contiguous()
    torch.ops.lora_kernels.sgmv_apply(x.view(-1, 32), *args[3:], comp.view(-1, 24))
    assert torch.equal(y, comp)
    base = F.linear(case.x.double().cpu(), weight.double().cpu(), None if bias is None else bias.double().cpu())
    v, _ = rowloop_shrink(case)
    ref = rowloop_expand(case, v, base)
    assert rel_err(y.view(-1, 24).double().cpu(), ref) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_name_the_argument(device):
    case, args = _problem(device)
    x, weight, bias = args[:3]
    op = torch.ops.lora_kernels.sgmv_linear.default
    if device == "cuda":  # the C++ checks (the CPU kernels are the reference composition)
        with pytest.raises(RuntimeError, match=r"weight must have shape \[out_total, 32\]"):
            op(x, weight[:, :16].contiguous(), bias, *args[3:])
        with pytest.raises(RuntimeError, match="weight must have dtype"):
            op(x, weight.half(), bias, *args[3:])
        with pytest.raises(RuntimeError, match=r"bias must have shape \[24\]"):
            op(x, weight, bias[:8], *args[3:])
        with pytest.raises(RuntimeError, match="weight has 20 output rows but lora_b out_total 24"):
            op(x, weight[:20], None, *args[3:])
        with pytest.raises(RuntimeError, match="x must be contiguous"):
            op(x.transpose(0, 1), weight, bias, *args[3:])
    with pytest.raises(RuntimeError):
        op(x, weight[:, :16].contiguous(), bias, *args[3:])


def test_torch_compile_fullgraph_cpu():
    """The fake kernel gives torch.compile(fullgraph=True) the output's shape; same result as eager."""
    _, args = _problem("cpu")
    fn = torch.compile(lambda *a: torch.ops.lora_kernels.sgmv_linear(*a) * 1, fullgraph=True, backend="eager")
    assert torch.equal(fn(*args), torch.ops.lora_kernels.sgmv_linear(*args))
