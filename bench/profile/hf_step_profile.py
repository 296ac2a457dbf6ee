"""Where an eager HF decode step spends its host time: base model against the integration (issue 14).

Builds bench_hf's model (random weights), times one decode step (batch of REQUESTS rows, one new token on a
KV cache of ~PROMPT tokens, synchronized wall time, median) for: the plain model; the integration with every row
"__base__" (lk_no_lora); the integration with N adapters (lk_mixed), interleaved over --rounds, Python's GC on
and off, base on a second untouched model. Only then (a process that has run torch.profiler times every later
step slower) records one step of each under torch.profiler and prints the ops with the largest host (self CPU) time and the number of GPU kernels per step,
and for the integration the host time per step spent inside the patched modules' forwards (of which in
`apply_lora`).

    python bench/profile/hf_step_profile.py [--model 1b] [--adapters 32] [--top 15] [--cprofile] [--backends default,auto,cuda] [--no-profile]
        [--phase decode|prefill]

--cprofile adds, for every variant, a cProfile of 20 steps (Python functions by own time).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_hf as bh  # noqa: E402


def _time_ms(step, device, reps=20, gc_off=False) -> float:
    for _ in range(10):
        step()
    ts = []
    if gc_off:
        gc.collect()
        gc.disable()
    try:
        for _ in range(reps):
            torch.cuda.synchronize() if device == "cuda" else None
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize() if device == "cuda" else None
            ts.append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.enable()
    return statistics.median(ts)


def _interleaved(variants, device, rounds) -> dict:
    """label -> per-round medians; every variant once per round (with Python's cyclic GC on, then off), so that a
    slow phase of the machine lands on all alike."""
    out = {}
    for _ in range(rounds):
        for label, (enter, step) in variants.items():
            with enter():
                for gc_off in (False, True):
                    out.setdefault(label + (" gc off" if gc_off else ""), []).append(_time_ms(step, device, 20, gc_off))
    return out


def _profile(label, step, device, top):
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    step()
    with torch.profiler.profile(activities=acts) as prof:
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    print(f"\n## {label}: {kernels} GPU kernels/copies per step; ops by self host time")
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    if device == "cuda":  # a prefill step is device-bound: where its GPU time goes
        print(f"\n## {label}: ops by self GPU time")
        print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))


def _inside_patched(mlm, step, reps=20) -> str:
    """Host ms per step inside the patched modules' forwards and inside apply_lora (wrapped timers)."""
    import functools
    import time as _t

    from lora_kernels.integrations import hf

    spent = {"forward": 0.0, "apply_lora": 0.0}

    def timed(fn, key):
        @functools.wraps(fn)
        def run(*a, **k):
            t0 = _t.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += _t.perf_counter() - t0
        return run

    mods = [m for m, _ in mlm._patched]
    saved = [m.__dict__["forward"] for m in mods]
    apply = hf.apply_lora
    for m, f in zip(mods, saved):
        m.forward = timed(f, "forward")
    hf.apply_lora = timed(apply, "apply_lora")
    try:
        for _ in range(reps):
            step()
    finally:
        hf.apply_lora = apply
        for m, f in zip(mods, saved):
            m.forward = f
    return (f"host ms per step inside the patched forwards {1e3 * spent['forward'] / reps:.2f}, of which apply_lora "
            f"{1e3 * spent['apply_lora'] / reps:.2f} ({len(mods)} patched modules)")


def _cprofile(label, step, top, reps=20):
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        step()
    prof.disable()
    print(f"\n## {label}: cProfile of {reps} steps (own time)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1b", choices=sorted(bh.SHAPES))
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--cprofile", action="store_true", help="also cProfile 20 steps of each variant")
    p.add_argument("--backends", default="default,auto", help="apply_lora backends for lk_mixed, comma list (default: "
                   "the integration's own choice; auto, triton, cuda: that backend for every forward)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (median and range over rounds)")
    p.add_argument("--no-profile", action="store_true", help="the interleaved timing only")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="what a step is: one decode token on a fixed KV cache, or the prefill of the whole prompt")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from lora_kernels.integrations.hf import enable_multi_lora

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = bh.build_model(args.model, device, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, bh.SHAPES[args.model]["vocab_size"], (bh.REQUESTS, bh.PROMPT), generator=g).to(device)
    # A second, untouched model for the interleaved base timing (the first gets PEFT and the integration).
    plain = bh.build_model(args.model, device, dtype)
    pm = bh.add_peft_adapters(model, args.adapters, device)
    mlm = enable_multi_lora(pm, num_slots=args.adapters)
    mixed = [f"ad{i % args.adapters}" for i in range(bh.REQUESTS)]
    runs = [("lk_no_lora", [bh.BASE] * bh.REQUESTS, None)] + [
        (f"lk_mixed {args.adapters} {b}", mixed, None if b == "default" else b) for b in args.backends.split(",")]

    def enter_for(names, backend):
        def enter():
            mlm._rt.set_backend(backend)
            return mlm.batch(names)
        return enter

    def step_of(fn):
        if args.phase == "decode":
            return bh.decode_step(fn, ids)
        mask = torch.ones_like(ids)

        def prefill():
            with torch.no_grad():
                fn(input_ids=ids, attention_mask=mask, logits_to_keep=1)
        return prefill

    variants = {"base": (contextlib.nullcontext, step_of(plain))}
    for label, names, backend in runs:
        enter = enter_for(names, backend)
        with enter():
            variants[label] = (enter, step_of(mlm.model))
    # Timed first: once torch.profiler has run in a process, every later step measured slower there (H200: the same
    # base step 10.7 ms before the first profile, 17-29 ms after), so no figure is taken after a profile.
    res = _interleaved(variants, device, args.rounds)
    base = statistics.median(res["base"])
    print(f"# {args.phase}, interleaved, {args.rounds} rounds (median of the rounds' medians of 20 steps [min, max]), base on a second "
          f"untouched model:")
    for label, v in res.items():
        m = statistics.median(v)
        print(f"#   {label:<24} {m:7.2f} ms [{min(v):.2f}, {max(v):.2f}]  {100 * (m / base - 1):+6.1f}% over base")
    if args.no_profile:
        return
    _profile("base", variants["base"][1], device, args.top)
    if args.cprofile:
        _cprofile("base", variants["base"][1], args.top)
    for label, _, _ in runs:
        enter, step = variants[label]
        with enter():
            _profile(label, step, device, args.top)
            print(f"# {label}: {_inside_patched(mlm, step)}")
            if args.cprofile:
                _cprofile(label, step, args.top)


if __name__ == "__main__":
    main()
