"""The serving-trace replay: a simulated clock driven by measured step, host-stage and copy times.

The clock (documented in bench/RESULTS.md and the CLI output):
- Compute: each step really runs (every base GEMM and `apply_lora` of the model's layers) and the
  clock advances by its measured time: CUDA events around the step's GPU work on a GPU (the host
  queues the whole step before the GPU starts it, so host launch overhead is not counted), the
  thread's CPU time on the CPU. Host batch preparation (scheduling, `BatchInfoBuilder.build`, `acquire`) is measured
  and reported apart, off the clock: it models an engine that prepares step n+1 while step n runs.
- Loads have two stages, each really run and measured, each placed on its own simulated resource:
  the host stage (PEFT folder -> packed host buffer: file read, parse, pack; skipped when the host
  store holds the adapter) on the first free of the engine's `host_workers` host workers, FIFO in
  issue order, charged its wall time measured on the real worker thread; then the H2D copy on one
  copy engine, FIFO in the order the host stages end, charged its measured time (CUDA events on the
  loader's stream; CPU time of the synchronous copy on the CPU). A load issued at t is ready at the
  end of its copy, which starts when both its host stage and the copy engine are done; the scheduler
  sees it ready at the first step boundary after that. A host-only stage (prefetch into host memory)
  occupies a host worker alone; a later load of that adapter starts its copy no earlier than that
  stage's end. Loads are issued at step boundaries, and by overlap+prefetch also at each request's
  arrival (`Scheduler.on_arrival`).
- oracle: scheduled as blocking, its loads really run (same slots, same outputs) but take no simulated
  time and occupy no resource: the ceiling of what hiding loads can give, which every policy is
  reported against.
- blocking: a step that needs a load starts when the load is ready (host stage and copy both in the
  critical path); the wait is "GPU stalled on loads". overlap policies: a step waits only for a load
  the scheduler admitted as usable within `admit_within` of the step (scheduler.py), counted as stalled;
  time the GPU idles while the only runnable requests wait for their adapters is counted as stalled.
- Arrivals follow the trace; when nothing can run the clock jumps to the next arrival or load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from lora_kernels.serve_sim.scheduler import AdapterState, RequestState, Scheduler, SchedulerConfig, StepPlan
from lora_kernels.serve_sim.trace import Request


@dataclass
class StepTiming:
    compute_s: float  # measured time of the step's model work (the clock advances by it)
    prep_s: float  # host batch-preparation time (reported, off the clock)


@dataclass
class LoadTiming:
    host_s: float  # wall time of the host stage this load or stage started (0.0: host memory had the adapter)
    h2d_s: float  # measured copy time (0.0 for a host-only stage)
    cold: bool  # this load or stage read the adapter's folder
    # Layer-wise loads (None: the adapter is one unit): when each layer's host part was done, seconds from the
    # host stage's start (non-decreasing, each <= host_s; None when not cold), and each layer's copy time.
    host_layers: tuple[float, ...] | None = None
    h2d_layers: tuple[float, ...] | None = None


class Engine(Protocol):
    """What the simulator needs from the model + adapter machinery (`engine.ModelEngine`)."""

    def reset(self) -> None: ...  # empty pool and host tier, counters zeroed: every policy starts cold

    def issue_load(self, adapter, victim) -> object: ...  # starts a real load (host stage, copy); a handle

    def issue_stage(self, adapter) -> object: ...  # starts a real host-only stage; a handle

    def load_seconds(self, handle) -> LoadTiming: ...  # measured times of a load or stage (waits for it)

    # optional: `host_workers` (int, default 1), the host-stage threads the engine runs

    def host_resident(self) -> set | None: ...  # adapters in host memory now (None: no host tier)

    def host_budget(self) -> tuple[float, Sequence[int]] | None: ...  # (capacity, bytes per adapter); None: no tier

    def run_step(self, plan: StepPlan) -> StepTiming: ...


@dataclass
class SimResult:
    policy: str
    requests: list[RequestState]
    steps: int = 0
    loads: int = 0
    evictions: int = 0
    host_reads: int = 0  # host stages that read a folder (loads + host-only stages)
    host_read_s: float = 0.0  # their measured wall time
    staged: int = 0  # host-only stages that read a folder (prefetch into host memory)
    stall_s: float = 0.0  # GPU time stalled on loads: in-step waits (blocking) + idle while work waits on loads
    step_stall_s: float = 0.0  # the in-step part alone
    busy_s: float = 0.0
    idle_s: float = 0.0
    prep_s: float = 0.0
    tokens: int = 0  # rows processed (prompt + decode)
    wall_s: float = 0.0
    # (lane, start, end, kind): lane "compute" kind prefill|decode|stall, "copy" kind load, "host" kind read
    timeline: list[tuple[str, float, float, str]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(r.finished_at for r in self.requests) - min(r.req.arrival for r in self.requests)


class _Resources:
    """The simulated host workers and copy engine: where each measured host stage and copy is placed."""

    def __init__(self, engine: Engine, cache: AdapterState, res: SimResult, free: bool):
        self.engine, self.cache, self.res, self.free = engine, cache, res, free
        self.workers = [0.0] * max(1, int(getattr(engine, "host_workers", 1)))  # when each worker is free
        self.copy_free = 0.0
        self.host_done: dict = {}  # adapter -> simulated end of the host stage that last read it
        self.pending: list = []  # (adapter, handle, issue time, is a GPU load) of loads/stages not yet measured

    def issue(self, plan: StepPlan, at: float) -> None:
        for a, v in plan.loads:
            self.pending.append((a, self.engine.issue_load(a, v), at, True))
            self.res.loads += 1
            self.res.evictions += v is not None
        for a in plan.stages:
            self.pending.append((a, self.engine.issue_stage(a), at, False))

    def settle(self) -> None:
        """Measures the pending loads and stages and places them: host stages FIFO in issue order on the
        first free worker, then copies FIFO on the copy engine in the order their host stages end (a
        layer-wise load: its layers' copies back to back, each after its layer's host part). The oracle's
        run really but take no simulated time."""
        res, timed = self.res, [(a, self.engine.load_seconds(h), t, is_load) for a, h, t, is_load in self.pending]
        host_layers: dict = {}  # adapter -> simulated end of each layer's host part, for this round's cold reads
        for a, t, issued, is_load in timed:
            if not t.cold:
                continue
            res.host_reads += 1
            res.host_read_s += t.host_s
            res.staged += not is_load
            k = min(range(len(self.workers)), key=self.workers.__getitem__)
            start = issued if self.free else max(issued, self.workers[k])
            end = start if self.free else start + t.host_s
            self.workers[k] = max(self.workers[k], end)
            self.host_done[a] = end
            if t.host_layers is not None:
                host_layers[a] = [start if self.free else start + x for x in t.host_layers]
            res.timeline.append(("host", start, end, "read"))
        loads = []
        for i, (a, t, issued, is_load) in enumerate(timed):
            if is_load:
                whole = max(issued, self.host_done.get(a, issued))
                layered = t.h2d_layers is not None
                hosts = [max(issued, h) for h in host_layers[a]] if layered and a in host_layers else None
                if layered and hosts is None:
                    hosts = [whole] * len(t.h2d_layers)
                loads.append((hosts[0] if layered else whole, i, a, t, hosts))
        for first, _, a, t, hosts in sorted(loads, key=lambda x: x[:2]):
            spans = [(first, t.h2d_s)] if hosts is None else list(zip(hosts, t.h2d_layers))
            ready = []
            for host_ready, seconds in spans:
                start = host_ready if self.free else max(host_ready, self.copy_free)
                end = start if self.free else start + seconds
                self.copy_free = max(self.copy_free, end)
                ready.append(end)
            self.cache.set_ready(a, ready, self.cache.shortest_step())
            res.timeline.append(("copy", ready[0] - spans[0][1] if not self.free else first, ready[-1], "load"))
        self.pending.clear()
        self.cache.host = self.engine.host_resident()


def simulate(trace: Sequence[Request], cfg: SchedulerConfig, engine: Engine,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Replays `trace` under `cfg.policy` through `engine`; every request runs to completion."""
    engine.reset()
    sched = Scheduler(cfg)
    tier = engine.host_budget()
    cache = AdapterState(cfg.num_slots, *(tier or (None, ())))
    cache.host = engine.host_resident()
    states = [RequestState(r) for r in sorted(trace, key=lambda r: (r.arrival, r.rid))]
    res = SimResult(cfg.policy, states)
    rs = _Resources(engine, cache, res, free=cfg.policy == "oracle")
    now, nxt, done = 0.0, 0, 0
    wall0 = time.perf_counter()
    while done < len(states):
        while nxt < len(states) and states[nxt].req.arrival <= now:
            sched.add(states[nxt])
            t_arrival = states[nxt].req.arrival
            rs.issue(sched.on_arrival(t_arrival, cache), t_arrival)
            nxt += 1
        if rs.pending:  # loads started at arrivals: placed now, so a load ready by `now` is usable now
            rs.settle()
        t0 = time.perf_counter()
        plan = sched.schedule(now, cache)
        res.prep_s += time.perf_counter() - t0
        rs.issue(plan, now)
        if not plan.batch:
            rs.settle()
            waits = [t for a, t in cache.ready_at.items() if t > now]
            nexts = waits + ([states[nxt].req.arrival] if nxt < len(states) else [])
            if not nexts:
                raise RuntimeError(f"scheduler stalled at t={now:.6f}s with {len(sched.waiting)} waiting, "
                                   f"{len(sched.running)} running and nothing in flight")
            t = max(min(nexts), now)
            res.idle_s += t - now
            if plan.waits_on_load:
                res.stall_s += t - now
                res.timeline.append(("compute", now, t, "stall"))
            now = t
            continue
        timing = engine.run_step(plan)
        rs.settle()
        res.prep_s += timing.prep_s
        start = max([now] + [cache.ready_at[r.adapter] for r, _ in plan.batch if r.adapter is not None])
        # A layer-wise load's layer l is read when the step reaches layer l; a late layer holds the step there.
        end = cache.step_end(start, timing.compute_s, {r.adapter for r, _ in plan.batch})
        stall = (start - now) + (end - (start + timing.compute_s))  # exactly 0 when nothing waits
        if stall > 0:
            res.stall_s += stall
            res.step_stall_s += stall
            res.timeline.append(("compute", now, now + stall, "stall"))
            start = now + stall
        cache.observe_step(plan.num_tokens, timing.compute_s)
        prefill = any(r.pos < r.req.prompt_len for r, _ in plan.batch)
        res.timeline.append(("compute", start, end, "prefill" if prefill else "decode"))
        res.busy_s += timing.compute_s
        res.steps += 1
        res.tokens += plan.num_tokens
        done += len(sched.complete(plan, end))
        now = end
        if progress is not None:
            progress(done, len(states))
    res.wall_s = time.perf_counter() - wall0
    return res
