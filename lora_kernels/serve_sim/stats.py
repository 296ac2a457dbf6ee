"""Statistics over trace seeds: each policy against the oracle and against blocking, median and 95% CI.

Every (popularity, load, seed) run replays one trace under every policy. Per run and policy:
    ttft_p50_x, ttft_p99_x, e2e_p50_x    the policy's TTFT p50 / p99 and E2E p50 over the oracle's (1.0 = the
                                         ceiling of what hiding loads can give; the oracle's own run is 1.0)
    ttft_p50_red, e2e_p50_red            1 - policy / blocking (the reduction against blocking)
Per (popularity, load, policy), over the seeds: the median, and a 95% percentile-bootstrap CI of the
median (resampling the seeds with replacement, a fixed RNG seed, numpy only). Ratios, not reductions, are
what the targets are stated in: the oracle's own reduction against blocking varies with the trace.
"""

from __future__ import annotations

import math

import numpy as np

RATIOS = (("ttft_p50_x", "ttft_p50_ms"), ("ttft_p99_x", "ttft_p99_ms"), ("e2e_p50_x", "e2e_p50_ms"))
REDUCTIONS = (("ttft_p50_red", "ttft_p50_ms"), ("e2e_p50_red", "e2e_p50_ms"))
METRICS = tuple(k for k, _ in RATIOS + REDUCTIONS)
BOOT_SEED = 20261123


def per_run(rows: list[dict]) -> list[dict]:
    """One entry per run row (needs keys dist, load, seed, policy and the summary's ms figures), with the
    ratios to the oracle's and the reductions against blocking of the same (dist, load, seed); NaN where
    that run has no oracle or no blocking."""
    by = {(r["dist"], r["load"], r["seed"], r["policy"]): r for r in rows}
    out = []
    for r in rows:
        key = (r["dist"], r["load"], r["seed"])
        oracle, blocking = by.get(key + ("oracle",)), by.get(key + ("blocking",))
        e = {"dist": r["dist"], "load": r["load"], "seed": r["seed"], "policy": r["policy"]}
        for name, src in RATIOS:
            e[name] = r[src] / oracle[src] if oracle and oracle[src] > 0 else math.nan
        for name, src in REDUCTIONS:
            e[name] = 1 - r[src] / blocking[src] if blocking and blocking[src] > 0 else math.nan
        out.append(e)
    return out


def bootstrap_ci(values, level: float = 0.95, n_boot: int = 4000, seed: int = BOOT_SEED) -> tuple[float, float, float]:
    """(median, lower, upper): the median of `values` and the percentile-bootstrap CI of the median."""
    v = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
    if v.size == 0:
        return math.nan, math.nan, math.nan
    med = float(np.median(v))
    if v.size == 1:
        return med, med, med
    rng = np.random.default_rng(seed)
    boots = np.median(v[rng.integers(0, v.size, (n_boot, v.size))], axis=1)
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(boots, [tail, 100 - tail])
    return med, float(lo), float(hi)


def summarize_runs(rows: list[dict]) -> list[dict]:
    """Per (dist, load, policy), in first-seen order: n seeds, and per metric {median, lo, hi}; also the
    median TTFT p50 and E2E p50 in ms."""
    groups: dict = {}
    for e, r in zip(per_run(rows), rows):
        groups.setdefault((e["dist"], e["load"], e["policy"]), []).append((e, r))
    out = []
    for (dist, load, policy), items in groups.items():
        s = {"dist": dist, "load": load, "policy": policy, "seeds": len(items),
             "rate": float(np.median([r["rate"] for _, r in items]))}
        for m in METRICS:
            med, lo, hi = bootstrap_ci([e[m] for e, _ in items])
            s[m] = {"median": med, "lo": lo, "hi": hi}
        for k in ("ttft_p50_ms", "e2e_p50_ms"):
            s[k] = float(np.median([r[k] for _, r in items]))
        out.append(s)
    return out


def _ci(x: dict, pct: bool = False) -> str:
    if math.isnan(x["median"]):
        return "-"
    if pct:
        return f"{-100 * x['median']:+.0f}% [{-100 * x['hi']:+.0f}, {-100 * x['lo']:+.0f}]"
    return f"{x['median']:.3f} [{x['lo']:.3f}, {x['hi']:.3f}]"


HEADER = ("load", "policy", "TTFT p50 ms", "TTFT p50 x oracle", "TTFT p99 x oracle", "E2E p50 x oracle",
          "TTFT p50 vs blocking", "E2E p50 vs blocking")


def stats_cells(s: dict) -> list[str]:
    load = "-" if s["load"] is None else f"{s['load']:g}"
    ratios = ["1 (ref)"] * 3 if s["policy"] == "oracle" else [_ci(s[k]) for k, _ in RATIOS]
    reds = ["0 (ref)"] * 2 if s["policy"] == "blocking" else [_ci(s[k], True) for k, _ in REDUCTIONS]
    return [f"{load} ({s['rate']:.3g}/s)", s["policy"], f"{s['ttft_p50_ms']:.1f}", *ratios, *reds]


def format_stats(stats: list[dict], dist: str) -> str:
    """The text table of one popularity: median [95% CI] over seeds; reductions as changes (-50% = halved)."""
    cells = [list(HEADER)] + [stats_cells(s) for s in stats if s["dist"] == dist]
    widths = [max(len(row[i]) for row in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def markdown_stats(stats: list[dict], dist: str) -> list[str]:
    out = ["| " + " | ".join(HEADER) + " |", "|---|---|" + "---:|" * (len(HEADER) - 2)]
    return out + ["| " + " | ".join(stats_cells(s)) + " |" for s in stats if s["dist"] == dist]
