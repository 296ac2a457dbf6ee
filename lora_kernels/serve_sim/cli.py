"""The `lora-kernels serve-sim` subcommand: options, the printed report, --json and --plot."""

from __future__ import annotations

import argparse
import json
import sys

from lora_kernels.serve_sim.scheduler import POLICIES


def _defaults():
    from lora_kernels.serve_sim.run import SimConfig

    return SimConfig()


def add_parser(sub) -> argparse.ArgumentParser:
    d = _defaults()
    p = sub.add_parser("serve-sim", help="replay multi-LoRA serving traces under three adapter-loading policies and "
                                         "their oracle",
                       description="Replays serving traces (Poisson arrivals, chunked prefill + decode, N adapters "
                                   "over a few GPU slots) through the real kernels, batch-info builder and adapter "
                                   "loader under the policies blocking, overlap, overlap+prefetch and the oracle "
                                   "(loads run but cost no time), for several trace seeds at several load levels, "
                                   "and reports each policy against the oracle and blocking: median and 95% "
                                   "bootstrap CI over the seeds.")
    p.error = lambda message: _fail(message)  # one line, exit 2 (argparse would add a usage block)
    a = p.add_argument
    a("--model", default=d.model, help="tiny (default, CPU-sized), llama3-8b, llama2-7b, mistral-7b")
    a("--layers", type=int, default=d.layers, help="decoder layers (default: the model's)")
    a("--adapters", type=int, default=d.adapters, help="number of adapters (PEFT folders)")
    a("--slots", type=int, default=d.slots, help="GPU adapter slots")
    a("--ranks", default=d.ranks, help="adapter ranks, cycled over the adapters (e.g. 8,16,32,64)")
    a("--max-rank", type=int, default=None, help="pool max rank (default: the largest rank)")
    a("--loads", default=d.loads, help="load levels: fractions of the measured capacity (blocking's throughput with "
                                       "every request queued at t = 0), comma list (default %(default)s)")
    a("--rate", type=float, default=None, help="one fixed rate in requests/s instead of --loads")
    a("--seeds", type=int, default=d.seeds, help="trace seeds per popularity and load (default %(default)s)")
    a("--requests", type=int, default=d.requests)
    a("--dist", default=d.dist, help="adapter popularity: uniform, zipf:A, distinct, bursty[:B], none; a comma "
                                     "list runs each")
    a("--input-len", default=d.input_len, help="prompt length N or LO:HI (uniform)")
    a("--output-len", default=d.output_len, help="output length N or LO:HI (uniform)")
    a("--chunk", type=int, default=d.chunk, help="prefill chunk (tokens)")
    a("--max-running", type=int, default=d.max_running, help="requests in a batch at most")
    a("--max-batch-tokens", type=int, default=d.max_batch_tokens, help="rows of a step at most")
    a("--max-prefetch", type=int, default=d.max_prefetch, help="loads in flight at most (prefetch)")
    a("--admit-within", type=float, default=d.admit_within,
      help="overlap policies: a waiting request whose load will be usable within this share of the step's "
           "measured lower bound joins the step, which waits for it (0: never)")
    a("--lookahead", type=int, default=None, help="waiting requests the prefetcher looks at (default: all)")
    a("--host-budget", default=d.host_budget,
      help="host memory for packed adapters: all, P%% of the adapters' bytes, or a size like 512MB; the other "
           "adapters live only in their PEFT folders and are read on demand (default "
           + d.host_budget.replace("%", "%%") + ")")
    a("--host-workers", type=int, default=None, help="host-stage threads (default min(4, cores))")
    a("--timed-layers", type=int, default=None,
      help="run and time only this many layers per step, charged x layers/this (default: all layers)")
    a("--policy", default="all", help=f"all, or a comma list of {', '.join(POLICIES)}")
    a("--dtype", default=None, help="fp16, bf16, fp32 (default: bf16 on CUDA, fp32 on CPU)")
    a("--device", default=None, help="cpu or cuda (default: cuda when available)")
    a("--backend", default=None, help="auto, cuda, triton, torch (default: LORA_KERNELS_BACKEND or auto)")
    a("--adapter-dir", default=None, help="use the PEFT folders in this directory instead of generated ones")
    a("--cache-dir", default=None, help="where generated adapters are kept (default: ~/.cache/lora_kernels)")
    a("--seed", type=int, default=d.seed)
    a("--no-check", action="store_true", help="skip recording and comparing outputs across policies")
    a("--check-backends", default="torch",
      help="backends whose outputs are compared across policies, besides the run's (comma list; default torch, "
           "which must be identical; the others' max difference is reported)")
    a("--json", action="store_true", help="print one JSON object instead of the table")
    a("--plot", default=None, metavar="OUT.png",
      help="write the ratios to the oracle against load with CI bands to OUT.png, and a timeline + latency CDF "
           "picture of one run per popularity beside it (matplotlib)")
    a("--tp", type=int, default=1, help="tensor-parallel ranks: start with torchrun --nproc-per-node N; each rank "
                                        "runs its shard of the base layers and adapters, rank 0 prints")
    a("--no-layerwise", action="store_true",
      help="load each adapter whole: a step waits for its adapters' last layer (default: layer by layer)")
    a("--no-progress", action="store_true")
    p.set_defaults(func=serve_sim)
    return p


def _fail(message: str):
    print(f"lora-kernels: error: {message}", file=sys.stderr)
    sys.exit(2)


