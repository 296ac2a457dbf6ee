"""Drives the `cuda` backend's kernels for the device evidence of scripts/cuda_evidence.sh.

    smoke  every kernel path once on small shapes, checked against reference.py
    ncu [BACKEND]  one decode apply (batch 64, distinct adapters, r64, gate_up) and one prefill apply
           (8 x 1024 rows, r64, gate_up), for Nsight Compute; BACKEND cuda (default), triton, triton-fused or triton-tall
    layer BACKEND CASE [ORDER]  one layer (qkv, o, gate_up, down) of a bench_kernels case (e.g. "r16 decode 16x1
           uniform", order sorted or unsorted) applied twice; the second pass inside the NVTX range "layer", for
           `ncu --nvtx --nvtx-include "layer/"`
    pdl    µs per module and per layer in graph replay at decode batch 1 (qkv, o, gate_up, down);
           run once with LORA_KERNELS_PDL=0 and once without to see what programmatic launch buys
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import lora_kernels as lk  # noqa: E402
from cases import make_case, rel_err  # noqa: E402
from lora_kernels import reference  # noqa: E402

MODULES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
           "down": (14336, (4096,))}


def _check(case, info=None):
    info = info or case.info
    out = case.base.clone()
    lk.apply_lora(case.x, out, case.lora_a, case.lora_b, info, case.slice_offsets, backend="cuda")
    v = torch.zeros(case.x.shape[0], case.lora_a.shape[1], dtype=torch.float64, device="cuda")
    args = (info.seg_indptr, info.weight_indices, info.lora_ranks)
    reference.sgmv_shrink(case.x.double(), case.lora_a.double(), *args, info.permutation, case.num_slices, v)
    ref = case.base.double().clone()
    reference.sgmv_expand(v, case.lora_b.double(), *args, info.scalings, info.permutation, case.slice_offsets, ref)
    v2 = torch.full_like(v, float("nan"), dtype=torch.float32)
    lk.sgmv_shrink(case.x, case.lora_a, info, case.num_slices, out=v2, backend="cuda")
    return rel_err(out, ref)


def smoke():
    rng = np.random.default_rng(0)
    shapes = [  # (seg_lens, in_dim, R, widths, dtype): mma, CUDA-core scalar, mma split-K, mma, CUDA-core fp32
        ([1, 1, 1, 1], 256, 16, (64, 32), torch.bfloat16),
        ([3, 2, 4], 37, 5, (9, 7), torch.float16),
        ([40, 9, 70], 512, 32, (64, 64, 32), torch.bfloat16),
        ([300, 700], 128, 64, (256, 128), torch.float16),
        ([5, 3], 64, 8, (16,), torch.float32),
    ]
    for seg_lens, in_dim, R, widths, dtype in shapes:
        case = make_case(rng, num_slots=4, max_rank=R, slice_widths=widths, in_dim=in_dim, seg_lens=seg_lens,
                         dtype=dtype, device="cuda", permute=True, extra_rows=2)
        err = _check(case)
        print(f"smoke {dtype} seg_lens={seg_lens} in={in_dim} R={R} widths={widths}: rel err {err:.2e}")
        assert err < 1e-2
    torch.cuda.synchronize()


def _module_case(rng, name, rank, counts, slots, num_slots):
    in_dim, widths = MODULES[name]
    builder = lk.BatchInfoBuilder(sum(counts), len(counts),
                                  torch.full((num_slots,), rank, dtype=torch.int32, device="cuda"),
                                  torch.ones(num_slots, device="cuda"), cuda_graph=True)
    info = builder.build(counts, slots)
    T, S = sum(counts), len(widths)
    offs = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
    x = torch.randn(T, in_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.randn(T, offs[-1], device="cuda", dtype=torch.bfloat16)
    a = torch.randn(num_slots, S * rank, in_dim, device="cuda", dtype=torch.bfloat16) * in_dim ** -0.5
    b = torch.randn(num_slots, offs[-1], rank, device="cuda", dtype=torch.bfloat16) * rank ** -0.5
    return x, out, a, b, info, offs


def ncu(backend="cuda"):
    """backend: cuda, triton, triton-fused or triton-tall (Triton with the one-launch / tall-tile path on); for
    Triton, profile with `ncu -k regex:_kernel` (_shrink_kernel, _expand_kernel, _reduce_kernel, _fused_kernel,
    _tall_shrink_kernel, _tall_expand_kernel)."""
    rng = np.random.default_rng(1)
    if backend in ("triton-fused", "triton-tall"):
        from lora_kernels.backends.triton import plan
        key, default, on = (("fused", plan.FUSED_DEFAULT, {"max_rows": 1 << 30}) if backend == "triton-fused"
                            else ("tall", plan.TALL_DEFAULT, {"min_rows": 1}))
        plan.TABLE = {**plan.TABLE, key: {**default, **on}}
    for counts, slots, num_slots in (([1] * 64, list(range(64)), 64), ([1024] * 8, list(range(8)), 8)):
        x, out, a, b, info, offs = _module_case(rng, "gate_up", 64, counts, slots, num_slots)
        lk.apply_lora(x, out, a, b, info, offs, backend=backend.split("-")[0])
    torch.cuda.synchronize()


def layer(backend="triton", case="r16 decode 16x1 uniform", order="sorted"):
    import bench_kernels as bk

    c = next(c for c in bk.all_cases(False) if c.name == case)
    mods, infos = bk.build_case(c)
    order = order if order in infos else "unsorted"
    fns = [m.fns(f"{backend} {order}")[0] for m in mods.values()]
    for f in fns:  # compiles
        f()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("layer")
    for f in fns:
        f()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"layer {backend} {case} {order}")


def pdl():
    import common

    rng = np.random.default_rng(2)
    label = "pdl off" if os.environ.get("LORA_KERNELS_PDL") == "0" else "pdl on"
    for rank in (16, 64):
        ts = {}
        for name in MODULES:
            sets = [_module_case(rng, name, rank, [1], [i], 8) for i in range(8)]
            fns = [lambda s=s: lk.apply_lora(s[0], s[1], s[2], s[3], s[4], s[5], backend="cuda") for s in sets]
            ts[name] = common.time_graph_us(fns, inner=len(fns), warmup=3, reps=50)
        print(f"{label} r{rank} decode batch 1: " + " ".join(f"{k} {v:.2f}" for k, v in ts.items())
              + f" | layer {sum(ts.values()):.2f} us")


if __name__ == "__main__":
    {"smoke": smoke, "ncu": ncu, "layer": layer, "pdl": pdl}[sys.argv[1]](*sys.argv[2:])
