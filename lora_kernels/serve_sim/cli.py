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
    p = sub.add_parser("serve-sim", help="replay a multi-LoRA serving trace under three adapter-loading policies",
                       description="Replays a serving trace (Poisson arrivals, chunked prefill + decode, N adapters "
                                   "over a few GPU slots) through the real kernels, batch-info builder and adapter "
                                   "loader under the policies blocking, overlap and overlap+prefetch.")
    p.error = lambda message: _fail(message)  # one line, exit 2 (argparse would add a usage block)
    a = p.add_argument
    a("--model", default=d.model, help="tiny (default, CPU-sized), llama3-8b, llama2-7b, mistral-7b")
    a("--layers", type=int, default=d.layers, help="decoder layers (default: the model's)")
    a("--adapters", type=int, default=d.adapters, help="number of adapters (PEFT folders)")
    a("--slots", type=int, default=d.slots, help="GPU adapter slots")
    a("--ranks", default=d.ranks, help="adapter ranks, cycled over the adapters (e.g. 8,16,32,64)")
    a("--max-rank", type=int, default=None, help="pool max rank (default: the largest rank)")
    a("--rate", type=float, default=d.rate, help="requests per second (Poisson)")
    a("--requests", type=int, default=d.requests)
    a("--dist", default=d.dist, help="adapter popularity: uniform, zipf:A, distinct, bursty[:B], none")
    a("--input-len", default=d.input_len, help="prompt length N or LO:HI (uniform)")
    a("--output-len", default=d.output_len, help="output length N or LO:HI (uniform)")
    a("--chunk", type=int, default=d.chunk, help="prefill chunk (tokens)")
    a("--max-running", type=int, default=d.max_running, help="requests in a batch at most")
    a("--max-batch-tokens", type=int, default=d.max_batch_tokens, help="rows of a step at most")
    a("--max-prefetch", type=int, default=d.max_prefetch, help="loads in flight at most (prefetch)")
    a("--lookahead", type=int, default=None, help="waiting requests the prefetcher looks at (default: all)")
    a("--host-budget", default=d.host_budget,
      help="host memory for packed adapters: all, P%% of the adapters' bytes, or a size like 512MB; the other "
           "adapters live only in their PEFT folders and are read on demand (default "
           + d.host_budget.replace("%", "%%") + ")")
    a("--policy", default="all", help=f"all, or a comma list of {', '.join(POLICIES)}")
    a("--dtype", default=None, help="fp16, bf16, fp32 (default: bf16 on CUDA, fp32 on CPU)")
    a("--device", default=None, help="cpu or cuda (default: cuda when available)")
    a("--backend", default=None, help="auto, cuda, triton, torch (default: LORA_KERNELS_BACKEND or auto)")
    a("--adapter-dir", default=None, help="use the PEFT folders in this directory instead of generated ones")
    a("--cache-dir", default=None, help="where generated adapters are kept (default: ~/.cache/lora_kernels)")
    a("--seed", type=int, default=d.seed)
    a("--no-check", action="store_true", help="skip recording and comparing outputs across policies")
    a("--json", action="store_true", help="print one JSON object instead of the table")
    a("--plot", default=None, metavar="OUT.png", help="write a timeline + TTFT CDF picture (matplotlib)")
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
                     max_rank=args.max_rank, rate=args.rate, requests=args.requests, dist=args.dist,
                     input_len=args.input_len, output_len=args.output_len, chunk=args.chunk,
                     max_running=args.max_running, max_batch_tokens=args.max_batch_tokens,
                     max_prefetch=args.max_prefetch, lookahead=args.lookahead, host_budget=args.host_budget,
                     policies=policies, dtype=args.dtype,
                     device=args.device, backend=args.backend, adapter_dir=args.adapter_dir,
                     cache_dir=args.cache_dir, seed=args.seed, check=not args.no_check)


def _print_report(rep) -> None:
    from lora_kernels.serve_sim.metrics import compare, format_table

    c = rep.config
    spec = c.spec()
    print(f"model {c.model} ({spec.layers} layers, hidden {spec.hidden}), {c.dtype} on {c.device}, backend "
          f"{c.backend}; {len(rep.adapter_ranks)} adapters (ranks {sorted(set(rep.adapter_ranks))}) over "
          f"{c.slots} slots (max rank {c.max_rank})")
    print(f"trace: {c.requests} requests at {c.rate:g}/s, {c.dist}, prompt {c.input_len}, output {c.output_len}; "
          f"chunk {c.chunk}, <= {c.max_running} requests / {c.max_batch_tokens} rows per step")
    h = rep.host
    if h.get("budget_mb") is None:
        print(f"host memory: all {h.get('adapters_mb', 0):.1f} MB of packed adapters (a load is a copy only)")
    else:
        print(f"host memory: {h['budget_mb']:.1f} MB of {h['adapters_mb']:.1f} MB of packed adapters (--host-budget "
              f"{c.host_budget}, ~{h['budget_adapters']:.1f} adapters, LRU); the others are read from their PEFT "
              f"folders on demand")
    print("clock: simulated, advanced by each step's measured time ("
          + ("CUDA events" if c.device.startswith("cuda") else "CPU time")
          + "); a load = host stage (folder read + pack, wall time on the worker thread, one worker) then copy ("
          + ("CUDA events" if c.device.startswith("cuda") else "CPU time")
          + ", one copy engine); host prep is measured apart\n")
    print(format_table(rep.rows))
    for name, v in compare(rep.rows).items():
        print(f"{name} vs blocking: TTFT p50 {-100 * v['ttft_p50_reduction']:+.0f}%, E2E p50 "
              f"{-100 * v['e2e_p50_reduction']:+.0f}%, tokens/s {100 * (v['tokens_per_s_ratio'] - 1):+.1f}%")
    for b, chk in rep.check.items():
        verdict = "identical" if chk["identical"] else (f"DIFFER for {chk['mismatched_requests']} requests "
                                                        f"(max rel diff {chk['max_rel_diff']:.1e})")
        print(f"layer-0 LoRA outputs of every request across policies ({b} backend, "
              f"{chk['positions_compared']} positions): {verdict}")
    if not c.device.startswith("cuda"):
        print("note: CPU times of a small model, not GPU figures; the GPU scenario is bench/bench_serving.py")
    unfed = {k: v for k, v in rep.unfed_steps.items() if v}
    if unfed:
        print(f"note: steps timed while the host was still queueing (may include launch gaps): {unfed}")


def serve_sim(args) -> int:
    try:
        from lora_kernels.serve_sim.run import Progress, run_sim

        rep = run_sim(_config(args), Progress(enabled=not args.no_progress))
        if args.plot:
            from lora_kernels.serve_sim.plot import plot_report

            plot_report(rep, args.plot)
    except (ValueError, KeyError, OSError, RuntimeError, ImportError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        _fail(str(msg))
    if args.json:
        print(json.dumps(rep.to_json(), indent=1, default=str))
    else:
        _print_report(rep)
        if args.plot:
            print(f"picture: {args.plot}")
    return 0 if all(c["identical"] for c in rep.check.values() if c["backend"] == "torch") else 1
