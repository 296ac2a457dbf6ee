"""Per-policy figures from a `SimResult`, and the text table the CLI prints."""

from __future__ import annotations

import numpy as np

from lora_kernels.serve_sim.sim import SimResult


def _pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def summarize(res: SimResult) -> dict:
    """TTFT / E2E percentiles (ms), throughput, loads, stall and host-prep figures of one policy's run."""
    reqs = res.requests
    ttft = [r.first_token_at - r.req.arrival for r in reqs]
    e2e = [r.finished_at - r.req.arrival for r in reqs]
    out_tokens = sum(r.req.output_len for r in reqs)
    span = res.makespan
    return {
        "policy": res.policy,
        "requests": len(reqs),
        "ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p99_ms": 1e3 * _pct(ttft, 99),
        "e2e_p50_ms": 1e3 * _pct(e2e, 50), "e2e_p99_ms": 1e3 * _pct(e2e, 99),
        "tokens_per_s": out_tokens / span if span > 0 else float("nan"),  # output tokens
        "rows_per_s": res.tokens / span if span > 0 else float("nan"),  # prompt + decode rows
        "makespan_s": span,
        "loads": res.loads, "evictions": res.evictions,
        "host_reads": res.host_reads, "host_read_ms": 1e3 * res.host_read_s, "staged": res.staged,
        "stall_ms": 1e3 * res.stall_s,
        "busy_ms": 1e3 * res.busy_s,
        "gpu_util": res.busy_s / span if span > 0 else float("nan"),
        "steps": res.steps,
        "host_prep_us_per_step": 1e6 * res.prep_s / max(res.steps, 1),
        "wall_s": res.wall_s,
    }


COLUMNS = [("policy", "policy", "{}"), ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"), ("ttft_p99_ms", "p99", "{:.1f}"),
           ("e2e_p50_ms", "E2E p50 ms", "{:.1f}"), ("e2e_p99_ms", "p99", "{:.1f}"),
           ("tokens_per_s", "tok/s", "{:.0f}"), ("loads", "loads", "{}"), ("host_reads", "folder reads", "{}"),
           ("stall_ms", "stalled on loads ms", "{:.1f}"),
           ("gpu_util", "busy", "{:.0%}"), ("host_prep_us_per_step", "host prep us/step", "{:.0f}")]


def format_table(rows: list[dict]) -> str:
    cells = [[h for _, h, _ in COLUMNS]] + [[f.format(r[k]) for k, _, f in COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    return "\n".join(lines)


def compare(rows: list[dict], base: str = "blocking") -> dict[str, dict[str, float]]:
    """Relative change of each policy vs `base`: TTFT/E2E p50 reduction and tokens/s ratio."""
    by = {r["policy"]: r for r in rows}
    if base not in by:
        return {}
    b = by[base]
    out = {}
    for name, r in by.items():
        if name == base:
            continue
        out[name] = {"ttft_p50_reduction": 1 - r["ttft_p50_ms"] / b["ttft_p50_ms"],
                     "e2e_p50_reduction": 1 - r["e2e_p50_ms"] / b["e2e_p50_ms"],
                     "tokens_per_s_ratio": r["tokens_per_s"] / b["tokens_per_s"]}
    return out
