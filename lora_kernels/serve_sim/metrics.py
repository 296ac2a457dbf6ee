"""Per-run figures from a `SimResult` (stats.py aggregates them over seeds)."""

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
