"""The GPU timeline of one layer's LoRA kernels under CUDA-graph replay: which kernel holds the chain, and how long.

bench_kernels times a layer (qkv, o, gate_up, down) as a sum; this probe shows its parts. It captures bench_kernels'
modules of a case in one graph (the rotated sets in turn, every module of a set), replays it under torch.profiler
(CUPTI records each kernel node of a replay), and prints the kernels of the last replay's middle layers in order:
start and end relative to the layer's first kernel, the duration, and the **increment** (end minus the previous
kernel's end): the time the kernel adds to the chain. Under programmatic dependent launch a kernel starts before its
predecessor ends (its weights' loads overlap it), so its duration holds that wait; the increments sum to the layer.

    python3 bench/profile/layer_timeline.py --backend cuda --cases "r16 decode 1x1 distinct,r16 decode 16x1 uniform"
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_kernels as bk  # noqa: E402
import common  # noqa: E402

REPLAYS = 3


def short(name: str) -> str:
    """A kernel's name without its namespace, template arguments and parameters."""
    name = name.split("(")[0]
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).replace("lora_kernels::", "").replace("void ", "")


def layer_kernels(case: bk.Case, backend: str):
    """[(name, start µs, end µs)] of the GPU operations (kernels, memsets) of one replay of a graph of every rotated
    set's layer, and the number of layers in it."""
    mods, infos = bk.build_case(case)
    order = "sorted" if "sorted" in infos else "unsorted"
    fns = {m: mod.fns(f"{backend} {order}") for m, mod in mods.items()}
    sets = min(len(f) for f in fns.values())
    layer = [fns[m][i] for i in range(sets) for m in mods]  # set i's modules in order, then set i + 1's
    graph = common.GraphTimer(layer, inner=len(layer)).graph
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    ops = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    per_replay = len(ops) // REPLAYS
    last = ops[(REPLAYS - 1) * per_replay:]
    return [(short(n), s, e) for s, e, n in last], sets


def report(case: bk.Case, backend: str) -> list[dict]:
    kernels, layers = layer_kernels(case, backend)
    per_layer = len(kernels) // layers
    mid = layers // 2  # a middle layer: the first waits on the replay's start
    chosen = kernels[mid * per_layer:(mid + 1) * per_layer]
    prev_end = kernels[mid * per_layer - 1][2] if mid > 0 else chosen[0][1]
    t0 = chosen[0][1]
    print(f"\n# {case.name}, {backend}: {per_layer} GPU operations a layer, {layers} layers a replay "
          f"(a replay's layer: {(kernels[-1][2] - kernels[0][1]) / layers:.1f} µs)")
    print(f"{'kernel':>40} {'start':>7} {'end':>7} {'dur':>6} {'incr':>6}")
    rows, incr_by = [], defaultdict(list)
    for name, s, e in chosen:
        incr = e - prev_end
        prev_end = e
        incr_by[name].append(incr)
        print(f"{name[:40]:>40} {s - t0:7.2f} {e - t0:7.2f} {e - s:6.2f} {incr:6.2f}")
        rows.append({"bench": "layer_timeline", "case": case.name, "backend": backend, "kernel": name,
                     "start_us": s - t0, "end_us": e - t0, "dur_us": e - s, "incr_us": incr})
    print("# increments by kernel (µs, sum / median): " + ", ".join(
        f"{n} {sum(v):.1f} / {statistics.median(v):.2f}" for n, v in incr_by.items()))
    return rows


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--cases", default="r16 decode 1x1 distinct,r16 decode 16x1 uniform,r16 decode 64x1 uniform",
                   help="comma list of bench_kernels case names")
    args = p.parse_args()
    print(f"# {common.device_name()}")
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    rows = []
    for case in bk.all_cases(False):
        if case.name in wanted:
            rows += report(case, args.backend)
    common.write_jsonl(args.json, rows)


if __name__ == "__main__":
    main()
