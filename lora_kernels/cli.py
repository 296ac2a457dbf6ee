"""`lora-kernels` command line: `demo` (one multi-LoRA batch on the best backend, checked against
the reference) and `serve-sim` (a serving trace under three adapter-loading policies)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from lora_kernels import BatchInfoBuilder, apply_lora, reference, resolve_backend
from lora_kernels.serve_sim import cli as serve_sim_cli


def _time_us(fn, device: torch.device, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def demo(args) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    g = torch.Generator().manual_seed(args.seed)
    hidden, widths, max_rank = args.hidden, (args.hidden, args.hidden // 4, args.hidden // 4), 64
    offsets = (0, widths[0], widths[0] + widths[1], sum(widths))
    ranks = torch.tensor([8, 16, 32, 64], dtype=torch.int32)
    num_slots = ranks.numel()
    scalings = 16.0 / ranks.float()
    lora_a = torch.randn(num_slots, 3 * max_rank, hidden, generator=g) * hidden ** -0.5
    lora_b = torch.randn(num_slots, offsets[-1], max_rank, generator=g) * max_rank ** -0.5
    # Four requests with adapters of ranks 8/16/32/64 (one prefill chunk, three decodes), one without LoRA.
    counts, slots = [17, 1, 1, 1, 5], [0, 1, 2, 3, -1]
    x = torch.randn(sum(counts), hidden, generator=g)
    base = torch.randn(sum(counts), offsets[-1], generator=g)

    builder = BatchInfoBuilder(64, 8, ranks.to(device), scalings.to(device))
    info = builder.build(counts, slots)
    backend = resolve_backend(args.backend, device, info)
    xd, ad, bd, based = (t.to(device, dtype) for t in (x, lora_a, lora_b, base))
    out = based.clone()
    apply_lora(xd, out, ad, bd, info, offsets, backend=backend)

    cpu_info = BatchInfoBuilder(64, 8, ranks, scalings).build(counts, slots)
    xd64, a64, b64 = (t.to(device).to(dtype).double().cpu() for t in (x, lora_a, lora_b))
    v = torch.zeros(x.shape[0], 3 * max_rank, dtype=torch.float64)
    reference.sgmv_shrink(xd64, a64, cpu_info.seg_indptr, cpu_info.weight_indices, ranks, None, 3, v)
    ref = based.double().cpu()
    reference.sgmv_expand(v, b64, cpu_info.seg_indptr, cpu_info.weight_indices, ranks, scalings.double(), None,
                          offsets, ref)
    err = float((out.double().cpu() - ref).norm() / ref.norm())
    us = _time_us(lambda: apply_lora(xd, based.clone(), ad, bd, info, offsets, backend=backend), device)
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}[dtype]

    rows = [("backend", backend), ("device", str(device)), ("dtype", str(dtype).replace("torch.", "")),
            ("x", f"{tuple(x.shape)}"), ("qkv out", f"{offsets[-1]} = {' + '.join(map(str, widths))}"),
            ("segments", f"{len(counts)} (ranks 8/16/32/64 + one without LoRA)"),
            ("rel. error vs float64", f"{err:.2e} (tolerance {tol:.0e})"), ("time per apply_lora", f"{us:.1f} us")]
    width = max(len(k) for k, _ in rows)
    for k, val in rows:
        print(f"{k:<{width}}  {val}")
    ok = err <= tol
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="lora-kernels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run one multi-LoRA batch and check it against the reference")
    p.add_argument("--backend", choices=["auto", "cuda", "triton", "torch"], default=None)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp32")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=demo)
    serve_sim_cli.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError) as e:
        print(f"lora-kernels: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
