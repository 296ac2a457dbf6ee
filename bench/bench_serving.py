"""Serving simulation on the GPU (issue 7): blocking vs overlap vs overlap+prefetch, adapters on disk / host / GPU.

Scenario: Llama-3-8B linear dims, 8 layers, bf16; 64 PEFT adapter folders (ranks 8/16/32/64 cycled, every
module of every layer: 10-84 MB each) over 16 GPU slots (max rank 64). Host memory for packed (pinned)
adapters is bounded to 25% of the adapters' bytes (~16 adapters of mean size: as many as the GPU slots,
like vLLM's default max_cpu_loras = max_loras), LRU; every other adapter is only its folder on disk, and
loading it starts with the host stage (read + parse the safetensors file, pack into pinned memory) on a
worker thread, then the H2D copy on the loader's stream. Every policy starts with empty GPU slots and empty
host memory. Continuous batching: 512-token prefill chunks, <= 32 requests and 2,048 rows per step; prompts
8-512 tokens, outputs 8-128; popularity zipf:1.5 and distinct. The simulated clock advances by CUDA-event
times of each step's GPU work and each copy, and by the worker's wall time of each host stage
(lora_kernels/serve_sim/sim.py says how each is placed).

1. Correctness: a short trace under the three policies with every request's layer-0 qkv LoRA output
   recorded (digest per position): identical across policies under the torch reference backend; the run's
   backend's agreement is reported (its launch plan may depend on the batch's shape).
2. Per popularity, capacity: blocking with every request queued at t = 0. The chosen rate is 0.8x that
   capacity (a loaded but stable server for the baseline; fixed before any result was seen).
3. At the chosen rate, the three policies: TTFT/E2E p50/p99, tokens/s, loads, folder reads, GPU busy and
   stalled shares, host prep; reductions vs blocking against the issue's targets.
4. Rate sweep (as time allows, in this order): overlap+prefetch with every request queued at t = 0 (its
   capacity), blocking and overlap+prefetch at 0.5x blocking's capacity; with (2) and (3) it shows GPU busy %
   against the offered rate.

Writes JSON lines (--json), and beside them bench_serving.md (the RESULTS.md section body), serving_timeline.json
(timelines + latencies, to re-plot) and serving_timeline_<dist>.png (if matplotlib).

    python bench/bench_serving.py [--json out.jsonl] [--requests 100] [--budget-s 120] [--host-budget 25%]
    python bench/bench_serving.py --smoke     # every step on the CPU with the tiny model (checks the script)
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import common
from lora_kernels.serve_sim import run as sr
from lora_kernels.serve_sim.metrics import compare, summarize
from lora_kernels.serve_sim.plot import plot, plot_data
from lora_kernels.serve_sim.sim import simulate

TARGETS = {"ttft_p50_reduction": 0.50, "e2e_p50_reduction": 0.30, "tokens_per_s_ratio": 0.95}
RATE_FRACTION = 0.8  # chosen rate = this x blocking's capacity
# Sweep runs after the main tables, cheapest first (a run at a low rate has many small decode steps).
SWEEP = ((float("inf"), "overlap+prefetch"), (0.5, "blocking"), (0.5, "overlap+prefetch"))


def base_config(args) -> sr.SimConfig:
    if args.smoke:
        return sr.SimConfig(model="tiny", layers=1, adapters=16, slots=4, ranks="8,16,32", requests=args.requests,
                            input_len="8:64", output_len="2:16", chunk=32, max_running=8, max_batch_tokens=64,
                            device="cpu", backend="torch", check=False, cache_dir=args.cache_dir,
                            host_budget=args.host_budget)
    return sr.SimConfig(model="llama3-8b", layers=args.layers, adapters=64, slots=16, ranks="8,16,32,64", max_rank=64,
                        requests=args.requests, input_len="8:512", output_len="8:128", chunk=512, max_running=32,
                        max_batch_tokens=2048, max_prefetch=4, dtype="bf16", device="cuda", backend=args.backend,
                        check=False, cache_dir=args.cache_dir, host_budget=args.host_budget)


def log(msg: str) -> None:
    print(msg, flush=True)


class StageLog:
    """Wraps an engine and keeps each measured host stage (folder reads only) and copy by adapter rank."""

    def __init__(self, engine):
        self.engine = engine
        self.host: dict[int, list[float]] = {}
        self.copy: dict[int, list[float]] = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def issue_load(self, adapter, victim):
        return adapter, self.engine.issue_load(adapter, victim)

    def issue_stage(self, adapter):
        return adapter, self.engine.issue_stage(adapter)

    def load_seconds(self, handle):
        adapter, inner = handle
        t = self.engine.load_seconds(inner)
        rank = self.engine.ranks[adapter]
        if t.cold:
            self.host.setdefault(rank, []).append(t.host_s)
        if t.h2d_s:
            self.copy.setdefault(rank, []).append(t.h2d_s)
        return t

    def medians_ms(self, which: dict) -> dict[int, float]:
        return {r: round(1e3 * statistics.median(v), 2) for r, v in sorted(which.items())}


class Bench:
    def __init__(self, args, engine, t0: float):
        self.args, self.t0 = args, t0
        self.engine = StageLog(engine)
        self.out_dir = args.json.parent if args.json else Path(__file__).parent
        self.md: list[str] = []
        self.plots: dict = {}
        self.sweep: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def save(self) -> None:
        (self.out_dir / "bench_serving.md").write_text("\n".join(self.md) + "\n")
        (self.out_dir / "serving_timeline.json").write_text(json.dumps(self.plots))

    def emit(self, rows: list[dict]) -> None:
        common.write_jsonl(self.args.json, rows)
        self.save()

    def run(self, cfg, trace, policy: str, tag: str) -> tuple[dict, object]:
        t = time.perf_counter()
        res = simulate(trace, sr.scheduler_config(cfg, policy), self.engine)
        row = summarize(res)
        row.update(scenario=tag, dist=cfg.dist, rate=cfg.rate, unfed_steps=self.engine.unfed_steps,
                   unfed_loads=self.engine.unfed_loads, stall_share=res.stall_s / res.makespan)
        log(f"  {policy:<17} TTFT p50 {row['ttft_p50_ms']:8.1f} ms p99 {row['ttft_p99_ms']:8.1f} | E2E p50 "
            f"{row['e2e_p50_ms']:8.1f} p99 {row['e2e_p99_ms']:8.1f} | {row['tokens_per_s']:6.0f} tok/s | loads "
            f"{row['loads']:3d} reads {row['host_reads']:3d} staged {row['staged']:3d} | busy {row['gpu_util']:4.0%} "
            f"stalled {row['stall_share']:4.0%} | steps {row['steps']} | unfed {row['unfed_steps']}/"
            f"{row['unfed_loads']} | wall {time.perf_counter() - t:.1f} s")
        return row, res


def fmt_rate(rate: float) -> str:
    return "all at t = 0" if rate == float("inf") else f"{rate:g} req/s"


def table(rows: list[dict]) -> list[str]:
    out = ["| policy | TTFT p50 / p99 ms | E2E p50 / p99 ms | tokens/s | loads | folder reads (host-only) | "
           "GPU busy | GPU stalled on loads | host prep µs/step | steps |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['policy']} | {r['ttft_p50_ms']:.1f} / {r['ttft_p99_ms']:.1f} | {r['e2e_p50_ms']:.1f} / "
                   f"{r['e2e_p99_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['loads']} | {r['host_reads']} "
                   f"({r['staged']}) | {r['gpu_util']:.0%} | {r['stall_ms']:.0f} ms ({r['stall_share']:.0%}) | "
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


def correctness(b: Bench, cfg) -> None:
    log("== correctness: layer-0 LoRA outputs per request across policies")
    c = dataclasses.replace(cfg, requests=24, rate=float("inf"), input_len="8:96", output_len="2:12", dist="uniform")
    trace = sr.make_trace(c, cfg.adapters)
    backends = tuple(dict.fromkeys(("torch", cfg.backend)))
    records = {}
    eng = b.engine.engine
    for policy in sr.POLICIES:
        eng.record = sr.Records(backends, "ends")
        res = simulate(trace, sr.scheduler_config(c, policy), eng)
        records[policy] = eng.record
        log(f"  {policy}: {res.loads} loads, {res.host_reads} folder reads, {res.staged} host-only stages")
    eng.record = None
    rows = []
    for bk in backends:
        chk = sr.compare_records(records, bk)
        log(f"  {bk}: {chk}")
        rows.append({"scenario": "correctness", **chk})
    b.md += ["### Correctness", "", f"24 requests (uniform over the {cfg.adapters} adapters, all queued at t = 0, same "
             "host budget: folder reads included), layer-0 qkv LoRA output of every processed position, compared "
             "across the three policies:", ""]
    for r in rows:
        b.md.append(f"- `{r['backend']}` backend: {r['positions_compared']} positions, "
                    + ("**identical**" if r["identical"] else
                       f"{r['mismatched_requests']} of {r['requests']} requests differ in some bit; largest relative "
                       f"difference of the sampled rows {r['max_rel_diff']:.1e}"))
    b.md.append("")
    b.emit(rows)


def scenario(b: Bench, cfg, dist: str) -> dict:
    """Capacity, then the three policies at the chosen rate. Returns what the sweep needs."""
    log(f"== {dist}: capacity (blocking, all {cfg.requests} requests queued at t = 0)")
    c = dataclasses.replace(cfg, dist=dist, rate=float("inf"))
    cap_row, cap_res = b.run(c, sr.make_trace(c, cfg.adapters), "blocking", f"{dist} capacity")
    capacity = cfg.requests / cap_res.makespan
    rate = round(RATE_FRACTION * capacity, 2)
    log(f"  capacity {capacity:.1f} req/s -> chosen rate {rate:g} req/s ({RATE_FRACTION:g}x)")
    b.sweep.append({**cap_row, "fraction": float("inf")})
    b.emit([{**cap_row, "capacity_req_s": capacity}])
    r = dataclasses.replace(cfg, dist=dist, rate=rate)
    tag = f"{dist} @ {rate:g} req/s"
    log(f"== {tag}")
    trace = sr.make_trace(r, cfg.adapters)
    rep = sr.Report(r, [], {}, adapter_ranks=b.engine.ranks)
    for policy in sr.POLICIES:
        row, res = b.run(r, trace, policy, tag)
        rep.results[policy] = res
        rep.rows.append(row)
        b.sweep.append({**row, "fraction": RATE_FRACTION})
    b.plots[dist] = plot_data(rep)
    name = "serving_timeline_" + "".join(ch for ch in dist if ch.isalnum()) + ".png"
    try:
        plot(b.plots[dist], str(b.out_dir / name))
        log(f"  picture: {b.out_dir / name}")
    except Exception as e:  # noqa: BLE001 (matplotlib missing)
        log(f"  no picture: {e}")
    b.md += [f"### {dist}", "", f"Capacity: blocking with all {cfg.requests} requests queued at t = 0 served "
             f"{capacity:.1f} req/s (GPU busy {cap_row['gpu_util']:.0%}, stalled on loads "
             f"{cap_row['stall_share']:.0%}). Chosen rate {RATE_FRACTION:g}x that: **{rate:g} req/s**.", ""]
    b.md += table(rep.rows) + [""]
    b.emit(rep.rows)
    return {"dist": dist, "capacity": capacity}


def sweep(b: Bench, cfg, done: list[dict]) -> None:
    skipped = []
    for frac, policy in SWEEP:
        for d in done:
            where = "all at t = 0" if frac == float("inf") else f"{frac:g}x"
            if b.elapsed() > b.args.budget_s:
                log(f"  sweep: skipping {policy} at {where} ({d['dist']}): {b.elapsed():.0f} s of the "
                    f"{b.args.budget_s:g} s budget used")
                skipped.append(f"{policy} at {where} ({d['dist']})")
                continue
            rate = float("inf") if frac == float("inf") else round(frac * d["capacity"], 2)
            r = dataclasses.replace(cfg, dist=d["dist"], rate=rate)
            log(f"== sweep {d['dist']} {fmt_rate(rate)}")
            row, _ = b.run(r, sr.make_trace(r, cfg.adapters), policy, f"{d['dist']} sweep")
            b.sweep.append({**row, "fraction": frac})
            b.emit([row])
    rows = sorted(b.sweep, key=lambda x: (x["dist"], x["fraction"], sr.POLICIES.index(x["policy"])))
    b.md += ["### Rate sweep: GPU busy against offered rate", "",
             "Rates as a fraction of blocking's capacity (\"all at t = 0\": every request queued at once). GPU busy = "
             "step time / makespan; stalled = time the GPU waited for loads / makespan.", "",
             "| popularity | rate | policy | GPU busy | GPU stalled | TTFT p50 ms | E2E p50 ms | tokens/s |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for x in rows:
        where = "all at t = 0" if x["fraction"] == float("inf") else f"{x['fraction']:g}x = {x['rate']:g} req/s"
        b.md.append(f"| {x['dist']} | {where} | {x['policy']} | {x['gpu_util']:.0%} | {x['stall_share']:.0%} | "
                    f"{x['ttft_p50_ms']:.1f} | {x['e2e_p50_ms']:.1f} | {x['tokens_per_s']:.0f} |")
    b.md.append("")
    if skipped:
        b.md += [f"Not run (--budget-s {b.args.budget_s:g} reached): {'; '.join(skipped)}.", ""]


def main() -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--requests", type=int, default=int(os.environ.get("BENCH_SERVING_REQUESTS", 100)))
    p.add_argument("--budget-s", type=float, default=float(os.environ.get("BENCH_SERVING_BUDGET_S", 120)),
                   help="skip the remaining sweep runs once this many seconds have passed since the start")
    p.add_argument("--host-budget", default=os.environ.get("BENCH_SERVING_HOST_BUDGET", "25%"),
                   help="host memory for packed adapters: all, P%% of the adapters' bytes, or a size like 1GB")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dists", default="zipf:1.5,distinct")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks this script, not a result")
    args = p.parse_args()
    t_start = time.perf_counter()
    if args.quick:
        args.requests, args.layers = 60, 2
    if args.smoke:
        args.requests = min(args.requests, 40)
    elif not torch.cuda.is_available():
        print("bench_serving.py needs a CUDA device (--smoke runs it on the CPU)", file=sys.stderr)
        return 1
    cfg = sr.validate(base_config(args))
    m = common.meta()
    h2d = common.h2d_bandwidth_gbs() if cfg.device.startswith("cuda") else float("nan")
    log(f"device {m['device']}, torch {m['torch']}, triton {m['triton']}, backend {cfg.backend}; pinned H2D "
        f"{h2d:.1f} GB/s; host budget {cfg.host_budget}")
    t = time.perf_counter()
    paths = sr.adapter_folders(cfg)
    t_gen = time.perf_counter() - t
    engine = sr.make_engine(cfg, paths)
    host = sr.host_info(engine)
    log(f"adapters ready in {t_gen:.1f} s (folders) + {time.perf_counter() - t - t_gen:.1f} s (engine: read, pack, "
        f"weights); ranks {sorted(set(engine.ranks))}; host memory {host}")
    threads = torch.get_num_threads()
    if not cfg.device.startswith("cuda"):
        torch.set_num_threads(1)  # as run_sim does on the CPU
    b = Bench(args, engine, t_start)
    try:
        engine.record = None
        simulate(sr.make_trace(dataclasses.replace(cfg, requests=8, rate=float("inf")), cfg.adapters),
                 sr.scheduler_config(cfg, "blocking"), engine)  # warm-up: compile, allocate
        spec = cfg.spec()
        budget = ("all adapters" if host["budget_mb"] is None else
                  f"{host['budget_mb']:.0f} MB of the adapters' {host['adapters_mb']:.0f} MB (`--host-budget "
                  f"{cfg.host_budget}`, ~{host['budget_adapters']:.1f} adapters of mean size)")
        b.md += [f"{m['device']}, torch {m['torch']}, Triton {m['triton']}, backend `{cfg.backend}`, {m['date']}, "
                 f"commit {m['commit']}; pinned H2D {h2d:.1f} GB/s. Model: {cfg.model} linear dims x {spec.layers} "
                 f"layers, {cfg.dtype}; {cfg.adapters} adapters (ranks {cfg.ranks}) over {cfg.slots} slots; host "
                 f"memory for packed adapters: {budget}, LRU, the rest read from their folders on demand; "
                 f"{cfg.requests} requests, prompts {cfg.input_len}, outputs {cfg.output_len}; chunk {cfg.chunk}, <= "
                 f"{cfg.max_running} requests / {cfg.max_batch_tokens} rows per step; max_prefetch {cfg.max_prefetch}.",
                 ""]
        b.emit([{"scenario": "setup", "h2d_gbs": h2d, "folders_s": t_gen, "backend": cfg.backend, **host}])
        status, done = 0, []
        steps = [("correctness", lambda: correctness(b, cfg))]
        steps += [(d, lambda d=d: done.append(scenario(b, cfg, d))) for d in args.dists.split(",")]
        steps += [("sweep", lambda: sweep(b, cfg, done))]
        for name, step in steps:
            try:
                step()
            except Exception:  # keep what the other scenarios measure
                traceback.print_exc()
                b.md += [f"({name} failed: see the log)", ""]
                status = 1
            log(f"-- {name} done at {b.elapsed():.0f} s")
        host_ms, copy_ms = b.engine.medians_ms(b.engine.host), b.engine.medians_ms(b.engine.copy)
        log(f"median host stage (folder read + pack) ms by rank {host_ms}; median copy ms by rank {copy_ms}")
        b.md += [f"Median measured stage times by rank, over every load of these runs: host stage (folder read + "
                 f"parse + pack into pinned memory, worker wall time) {host_ms} ms; H2D copy {copy_ms} ms.", ""]
        b.emit([{"scenario": "stage times", "host_stage_ms_by_rank": host_ms, "copy_ms_by_rank": copy_ms}])
        b.save()
    finally:
        torch.set_num_threads(threads)
        engine.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
