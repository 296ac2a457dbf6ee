"""The compiled extension is built and loaded wherever nvcc is, and its op schemas pass opcheck."""

import os
import shutil

import numpy as np
import pytest
import torch

import lora_kernels as lk
from cases import make_case

NVCC = shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
BUILD_OFF = os.environ.get("LORA_KERNELS_BUILD_CUDA") == "0"


@pytest.mark.skipif(not NVCC or BUILD_OFF or torch.version.cuda is None,
                    reason="no nvcc / CUDA torch: the extension is not expected")
def test_extension_built_and_ops_registered():
    from lora_kernels import _build_meta
    from lora_kernels.backends import cuda as _backends

    assert lk.HAS_CUDA_EXT, f"extension failed to load: {_backends.CUDA_EXT_ERROR}"
    assert _build_meta.CUDA_EXTENSION_BUILT
    for name in ("sgmv_shrink", "sgmv_expand", "sgmv_apply", "batched_h2d_copy"):
        assert hasattr(torch.ops.lora_kernels, name), name


def _opcheck_case(device):
    case = make_case(np.random.default_rng(3), dtype=torch.float32, device=device, slice_widths=(16, 8), permute=True,
                     extra_rows=1)
    info = case.info
    v = torch.zeros(case.x.shape[0], case.lora_a.shape[1], device=device)
    return case, info, v


@pytest.mark.skipif(not lk.HAS_CUDA_EXT, reason="extension not built")
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_opcheck(device):
    case, info, v = _opcheck_case(device)
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_shrink.default,
                          (case.x, case.lora_a, info.work, info.lora_ranks, info.permutation, 2, info.max_tiles, v))
    torch.library.opcheck(torch.ops.lora_kernels.sgmv_expand.default,
                          (v + 1, case.lora_b, info.work, info.lora_ranks, info.scalings, info.permutation,
                           list(case.slice_offsets), info.max_tiles, case.base.clone()))


_CPP_ERROR = """
import torch, lora_kernels
try:
    torch.ops.lora_kernels.batched_h2d_copy.default([torch.ones(3)], [torch.zeros(3)])
except RuntimeError as e:
    print(str(e).splitlines()[0])
"""


@pytest.mark.skipif(not lk.HAS_CUDA_EXT, reason="extension not built")
def test_cpp_check_raises_instead_of_crashing():
    """A TORCH_CHECK in the compiled code must surface as RuntimeError (an extension linked with its own
    libstdc++ segfaults here instead); run apart so that a crash fails this test, not the session."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _CPP_ERROR], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-1500:]}"
    assert res.stdout.startswith("dsts[0] must be a CUDA tensor, got cpu"), res.stdout
