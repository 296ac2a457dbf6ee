"""What-if model of bench_serving's scenarios on the CPU: which load-path change could close issue 20's zipf gap?

    python bench/profile/serving_model.py --layerwise both                  (medians, layers even)
    python bench/profile/serving_model.py --stages-from out/serving.jsonl  (a GPU run's own stage times)
    python bench/profile/serving_model.py --stages-from out/serving.jsonl --host-scale 0.5

The real scheduler and simulator (lora_kernels.serve_sim) replay bench_serving.py's traces (same scenario,
seeds, loads, policies, oracle and statistics), but the engine is a cost model, not the GPU: a step takes
a + b * rows, a host stage and a copy take the median times measured per adapter rank by the H200 serving run
of de11cbf (bench/RESULTS.md) or, with --stages-from, every load a run measured, and the host tier is an LRU by
bytes of the same 25% budget. A tool to rank ideas before building them, never a result: the zipf:1.5 TTFT p50
ratio moves by +-0.05 between runs of the same code (on the GPU and here alike), so only changes well beyond that
show.

Changes it can model:
  --host-scale / --copy-scale  a faster host stage or copy (e.g. 0.5: twice as fast)
  --workers N                  host stages at once (the engine runs min(4, cores))
  --stages-from F.jsonl        replay the stage times a bench_serving run measured (its "stage times" row: every
                               layer-wise load's host stage, layer ends, copy and copy spans, by rank), cycling
                               through them per rank, instead of the medians below (implies --layerwise both)
  --cut-ms C                   C ms of fixed cost taken off the start of each replayed host stage
  --prefix-layers K            the first K layers of every adapter kept in host memory, out of the same budget:
                               a cold read starts at layer K (with --stages-from)
  --admit-within S             the overlap policies' admission share (default: serve-sim's, 0.25; 0: a request
                               waits for its load to be usable at a step's start)
  --layerwise host|copy|both   layer-wise loads, placed by the simulator layer by layer (LoadTiming's host_layers
                               and h2d_layers): a step may start before the adapter's last layers are in place,
                               and stops at a layer that is late. "copy": the host stage is one unit, its copy is
                               issued per layer; "host": the host stage reports each layer (its copy is one unit
                               after the last); "both". Each layer takes 1/L of the stage's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_serving import base_config  # noqa: E402

from lora_kernels.serve_sim import run as sr  # noqa: E402
from lora_kernels.serve_sim.folders import adapter_rank  # noqa: E402
from lora_kernels.serve_sim.sim import LoadTiming, StepTiming  # noqa: E402

HOST_MS = {8: 1.72, 16: 2.32, 32: 3.46, 64: 5.99}  # H200 serving run of de11cbf (layer-wise reads): median per rank
COPY_MS = {8: 0.31, 16: 0.49, 32: 0.86, 64: 1.57}


class ModelEngine:
    """The simulator's Engine protocol with modelled costs (see the module docstring)."""

    record, unfed_steps, unfed_loads = None, 0, 0

    def __init__(self, ranks, args):
        self.ranks, self.args, self.host_workers = ranks, args, args.workers
        self.size = [r / 8 for r in ranks]  # packed bytes are proportional to the rank
        self.samples = {}
        if args.stages_from:
            rows = [json.loads(line) for line in open(args.stages_from)]
            stage = next(row for row in rows if row.get("scenario") == "stage times")
            for r, v in stage["layers_by_rank"].items():  # rows [host layers, copy spans] before 7379000's successor
                self.samples[int(r)] = [x if len(x) == 4 else [x[0][-1] if x[0] else 0.0, x[0], sum(x[1] or ()), x[1]]
                                        for x in v]
        # --prefix-layers k: the first k of L layers of every adapter always in host memory, out of the same budget
        # (a cold read then starts at layer k; whole adapters share what is left).
        self.capacity = 0.25 * sum(self.size) - args.prefix_layers / 8 * sum(self.size)
        if self.capacity < max(self.size):
            raise SystemExit(f"--prefix-layers {args.prefix_layers} leaves no room for a whole adapter")

    def reset(self):
        self.host = OrderedDict()
        self.next = {r: 0 for r in set(self.ranks)}

    def _stage(self, a) -> bool:
        cold = a not in self.host
        self.host[a] = True
        self.host.move_to_end(a)
        while sum(self.size[k] for k in self.host) > self.capacity:
            self.host.popitem(last=False)
        return cold

    def issue_load(self, a, victim):
        cold = self._stage(a)
        self.host.move_to_end(a, last=False)  # the loader's host_exclusive demotion
        return a, cold, True

    def issue_stage(self, a):
        return a, self._stage(a), False

    def load_seconds(self, handle) -> LoadTiming:
        a, cold, load = handle
        r, args = self.ranks[a], self.args
        if self.samples:  # measured: the next recorded load of this rank
            rows = self.samples[r]
            host_s, host_layers, h2d_s, h2d_layers = rows[self.next[r] % len(rows)]
            self.next[r] += 1
            hs, cs = args.host_scale, args.copy_scale
            host_s, h2d_s = host_s * hs, h2d_s * cs
            host_layers = [t * hs for t in host_layers] if host_layers else host_layers
            k = args.prefix_layers
            if k and cold and host_layers:  # layers [0, k) are in host memory: the read starts at layer k, with
                # the stage's fixed cost is still paid; k layers' reads (at the stage's pace) are not
                base = k * (host_layers[-1] - host_layers[0]) / (len(host_layers) - 1)
                host_layers = [0.0] * k + [t - base for t in host_layers[k:]]
                host_s = max(host_s - base, host_layers[-1])
            cut = args.cut_ms * 1e-3  # a fixed cost removed from the stage's start
            if cut and host_layers:
                host_layers = [max(t - cut, 2e-5 * (k + 1)) for k, t in enumerate(host_layers)]
                host_s = max(host_s - cut, host_layers[-1])
            h2d_layers = [t * cs for t in h2d_layers] if h2d_layers else h2d_layers
            return LoadTiming(host_s if cold else 0.0, h2d_s if load else 0.0, cold,
                              tuple(host_layers) if cold and host_layers else None,
                              tuple(h2d_layers) if load and h2d_layers else None)
        host = HOST_MS[r] * 1e-3 * args.host_scale if cold else 0.0
        copy = COPY_MS[r] * 1e-3 * args.copy_scale if load else 0.0
        n, mode = self.layers, args.layerwise
        host_layers = tuple(host * (i + 1) / n for i in range(n)) if cold and mode in ("host", "both") else None
        h2d_layers = (copy / n,) * n if load and mode in ("copy", "both") else None
        return LoadTiming(host, copy, cold, host_layers, h2d_layers)

    def host_resident(self):
        return set(self.host)

    def host_budget(self):
        return self.capacity, self.size

    def run_step(self, plan) -> StepTiming:
        return StepTiming(self.args.step_a_ms * 1e-3 + self.args.step_b_us * 1e-6 * plan.num_tokens, 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host-scale", type=float, default=1.0)
    p.add_argument("--copy-scale", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--layerwise", choices=("none", "host", "copy", "both"), default="none")
    p.add_argument("--stages-from", default=None)
    p.add_argument("--cut-ms", type=float, default=0.0)
    p.add_argument("--prefix-layers", type=int, default=0)
    p.add_argument("--step-a-ms", type=float, default=1.8)
    p.add_argument("--step-b-us", type=float, default=7.0)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--admit-within", type=float, default=None)
    args = p.parse_args()
    cfg = base_config(SimpleNamespace(requests=100, seeds=args.seeds, loads="0.5,0.8,0.95", dists="zipf:1.5,distinct",
                                      cache_dir=None, host_budget="25%", host_workers=None, smoke=False, layers=8,
                                      backend="auto", timed_layers=None))
    if args.admit_within is not None:
        cfg = dataclasses.replace(cfg, admit_within=args.admit_within)
    ranks = [adapter_rank(k, cfg.rank_list()) for k in range(cfg.adapters)]  # as the bench's folders are written
    report = sr.Report(cfg, adapter_ranks=ranks, host={})
    engine = ModelEngine(ranks, args)
    engine.layers = cfg.layers
    sr.run_grid(cfg, engine, report)
    print(f"# modelled: {vars(args)}")
    for s in report.stats:
        if s["load"] == 0.8 and s["policy"] in ("overlap+prefetch", "oracle"):
            x = s["ttft_p50_x"]
            print(f"{s['dist']:9s} {s['policy']:17s} TTFT p50 {s['ttft_p50_ms']:5.2f} ms, x oracle {x['median']:.3f} "
                  f"[{x['lo']:.3f}, {x['hi']:.3f}], E2E p50 x oracle {s['e2e_p50_x']['median']:.3f}")


if __name__ == "__main__":
    main()