def _config(args):
    from lora_kernels.serve_sim.run import SimConfig

    policies = POLICIES if args.policy == "all" else tuple(p.strip() for p in args.policy.split(","))
    return SimConfig(model=args.model, layers=args.layers, adapters=args.adapters, slots=args.slots, ranks=args.ranks,
                     max_rank=args.max_rank, rate=args.rate, loads=args.loads, seeds=args.seeds,
                     requests=args.requests, dist=args.dist, host_workers=args.host_workers,
                     timed_layers=args.timed_layers,
                     input_len=args.input_len, output_len=args.output_len, chunk=args.chunk,
                     max_running=args.max_running, max_batch_tokens=args.max_batch_tokens,
                     max_prefetch=args.max_prefetch, lookahead=args.lookahead, admit_within=args.admit_within,
                     host_budget=args.host_budget,
                     policies=policies, dtype=args.dtype,
                     device=args.device, backend=args.backend, adapter_dir=args.adapter_dir,
                     cache_dir=args.cache_dir, seed=args.seed, check=not args.no_check,
                     check_backends=tuple(b.strip() for b in args.check_backends.split(",")), tp=args.tp,
                     layerwise=not args.no_layerwise)


def _print_header(rep) -> None:
    c = rep.config
    spec = c.spec()
    print(f"model {c.model} ({spec.layers} layers, hidden {spec.hidden}), {c.dtype} on {c.device}, backend "
          f"{c.backend}; {len(rep.adapter_ranks)} adapters (ranks {sorted(set(rep.adapter_ranks))}) over "
          f"{c.slots} slots (max rank {c.max_rank})")
    rates = f"{c.rate:g}/s" if c.rate is not None else f"loads {c.loads} x capacity"
    print(f"traces: {c.requests} requests, {c.dist}, {rates}, {c.seeds} seeds from {c.seed}; prompt {c.input_len}, "
          f"output {c.output_len}; chunk {c.chunk}, <= {c.max_running} requests / {c.max_batch_tokens} rows per step")
    h = rep.host
    if h.get("budget_mb") is None:
        print(f"host memory: all {h.get('adapters_mb', 0):.1f} MB of packed adapters (a load is a copy only)")
    else:
        print(f"host memory: {h['budget_mb']:.1f} MB of {h['adapters_mb']:.1f} MB of packed adapters (--host-budget "
              f"{c.host_budget}, ~{h['budget_adapters']:.1f} adapters, LRU); the others are read from their PEFT "
              f"folders on demand")
    if c.tp > 1:
        print(f"tensor parallel: {c.tp} ranks, each with its shard of the base layers and adapters (loads move the "
              f"shard); a step or a load takes its slowest rank's time; the base layers' all-reduces are not run")
    timer = "CUDA events" if c.device.startswith("cuda") else "CPU time"
    print(f"clock: simulated, advanced by each step's measured time ({timer}); a load = host stage (folder read + "
          f"pack, wall time on a worker thread; host workers: {h.get('workers', 1)}) then copy ({timer}, one copy engine); "
          f"the oracle's loads run but take no time; host prep is measured apart")


def _print_report(rep) -> None:
    from lora_kernels.serve_sim.stats import format_stats

    c = rep.config
    _print_header(rep)
    stats = rep.stats
    for dist in c.dist_list():
        cap = rep.capacity.get(dist)
        where = f": capacity {cap['req_s']:.1f} req/s (blocking, all queued at t = 0)" if cap else ""
        print(f"\n{dist}{where}; median [95% bootstrap CI] over seeds")
        print(format_stats(stats, dist))
    for b, chk in rep.check.items():
        verdict = "identical" if chk["identical"] else (f"DIFFER for {chk['mismatched_requests']} requests "
                                                        f"(max rel diff {chk['max_rel_diff']:.1e}, max abs diff "
                                                        f"{chk['max_abs_diff']:.1e})")
        print(f"layer-0 LoRA outputs of every request across policies ({b} backend, "
              f"{chk['positions_compared']} positions): {verdict}")
    if not c.device.startswith("cuda"):
        print("note: CPU times of a small model, not GPU figures; the GPU scenario is bench/bench_serving.py")
    unfed = sum(r.get("unfed_steps", 0) for r in rep.rows)
    if unfed:
        print(f"note: {unfed} steps timed while the host was still queueing (may include launch gaps)")


def serve_sim(args) -> int:
    rank = 0
    try:
        from lora_kernels.serve_sim.run import run_sim

        if args.tp > 1:  # one process per rank under torchrun; the ranks agree on every measured time
            import torch

            from lora_kernels.adapters.tp import init_from_torchrun

            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            rank, _ = init_from_torchrun(args.tp, device)
        rep = run_sim(_config(args), progress=rank == 0 and not (args.no_progress or args.json))
        if rank != 0:  # rank 0 reports
            return 0 if all(c["identical"] for c in rep.check.values() if c["backend"] == "torch") else 1
        if args.plot:
            from lora_kernels.serve_sim.plot import plot_report

            written = plot_report(rep, args.plot)
    except (ValueError, KeyError, OSError, RuntimeError, ImportError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        _fail(str(msg))
    if args.json:
        print(json.dumps(rep.to_json(), indent=1, default=str))
    else:
        _print_report(rep)
        if args.plot:
            print(f"pictures: {', '.join(written)}")
    # Outputs must be identical across policies with the torch backend (its result never depends on the batch).
    return 0 if all(c["identical"] for c in rep.check.values() if c["backend"] == "torch") else 1
