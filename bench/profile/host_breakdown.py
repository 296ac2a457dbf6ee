"""Where the eager host time of one `apply_lora` call goes (issue 19's target: <= 25 µs per call on the GPU).

One decode module (qkv, batch 1, bf16; rank 16 unless --rank), as bench_kernels' eager host measurement: the median
host µs of the whole call per backend, then of its parts on the Triton path (validation signature, backend call without
validation, the workspace allocation, one cached kernel launch), then the same call right after a cuBLAS GEMM as
an engine makes it (a model's eager step measured ~2x the standalone cost there), with programmatic dependent
launch on and off, then a cProfile of 2000 Triton calls (top functions by own time). --settle drains the GPU after
each timed call (untimed), as bench_kernels does: a call whose kernels outlast its host work would otherwise time the
full launch queue, not the host.

    python bench/profile/host_breakdown.py [--rank 64] [--settle]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import lora_kernels as lk  # noqa: E402
from lora_kernels import ops  # noqa: E402
from lora_kernels.backends import triton as tb  # noqa: E402
from lora_kernels.backends.triton import plan  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--settle", action="store_true", help="drain the GPU after each timed call (untimed)")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: TRITON_INTERPRET=1 smoke run
    settle = torch.cuda.synchronize if args.settle and dev.type == "cuda" else None
    S, R, K, widths = 3, args.rank, 4096, (4096, 1024, 1024)
    offs = (0, 4096, 5120, 6144)
    slots = 8
    builder = lk.BatchInfoBuilder(1, 1, torch.full((slots,), R, dtype=torch.int32, device=dev),
                                  torch.ones(slots, device=dev))
    info = builder.build([1], [3])
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    out = torch.randn(1, offs[-1], device=dev, dtype=torch.bfloat16)
    a = torch.randn(slots, S * R, K, device=dev, dtype=torch.bfloat16)
    b = torch.randn(slots, offs[-1], R, device=dev, dtype=torch.bfloat16)
    parts = {
        "apply_lora triton": lambda: lk.apply_lora(x, out, a, b, info, offs, backend="triton"),
        "apply_lora cuda": lambda: lk.apply_lora(x, out, a, b, info, offs, backend="cuda"),
        "validation signature": lambda: ops._signature(x, out, a, b, offs),
        "check_info + resolve_backend": lambda: (ops._check_info(info, x.device, slots, 1),
                                                 ops.resolve_backend("triton", x.device, info)),
        "triton backend call": lambda: tb.BACKEND.apply_lora(x, out, a, b, info, offs),
        "torch.empty workspace": lambda: torch.empty((8, 1, S * R), dtype=torch.float32, device=dev),
    }
    lk.apply_lora(x, out, a, b, info, offs, backend="triton")
    path = plan.apply_path(1, R, a.shape[1], info.max_tiles)
    key = ("apply", x.shape, x.dtype, a.shape, R, offs, x.device, info.max_tiles, info.permutation is not None, path)
    recipe = plan._cache[key]  # the recipe the call above made (KeyError if this key drifts from the backend's)
    ws = torch.empty(recipe.ws, dtype=torch.float32, device=dev)
    work, perm = tb._work(info)
    parts["one cached launch (shrink)"] = lambda: recipe.steps[0](x, a, ws, work, info.lora_ranks, perm)
    w = torch.randn(offs[-1], K, device=dev, dtype=torch.bfloat16)
    parts["cuBLAS GEMM (x @ W^T) alone"] = lambda: torch.nn.functional.linear(x, w)
    parts["GEMM, then apply_lora triton"] = lambda: lk.apply_lora(x, torch.nn.functional.linear(x, w), a, b, info,
                                                                 offs, backend="triton")
    for name, fn in parts.items():
        if name == "apply_lora cuda" and (not lk.HAS_CUDA_EXT or dev.type != "cuda"):
            continue
        r = (common.time_host_us(fn, warmup=200, reps=3000, settle=settle) if dev.type == "cuda"
             else common.time_host_us(fn, 1, 3))
        print(f"{name:32s} {r['median_us']:7.2f} µs (p99 {r['p99_us']:.2f})")
    if dev.type == "cuda":
        import os

        os.environ["LORA_KERNELS_PDL"] = "0"  # read when plans are made
        plan.clear_cache()
        fn = parts["GEMM, then apply_lora triton"]
        r = common.time_host_us(fn, warmup=200, reps=3000, settle=settle)
        print(f"{'GEMM, then apply_lora, PDL off':32s} {r['median_us']:7.2f} µs (p99 {r['p99_us']:.2f})")
        r = common.time_host_us(parts["apply_lora triton"], warmup=200, reps=3000, settle=settle)
        print(f"{'apply_lora triton, PDL off':32s} {r['median_us']:7.2f} µs (p99 {r['p99_us']:.2f})")
        del os.environ["LORA_KERNELS_PDL"]
        plan.clear_cache()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000 if dev.type == "cuda" else 5):
        lk.apply_lora(x, out, a, b, info, offs, backend="triton")
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(16)


if __name__ == "__main__":
    main()
