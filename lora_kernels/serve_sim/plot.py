"""The serve-sim picture: per policy, a timeline of the compute stream, the copy engine and the host-stage
worker over one window of the run, and the CDFs of TTFT and E2E latency. matplotlib is imported only here."""

from __future__ import annotations

import numpy as np

COLORS = {"prefill": "#3b6fb6", "decode": "#9cc3e6", "stall": "#d62728", "load": "#f0a030", "read": "#7f7f7f"}
LANES = (("compute", "GPU"), ("copy", "copy"), ("host", "host read"))  # top to bottom within a policy


def plot_data(report) -> dict:
    """What the picture needs from a `run.Report`, as plain JSON-able data (bench results are re-plotted from it)."""
    c = report.config
    title = (f"{c.model} x{c.spec().layers} layers, {len(report.adapter_ranks)} adapters over {c.slots} slots, "
             f"{c.dist}, {c.rate:g} req/s ({c.device}, {c.backend})")
    return {"title": title, "policies": {
        name: {"timeline": [list(t) for t in res.timeline],
               "ttft_ms": [1e3 * (r.first_token_at - r.req.arrival) for r in res.requests],
               "e2e_ms": [1e3 * (r.finished_at - r.req.arrival) for r in res.requests]}
        for name, res in report.results.items()}}


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


def plot_report(report, path: str) -> None:
    plot(plot_data(report), path)


def plot(data: dict, path: str) -> None:
    """Writes the picture of `plot_data(...)` output to `path`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError as e:
        raise ImportError(f"--plot needs matplotlib (pip install matplotlib): {e}") from None
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
