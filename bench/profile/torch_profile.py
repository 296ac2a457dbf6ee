"""Records the workload loop with torch.profiler, writes a Chrome trace, and checks batch preparation.

Prints the number of synchronizing CUDA calls (stream/device/event synchronize, blocking or
device-to-host copies, frees) inside the "batch_prep" ranges, and the GPU idle time between consecutive
GPU operations. Exit status: 0 = no sync in batch preparation, 1 = syncs found, 2 = nothing to verify
(no GPU, or the trace holds no batch-prep range or no CUDA call inside one). Needs only a GPU, not nsys.

    python bench/profile/torch_profile.py [--steps 40] [--baseline] [--graph] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import analysis  # noqa: E402
import workload  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CALL_CATS = ("cuda_runtime", "cuda_driver")


def analyze(trace: dict) -> dict:
    """Sync calls inside the batch-prep ranges and GPU idle gaps, from a Chrome trace (times in µs)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    d2h = {e["args"].get("correlation") for e in events
           if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "")}
    prep, steps_ranges = {}, []
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") == workload.PREP:
            prep.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
            steps_ranges.append((e["ts"], e["ts"] + e["dur"]))
    calls = {}
    for e in events:
        if e.get("cat") in CALL_CATS:
            calls.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e))
    inside = []
    for tid, ranges in prep.items():
        inside += analysis.calls_in_ranges(ranges, calls.get(tid, []))
    if steps_ranges and not inside:  # a Kineto that files CUDA calls under another tid: match by time alone
        inside = analysis.calls_in_ranges(steps_ranges, [c for cs in calls.values() for c in cs])
    syncs = [e["name"] for e in inside
             if analysis.is_sync_call(e["name"]) or e.get("args", {}).get("correlation") in d2h]
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    return {"prep_ranges": len(steps_ranges), "calls_in_prep": len(inside),
            "call_names_in_prep": dict(Counter(e["name"] for e in inside)), "syncs": len(syncs),
            "sync_names": dict(Counter(syncs)), **analysis.gap_stats(gpu, steps_ranges, kernels)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload.add_args(ap)
    ap.add_argument("--out", type=Path, default=Path("out/profile"), help="directory for the Chrome trace")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_profile.py needs a CUDA device: nothing to verify")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    name = "baseline" if args.baseline else ("graph" if args.graph else "eager")
    p = workload.make_problem()
    loop = workload.Loop(p, args.baseline, args.graph)
    steps = workload.schedule(args.steps, p)
    workload.warm_up(loop, steps)  # every step once unrecorded: no compilation inside the trace
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        workload.measure(loop, steps, workload.Ranges(True, False))
    path = args.out / f"torch_trace_{name}.json"
    prof.export_chrome_trace(str(path))
    r = analyze(json.loads(path.read_text()))
    print(f"[{name}] {torch.cuda.get_device_name()}, {args.steps} steps; Chrome trace: {path}")
    print(f"batch-prep ranges: {r['prep_ranges']}; CUDA calls inside them: {r['calls_in_prep']} "
          f"{r['call_names_in_prep']}")
    print(f"synchronizing calls in batch preparation: {r['syncs']} {r['sync_names'] or ''}")
    print(f"GPU: {r['gpu_ops']} ops, idle {r['idle_total']:.0f} us of {r['window']:.0f} us in {r['gaps']} gaps "
          f"(median {r['gap_median']:.1f} us, max {r['gap_max']:.1f} us); per step, batch-prep range "
          f"median {r['prep_median']:.1f} us, GPU bubble from the previous step's last op to this step's first "
          f"kernel median {r['prep_bubble_median']:.1f} us ({r['prep_bubbles']} steps)")
    if not args.baseline:
        print(f"builder: {loop.builder.builds} builds, {loop.builder.stalls} stalls")
    (args.out / f"torch_profile_{name}.json").write_text(json.dumps(r, indent=1))
    if r["prep_ranges"] == 0 or r["calls_in_prep"] == 0:
        print("FAIL: the trace holds no batch-prep range with CUDA calls inside; cannot verify")
        return 2
    if r["syncs"]:
        print("FAIL: batch preparation synchronizes with the GPU")
        return 1
    print("OK: batch preparation issues no synchronizing call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
