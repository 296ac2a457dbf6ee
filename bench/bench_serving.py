"""Serving simulation on the GPU (issue 7): blocking vs overlap vs overlap+prefetch adapter loading.

Scenario: Llama-3-8B linear dims, 8 layers, bf16; 64 PEFT adapters (ranks 8/16/32/64, cycled) over 16
GPU slots (max rank 64); continuous batching with 512-token prefill chunks, <= 32 requests and 2,048
rows per step; prompts 8-512 tokens (S-LoRA's synthetic range), outputs 8-128 tokens; adapter
popularity zipf:1.5 and distinct. Steps run through the real kernels (backend "auto"), batch-info
builder and AdapterLoader; the simulated clock advances by CUDA-event times of each step's GPU work
and each load's copy (lora_kernels/serve_sim/sim.py says how).

1. Correctness: a short trace under the three policies with every request's layer-0 qkv LoRA output
   recorded (digest per position): under the torch reference backend (per-segment GEMMs) the outputs
   must be identical across policies; under the run's backend the agreement is reported (its launch
   plan, e.g. split-K, may depend on the batch's shape).
2. Rate: per popularity, one real blocking run with every request queued at t = 0 measures capacity and
   feeds a cost model (serve_sim/costmodel.py); the model finds the rate at which blocking's median TTFT
   is `--knee` (3) times its unloaded value — the GPU is busy there. The model only picks the rate.
3. At that rate (and at 0.8x it if time allows), real runs of the three policies: TTFT/E2E p50/p99,
   tokens/s, loads, GPU time stalled on loads, host prep; reductions vs blocking against the targets
   (TTFT p50 >= 50%, E2E p50 >= 30%, tokens/s within 5% or better).

Writes JSON lines (--json), and beside them bench_serving.md (the RESULTS.md section body),
serving_timeline.json (timelines + latencies, to re-plot) and serving_timeline.png (if matplotlib).

    python bench/bench_serving.py [--quick] [--json out.jsonl] [--budget-s 150] [--requests 200]
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

import common
from lora_kernels.serve_sim import run as sr
from lora_kernels.serve_sim.costmodel import MeasuringEngine, knee_rate
from lora_kernels.serve_sim.metrics import compare, summarize
from lora_kernels.serve_sim.plot import plot, plot_data
from lora_kernels.serve_sim.sim import simulate
from lora_kernels.serve_sim.trace import generate_trace, parse_range

TARGETS = {"ttft_p50_reduction": 0.50, "e2e_p50_reduction": 0.30, "tokens_per_s_ratio": 0.95}


def base_config(args) -> sr.SimConfig:
    return sr.SimConfig(model="llama3-8b", layers=args.layers, adapters=64, slots=16, ranks="8,16,32,64", max_rank=64,
                        requests=args.requests, input_len="8:512", output_len="8:128", chunk=512, max_running=32,
                        max_batch_tokens=2048, max_prefetch=4, dtype="bf16", device="cuda", backend=args.backend,
                        check=False, cache_dir=args.cache_dir)


def log(msg: str) -> None:
    print(msg, flush=True)


class Bench:
    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.out_dir = args.json.parent if args.json else Path(__file__).parent
        self.rows: list[dict] = []
        self.md: list[str] = []
        self.plots: dict = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        (self.out_dir / "bench_serving.md").write_text("\n".join(self.md) + "\n")
        (self.out_dir / "serving_timeline.json").write_text(json.dumps(self.plots))

    def emit(self, rows: list[dict]) -> None:
        self.rows += rows
        common.write_jsonl(self.args.json, rows)
        self.save()

    def run_policies(self, cfg, engine, trace, tag: str) -> list[dict]:
        rep = sr.Report(cfg, [], {}, adapter_ranks=engine.ranks)
        for policy in sr.POLICIES:
            t = time.perf_counter()
            res = simulate(trace, sr.scheduler_config(cfg, policy), engine)
            rep.results[policy] = res
            row = summarize(res)
            row.update(scenario=tag, dist=cfg.dist, rate=cfg.rate, unfed_steps=engine.unfed_steps)
            rep.rows.append(row)
            log(f"  {policy:<17} TTFT p50 {row['ttft_p50_ms']:7.1f} ms p99 {row['ttft_p99_ms']:7.1f} | E2E p50 "
                f"{row['e2e_p50_ms']:7.1f} p99 {row['e2e_p99_ms']:7.1f} | {row['tokens_per_s']:6.0f} tok/s | loads "
                f"{row['loads']:3d} | stalled {row['stall_ms']:6.1f} ms | steps {row['steps']} | unfed "
                f"{engine.unfed_steps} | wall {time.perf_counter() - t:.1f} s")
        self.plots[tag] = plot_data(rep)
        return rep.rows


def table(rows: list[dict]) -> list[str]:
    out = ["| policy | TTFT p50 / p99 ms | E2E p50 / p99 ms | tokens/s | loads | GPU stalled on loads ms | "
           "host prep µs/step | steps |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['policy']} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['e2e_p50_ms']:.1f} / "
                   f"{r['e2e_p99_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['loads']} | {r['stall_ms']:.1f} | "
                   f"{r['host_prep_us_per_step']:.0f} | {r['steps']} |")
    cmp = compare(rows).get("overlap+prefetch")
    if cmp:
        verdict = []
        for key, label in (("ttft_p50_reduction", "TTFT p50 reduction"), ("e2e_p50_reduction", "E2E p50 reduction"),
                           ("tokens_per_s_ratio", "tokens/s ratio")):
            ok = cmp[key] >= TARGETS[key]
            want = f">= {TARGETS[key]:.0%}" if key != "tokens_per_s_ratio" else ">= 0.95"
            val = f"{cmp[key]:.1%}" if key != "tokens_per_s_ratio" else f"{cmp[key]:.3f}"
            verdict.append(f"{label} {val} (target {want}: {'met' if ok else 'not met'})")
        out += ["", "overlap+prefetch vs blocking: " + "; ".join(verdict) + "."]
    return out


def correctness(b: Bench, cfg, engine) -> None:
    log("== correctness: layer-0 LoRA outputs per request across policies")
    c = dataclasses.replace(cfg, requests=24, rate=float("inf"), input_len="8:96", output_len="2:12", dist="uniform")
    trace = sr.make_trace(c, 64)
    backends = tuple(dict.fromkeys(("torch", cfg.backend)))
    records = {}
    for policy in sr.POLICIES:
        engine.record = sr.Records(backends, "ends")
        simulate(trace, sr.scheduler_config(c, policy), engine)
        records[policy] = engine.record
    engine.record = None
    rows = []
    for bk in backends:
        chk = sr.compare_records(records, bk)
        log(f"  {bk}: {chk}")
        rows.append({"scenario": "correctness", **chk})
    b.md += ["### Correctness", "", f"24 requests (uniform over 64 adapters, all queued at t = 0), layer-0 qkv LoRA output "
             "of every processed position, compared across the three policies:", ""]
    for r in rows:
        b.md.append(f"- `{r['backend']}` backend: {r['positions_compared']} positions, "
                    + ("**identical**" if r["identical"] else
                       f"{r['mismatched_requests']} of {r['requests']} requests differ in some bit; largest relative "
                       f"difference of the sampled rows {r['max_rel_diff']:.1e}"))
    b.md.append("")
    b.emit(rows)


def scenario(b: Bench, cfg, engine, dist: str) -> None:
    args = b.args
    log(f"== {dist}: calibration (blocking, all {cfg.requests} requests queued at t = 0)")
    c = dataclasses.replace(cfg, dist=dist, rate=float("inf"))
    meas = MeasuringEngine(engine, engine.ranks)
    res = simulate(sr.make_trace(c, 64), sr.scheduler_config(c, "blocking"), meas)
    capacity = cfg.requests / res.makespan
    model = meas.fit()
    inp, out = parse_range(cfg.input_len, "in"), parse_range(cfg.output_len, "out")

    def make(rate):
        return generate_trace(cfg.requests, rate, dist, 64, inp, out, 4096, cfg.seed)

    rate, info = knee_rate(make, sr.scheduler_config(c, "blocking"), model, capacity, knee=args.knee)
    load_ms = {r: round(1e3 * s, 3) for r, s in sorted(model.load_s.items())}
    log(f"  capacity {capacity:.1f} req/s; model: step = {1e3 * model.coef[0]:.3f} ms + {1e6 * model.coef[1]:.2f} us/row "
        f"+ {1e6 * model.coef[2]:.3f} us/rank; load ms by rank {load_ms}; knee rate {rate:.1f} req/s "
        f"(unloaded TTFT p50 {info['unloaded_ttft_p50_ms']:.2f} ms)")
    b.emit([{"scenario": f"{dist} calibration", "dist": dist, "capacity_req_s": capacity, "coef": model.coef,
             "load_ms_by_rank": load_ms, "knee_rate": rate, **{k: v for k, v in info.items() if k != "curve"}}])
    b.md += [f"### {dist}", "", f"Calibration: blocking with all {cfg.requests} requests queued at t = 0 served "
             f"{capacity:.1f} req/s; fitted step time {1e3 * model.coef[0]:.3f} ms + {1e6 * model.coef[1]:.2f} µs/row "
             f"+ {1e6 * model.coef[2]:.3f} µs per unit of the batch's adapter ranks; measured load time by rank (ms) "
             f"{load_ms}. Knee rate (modelled blocking TTFT p50 = {args.knee:g}x its unloaded "
             f"{info['unloaded_ttft_p50_ms']:.2f} ms): **{rate:.1f} req/s**.", ""]
    for frac in (1.0, 0.8):
        if frac != 1.0 and b.elapsed() > args.budget_s:
            log(f"  skipping {frac}x knee: {b.elapsed():.0f} s used of the {args.budget_s} s budget")
            b.md += [f"({frac}x knee rate not run: time budget)", ""]
            continue
        r = dataclasses.replace(cfg, dist=dist, rate=round(rate * frac, 2))
        tag = f"{dist} @ {r.rate:g} req/s"
        log(f"== {tag} ({frac}x knee)")
        rows = b.run_policies(r, engine, sr.make_trace(r, 64), tag)
        b.md += [f"At {r.rate:g} req/s ({frac:g}x the knee rate):", ""] + table(rows) + [""]
        b.emit(rows)


def main() -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--requests", type=int, default=int(os.environ.get("BENCH_SERVING_REQUESTS", 200)))
    p.add_argument("--knee", type=float, default=3.0)
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("BENCH_SERVING_BUDGET_S", 150)),
                   help="skip the optional 0.8x runs once this many seconds have passed")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dists", default="zipf:1.5,distinct")
    p.add_argument("--cache-dir", default=None)
    args = p.parse_args()
    if args.quick:
        args.requests, args.layers = 60, 2
    if not torch.cuda.is_available():
        print("bench_serving.py needs a CUDA device", file=sys.stderr)
        return 1
    b = Bench(args)
    cfg = sr.validate(base_config(args))
    m = common.meta()
    h2d = common.h2d_bandwidth_gbs()
    log(f"device {m['device']}, torch {m['torch']}, triton {m['triton']}, backend {cfg.backend}; pinned H2D {h2d:.1f} GB/s")
    t = time.perf_counter()
    paths = sr.adapter_folders(cfg)
    t_gen = time.perf_counter() - t
    engine = sr.make_engine(cfg, paths)
    log(f"adapters ready in {t_gen:.1f} s (folders) + {time.perf_counter() - t - t_gen:.1f} s (engine: read, pack, "
        f"weights); ranks {sorted(set(engine.ranks))}")
    engine.record = None
    simulate(sr.make_trace(dataclasses.replace(cfg, requests=8, rate=float("inf")), 64),
             sr.scheduler_config(cfg, "blocking"), engine)  # warm-up: compile, allocate
    spec = cfg.spec()
    b.md += [f"{m['device']}, torch {m['torch']}, Triton {m['triton']}, backend `{cfg.backend}`, {m['date']}; "
             f"pinned H2D {h2d:.1f} GB/s. Model: {cfg.model} linear dims x {spec.layers} layers, {cfg.dtype}; 64 adapters "
             f"(ranks 8/16/32/64) over 16 slots; {cfg.requests} requests, prompts {cfg.input_len}, outputs "
             f"{cfg.output_len}; chunk {cfg.chunk}, <= {cfg.max_running} requests / {cfg.max_batch_tokens} rows per step; "
             f"max_prefetch {cfg.max_prefetch}.", ""]
    b.emit([{"scenario": "setup", "h2d_gbs": h2d, "folders_s": t_gen, "backend": cfg.backend}])
    status = 0
    for step in [lambda: correctness(b, cfg, engine)] + [lambda d=d: scenario(b, cfg, engine, d)
                                                          for d in args.dists.split(",")]:
        try:
            step()
        except Exception:  # keep what the other scenarios measure
            traceback.print_exc()
            b.md += ["(a scenario failed: see the log)", ""]
            status = 1
        log(f"-- {b.elapsed():.0f} s")
    b.save()
    try:
        first = next(iter(b.plots))
        plot(b.plots[first], str(b.out_dir / "serving_timeline.png"))
        log(f"picture of '{first}': {b.out_dir / 'serving_timeline.png'}")
    except Exception as e:  # noqa: BLE001 (matplotlib missing or no scenario ran)
        log(f"no picture: {e}")
    return status


if __name__ == "__main__":
    sys.exit(main())
