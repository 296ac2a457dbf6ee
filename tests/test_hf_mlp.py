"""The HF integration's one-pass gated SiLU MLP (lora_kernels/integrations/_hf_mlp.py): the kernel against torch's
two ops (CPU under the Triton interpreter; bf16 on the GPU), the dispatch by size, and the patched MLP forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lora_kernels.integrations import _hf_mlp

pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()


def _torch_ref(gu):
    inter = gu.shape[-1] // 2
    return F.silu(gu[..., :inter]) * gu[..., inter:]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape", [(3, 5, 2 * 1100), (7, 2 * 64), (1, 1, 2 * 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_torch_cpu(shape, dtype):
    """Under TRITON_INTERPRET (set by conftest without a GPU); bf16 only on the GPU (the interpreter's bf16 casts
    do not round as the GPU does). Fresh random inputs, an inner size that is not a multiple of the block."""
    if ON_GPU:
        pytest.skip("the CPU interpreter case; the GPU one is test_kernel_equals_torch_gpu")
    gu = torch.randn(*shape, dtype=torch.float32).to(dtype) * 3
    out = _hf_mlp.silu_mul_kernel(gu)
    ref = _torch_ref(gu)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    assert _rel(out, ref) <= (1e-6 if dtype == torch.float32 else 1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernel_equals_torch_gpu(dtype, monkeypatch):
    monkeypatch.setenv("LORA_KERNELS_HF_MLP_KERNEL", "1")
    gu = (torch.randn(4, 300, 2 * 5000, device="cuda") * 3).to(dtype)
    out = _hf_mlp.silu_mul(gu)  # 6M products: the kernel's path
    ref = _torch_ref(gu)
    assert out.is_contiguous() and out.shape == ref.shape
    # silu is rounded to the dtype first, as torch's two ops do; exp may differ from CUDA's expf in the last bit
    assert _rel(out, ref) <= {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    assert (out != ref).float().mean().item() < 0.05  # nearly every element bit-equal to torch's


def test_small_batches_take_torch_ops(monkeypatch):
    """Below MIN_ELEMS products (decode steps), on the CPU, or with the kernel off: torch's two ops, bit for bit."""
    monkeypatch.setenv("LORA_KERNELS_HF_MLP_KERNEL", "1")
    gu = torch.randn(32, 1, 2 * 128)
    assert torch.equal(_hf_mlp.silu_mul(gu), _torch_ref(gu))
    if ON_GPU:
        big = torch.randn(8, 256, 2 * 1024, device="cuda")
        assert torch.equal(_hf_mlp.silu_mul(big[:1, :4]), _torch_ref(big[:1, :4]))  # 4096 products
        monkeypatch.setenv("LORA_KERNELS_HF_MLP_KERNEL", "0")
        assert torch.equal(_hf_mlp.silu_mul(big), _torch_ref(big))


def test_silu_gated_detects_the_activation():
    mlp = torch.nn.Module()
    mlp.down_proj = torch.nn.Linear(4, 4)
    mlp.act_fn = torch.nn.SiLU()
    assert _hf_mlp.silu_gated(mlp)
    mlp.act_fn = torch.nn.GELU()
    assert not _hf_mlp.silu_gated(mlp)
