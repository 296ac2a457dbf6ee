"""The serve-sim pictures. `plot_stats`: each policy's TTFT p50 / p99 and E2E p50 over the oracle's, and its
reductions against blocking, against the load level, median over seeds with 95% CI bands, one column per
popularity. `plot`: per policy, a timeline of the compute stream, the copy engine and the host-stage workers
over one window of one run, and the CDFs of TTFT and E2E latency. matplotlib is imported only here."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

POLICY_COLORS = {"blocking": "#d62728", "overlap": "#1f77b4", "overlap+prefetch": "#2ca02c", "oracle": "#555555"}
PANELS = (("ttft_p50_x", "TTFT p50 / oracle's"), ("ttft_p99_x", "TTFT p99 / oracle's"),
          ("e2e_p50_x", "E2E p50 / oracle's"), ("ttft_p50_red", "TTFT p50 change vs blocking"),
          ("e2e_p50_red", "E2E p50 change vs blocking"))

COLORS = {"prefill": "#3b6fb6", "decode": "#9cc3e6", "stall": "#d62728", "load": "#f0a030", "read": "#7f7f7f"}
LANES = (("compute", "GPU"), ("copy", "copy"), ("host", "host stages"))  # top to bottom within a policy


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"--plot needs matplotlib (pip install matplotlib): {e}") from None
    return matplotlib, plt


def plot_data(report, dist: str) -> dict:
    """What the timeline picture needs from a `run.Report` (the run of `dist` it kept), as plain JSON-able data
    (bench results are re-plotted from it)."""
    c = report.config
    results = report.results[dist]
    w = report.shown[dist]
    load = "" if w["load"] is None else f"load {w['load']:g} = "
    title = (f"{c.model} x{c.spec().layers} layers, {len(report.adapter_ranks)} adapters over {c.slots} slots, "
             f"{dist}, {load}{w['rate']:.3g} req/s, seed {w['seed']} ({c.device}, {c.backend})")
    return {"title": title, "policies": {
        name: {"timeline": [list(t) for t in res.timeline],
               "ttft_ms": [1e3 * (r.first_token_at - r.req.arrival) for r in res.requests],
               "e2e_ms": [1e3 * (r.finished_at - r.req.arrival) for r in res.requests]}
        for name, res in results.items()}}


def plot_stats(stats: list[dict], path: str, title: str = "") -> None:
    """Writes the load plot of `stats.summarize_runs(...)` output to `path`."""
    _, plt = _pyplot()
    dists = list(dict.fromkeys(s["dist"] for s in stats))
    fig, axes = plt.subplots(len(PANELS), len(dists), figsize=(5.5 * len(dists), 2.6 * len(PANELS)), squeeze=False)
    for j, dist in enumerate(dists):
        rows = [s for s in stats if s["dist"] == dist and s["load"] is not None and math.isfinite(s["load"])]
        for i, (key, label) in enumerate(PANELS):
            ax = axes[i][j]
            for policy in dict.fromkeys(s["policy"] for s in rows):
                pts = sorted((s["load"], s[key]) for s in rows if s["policy"] == policy)
                if policy == "oracle" and key.endswith("_x") or policy == "blocking" and key.endswith("_red"):
                    continue  # 1.0 / 0 by definition
                x = [p for p, _ in pts]
                scale = -100 if key.endswith("_red") else 1  # reductions shown as changes in %
                med = [scale * v["median"] for _, v in pts]
                lo = [scale * v["lo"] for _, v in pts]
                hi = [scale * v["hi"] for _, v in pts]
                color = POLICY_COLORS.get(policy)
                ax.plot(x, med, "o-", color=color, label=policy, markersize=4)
                ax.fill_between(x, lo, hi, color=color, alpha=0.2, linewidth=0)
            if key.endswith("_x"):
                ax.axhline(1.0, color="#555555", linewidth=0.8, linestyle="--")
            ax.set_ylabel(label + (" (%)" if key.endswith("_red") else ""), fontsize=8)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(dist, fontsize=10)
            if i in (0, 3):  # the policies drawn differ: ratios omit the oracle, changes omit blocking
                ax.legend(fontsize=7)
            if i == len(PANELS) - 1:
                ax.set_xlabel("load (fraction of blocking's capacity)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_report(report, path: str) -> list[str]:
    """The load plot at `path` and one timeline picture per popularity beside it; returns the paths written."""
    c = report.config
    stats = report.stats
    seeds = min((s["seeds"] for s in stats), default=0)  # those run (a time budget can end the grid early)
    title = (f"{c.model} x{c.spec().layers} layers, {len(report.adapter_ranks)} adapters over {c.slots} slots; "
             f"median and 95% CI over {seeds} seeds ({c.device}, {c.backend})")
    plot_stats(stats, path, title)
    written = [path]
    stem = Path(path)
    for dist in report.results:
        out = str(stem.with_name(f"{stem.stem}_timeline_{''.join(ch for ch in dist if ch.isalnum())}{stem.suffix}"))
        plot(plot_data(report, dist), out)
        written.append(out)
    return written


def _window(timeline, steps: int = 40) -> tuple[float, float]:
    """A window of about `steps` steps starting at the first in-step stall after a quarter of the run
    (else at a quarter of the run)."""
    comp = [(s, e) for lane, s, e, k in timeline if lane == "compute" and k != "stall"]
    if not comp:
        return 0.0, 1.0
    t_end = max(e for _, e in comp)
    t0 = 0.25 * t_end
    stalls = [s for lane, s, e, k in timeline if lane == "compute" and k == "stall" and s >= t0]
    start = stalls[0] if stalls else t0
    width = steps * float(np.median([e - s for s, e in comp]))
    return max(start - 0.1 * width, 0.0), start + 0.9 * width


def plot(data: dict, path: str) -> None:
    """Writes the picture of `plot_data(...)` output to `path`."""
    matplotlib, plt = _pyplot()
    import matplotlib.ticker

    runs = data["policies"]
    policies = list(runs)
    fig = plt.figure(figsize=(12, 3 + 1.5 * len(policies)))
    grid = fig.add_gridspec(2, 2, height_ratios=[1.5 * len(policies), 3])
    ax_t = fig.add_subplot(grid[0, :])
    lo, hi = _window(runs.get("blocking", runs[policies[0]])["timeline"])
    ticks, labels = [], []
    lanes = [(lane, label) for lane, label in LANES
             if any(t[0] == lane for run in runs.values() for t in run["timeline"])]
    for i, name in enumerate(policies):
        y = (len(policies) - 1 - i) * (len(lanes) + 1)
        for dy, (lane, lane_label) in zip(range(len(lanes) - 1, -1, -1), lanes):
            for kind in COLORS:
                bars = [(s, e - s) for ln, s, e, k in runs[name]["timeline"]
                        if ln == lane and k == kind and e > lo and s < hi]
                if bars:
                    ax_t.broken_barh([(1e3 * s, 1e3 * w) for s, w in bars], (y + dy, 0.8), color=COLORS[kind],
                                     edgecolor="white", linewidth=0.3)
            ticks.append(y + dy + 0.4)
            labels.append(f"{name}: {lane_label}")
    ax_t.set_yticks(ticks, labels)
    ax_t.set_xlim(1e3 * lo, 1e3 * hi)
    ax_t.set_xlabel("simulated time (ms)")
    ax_t.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()],
                labels=["prefill step", "decode step", "stalled on a load", "adapter copy (H2D)",
                        "host stage (folder read + pack)"], ncol=5,
                loc="upper center", bbox_to_anchor=(0.5, -0.22), fontsize=8, frameon=False)
    ax_t.set_title(data["title"], fontsize=10)
    for j, (key, label) in enumerate((("ttft_ms", "TTFT"), ("e2e_ms", "E2E latency"))):
        ax = fig.add_subplot(grid[1, j])
        for name in policies:
            t = np.sort(runs[name][key])
            ax.step(t, np.arange(1, len(t) + 1) / len(t), where="post", label=name)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decade labels only
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
