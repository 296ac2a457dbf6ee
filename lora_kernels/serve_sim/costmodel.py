"""A cost model fitted to measured steps and loads, used only to choose the request rate of a benchmark.

bench/bench_serving.py runs the blocking policy once for real with every request queued at t = 0,
fits step time ≈ a + b·rows + c·(sum of the batch's distinct adapter ranks) and a copy time per
adapter to what it measured, and replays traces through the same scheduler with those costs (a
fraction of a second per trace) to find the request rate at which blocking's median TTFT reaches
`knee` times its unloaded value: the rate at which the GPU is busy. The reported figures always come
from real runs at that rate, never from this model.
"""

from __future__ import annotations

import numpy as np

from lora_kernels.serve_sim.metrics import summarize
from lora_kernels.serve_sim.scheduler import SchedulerConfig, StepPlan
from lora_kernels.serve_sim.sim import StepTiming, simulate


def _features(plan: StepPlan, ranks) -> list[float]:
    distinct = {r.adapter for r, _ in plan.batch if r.adapter is not None}
    return [1.0, float(plan.num_tokens), float(sum(ranks[a] for a in distinct))]


class MeasuringEngine:
    """Wraps an engine and keeps (features, measured time) of every step and the measured time of every load."""

    def __init__(self, engine, ranks):
        self.engine, self.ranks = engine, ranks
        self.steps: list[tuple[list[float], float]] = []
        self.loads: dict[int, list[float]] = {}

    def reset(self):
        self.engine.reset()

    def issue_load(self, adapter, victim):
        return adapter, self.engine.issue_load(adapter, victim)

    def load_seconds(self, handle):
        adapter, h = handle
        s = self.engine.load_seconds(h)
        self.loads.setdefault(adapter, []).append(s)
        return s

    def run_step(self, plan: StepPlan) -> StepTiming:
        t = self.engine.run_step(plan)
        self.steps.append((_features(plan, self.ranks), t.compute_s))
        return t

    def fit(self) -> "CostModelEngine":
        x = np.array([f for f, _ in self.steps])
        y = np.array([t for _, t in self.steps])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        by_rank: dict[int, list[float]] = {}
        for a, ts in self.loads.items():
            by_rank.setdefault(self.ranks[a], []).extend(ts)
        per_rank = {r: float(np.median(ts)) for r, ts in by_rank.items()}
        return CostModelEngine(coef.tolist(), self.ranks, per_rank)


class CostModelEngine:
    """Engine protocol with modelled costs (no tensors): for choosing rates, not for results."""

    def __init__(self, coef, ranks, load_s_by_rank: dict[int, float]):
        self.coef, self.ranks = list(coef), ranks
        known = sorted(load_s_by_rank.items())
        if not known:
            raise ValueError("the calibration run measured no load")
        # Copy time is linear in bytes, i.e. in rank: ranks never measured are interpolated.
        rs, ts = zip(*known)
        self.load_s = {r: float(np.interp(r, rs, ts)) if len(rs) > 1 else ts[0] * r / rs[0] for r in set(ranks)}

    def reset(self):
        pass

    def issue_load(self, adapter, victim):
        return adapter

    def load_seconds(self, adapter):
        return self.load_s[self.ranks[adapter]]

    def run_step(self, plan: StepPlan) -> StepTiming:
        return StepTiming(max(float(np.dot(self.coef, _features(plan, self.ranks))), 1e-6), 0.0)


def knee_rate(make_trace, cfg: SchedulerConfig, model: CostModelEngine, capacity: float, knee: float = 3.0,
              iters: int = 12) -> tuple[float, dict]:
    """The rate (req/s) at which the modelled blocking median TTFT reaches `knee` times its value at 2% of
    `capacity`, by bisection over [2%, 200%] of capacity (a trace's arrivals scale with 1/rate, so TTFT
    grows with the rate). Returns (rate, {"unloaded_ttft_p50_ms", "curve": {rate: modelled TTFT p50 ms}})."""

    def ttft(rate):
        return summarize(simulate(make_trace(rate), cfg, model))["ttft_p50_ms"]

    light = ttft(0.02 * capacity)
    lo, hi = 0.02 * capacity, 2.0 * capacity
    curve = {}
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        curve[mid] = ttft(mid)
        lo, hi = (mid, hi) if curve[mid] <= knee * light else (lo, mid)
    return lo, {"unloaded_ttft_p50_ms": light, "curve": dict(sorted(curve.items()))}
