"""Continuous batching with chunked prefill and decode, the three adapter-loading policies and their ceiling.

Each step (decided at simulated time `now`, when the previous step has finished):

1. Running requests: every decoding request adds one token; requests still in prefill add their next
   prompt chunk if it fits the step's token budget. Chunk boundaries are fixed per request (multiples
   of `chunk`), so a request's rows are cut the same way under every policy.
2. Waiting requests, first come first served, join while the running count and token budget allow.
   A request whose adapter is not usable now:
     blocking          its adapter is loaded on demand and the whole step waits for the copy;
     overlap           its adapter is loaded on demand (side stream) and it keeps waiting; requests
                       behind it that are ready go ahead; it joins the first step after the load is
                       ready (the overlap rule, `prefetch.split_ready`), or a step whose start is at
                       most `admit_within` (a share of the step's measured lower bound, default 0.25)
                       before the step could use the load: that step waits for it (a layer-wise load's
                       layers are waited for on the GPU), which costs the step a fraction of itself
                       where the request would otherwise wait a whole step (`AdapterState.ready_soon`);
     overlap+prefetch  as overlap, and adapters of requests further back in the queue are loaded
                       ahead (`prefetch.plan_prefetch`, at most `max_prefetch` loads in flight);
                       with a host tier, the next adapters the queue needs that hold no GPU slot (at
                       most `max_prefetch`, and only as many bytes as host memory holds beside this step's
                       cold loads and one more adapter) are read from disk into host memory ahead (a
                       host-only stage; one already there is touched, so LRU keeps it), and their GPU
                       load is later only the copy.
     oracle            as blocking, but the simulator charges its loads nothing (they still run, so the
                       outputs are the same): the ceiling of what hiding loads can give.
   A request whose adapter has no slot (all held by running or nearer requests) waits under every
   policy; requests behind it may go ahead.

overlap+prefetch also plans ahead when a request arrives (`on_arrival`, called by the simulator at the
arrival's time, between step boundaries): a serving engine's front end sees the request before the next
scheduler step, and the host stage and the copy need neither the GPU nor a step boundary, so loads and
host-only stages for the waiting queue start then instead of at the next boundary.
   "On demand" means: the requests this step would admit if every adapter were resident.

A load is the whole path: disk -> host memory (the host stage, skipped when the host store holds the
adapter) -> GPU slot. The scheduler only decides; `AdapterState` is its view of the pool in simulated
time (which adapters hold a slot and when each load is ready) and of the host tier (which adapters are
in host memory or being read into it). The simulator issues the chosen loads and stages through the
real host stager and `AdapterLoader` and advances the clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from lora_kernels.adapters.prefetch import first_need, plan_prefetch
from lora_kernels.serve_sim.trace import Request

POLICIES = ("blocking", "overlap", "overlap+prefetch", "oracle")
BLOCKING = ("blocking", "oracle")  # policies whose steps wait for their loads (free ones for the oracle)


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str
    num_slots: int
    max_running: int = 32
    max_batch_tokens: int = 2048
    chunk: int = 512
    max_prefetch: int = 4
    lookahead: int | None = None  # waiting requests the prefetcher looks at (None: all)
    admit_within: float = 0.25  # overlap policies: a load ready within this share of the step joins it

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("num_slots", "max_running", "max_batch_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_tokens < self.chunk:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} must be >= chunk={self.chunk} "
                             f"(a prompt chunk must fit a step)")
        if self.max_prefetch < 0:
            raise ValueError(f"max_prefetch must be >= 0, got {self.max_prefetch}")
        if not 0 <= self.admit_within <= 1:
            raise ValueError(f"admit_within must be in [0, 1] (a share of a step), got {self.admit_within}")


@dataclass
class RequestState:
    req: Request
    pos: int = 0  # positions processed so far
    produced: int = 0  # output tokens produced so far
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def adapter(self):
        return self.req.adapter

    def next_tokens(self, chunk: int) -> int:
        if self.pos < self.req.prompt_len:
            return min(chunk, self.req.prompt_len - self.pos)
        return 1


class AdapterState:
    """The scheduler's view of the slot pool in simulated time: resident adapters, when each one's load
    is (or was) ready (None: issued, duration not measured yet), and recency of use; and of the host
    tier: `host`, the adapters in host memory or being read into it (None: no host tier, every adapter
    is in host memory), its capacity and each adapter's size there, in bytes."""

    def __init__(self, num_slots: int, host_capacity: float | None = None, host_bytes=()):
        self.num_slots = num_slots
        self.ready_at: dict = {}
        self.layers_at: dict = {}  # layer-wise loads: when each layer is in place (ready_at: when a step may start)
        self.walks: dict[int, float] = {}  # shortest measured step per row bucket (powers of two): see `walk`
        self.lru: OrderedDict = OrderedDict()
        self.host: set | None = None
        self.host_capacity, self.host_bytes = host_capacity, host_bytes

    def is_ready(self, a, now: float, rows: int = 0) -> bool:
        """True if a step of at least `rows` rows starting at `now` may use adapter `a`: its load is done, or it is
        a layer-wise load whose layer 0 is in place and whose every later layer will be when a step of that size
        reaches it (the simulator knows when each layer lands; an engine would extrapolate from the layers so far)."""
        t = self.ready_at.get(a, float("inf"))
        if t is not None and t <= now:
            return True
        layers = self.layers_at.get(a)
        if t is None or layers is None or layers[0] > now:
            return False
        walk, n = self.walk(rows), len(layers)
        return all(t_l <= now + i / n * walk for i, t_l in enumerate(layers))

    def ready_soon(self, a, now: float, rows: int, share: float) -> bool:
        """True if a step of at least `rows` rows could use `a` had it started `share` of its measured lower bound
        (`walk`) later: the step then starts late by at most that much (the simulator starts it when the load
        allows, `ready_at`, and charges a late layer exactly). Only a load already placed counts."""
        wait = share * self.walk(rows)
        return wait > 0 and self.ready_at.get(a) is not None and self.is_ready(a, now + wait, rows)

    def observe_step(self, rows: int, compute_s: float) -> None:
        b = max(rows, 1).bit_length() - 1
        self.walks[b] = min(self.walks.get(b, compute_s), compute_s)

    def shortest_step(self) -> float:
        """The shortest step measured so far (0.0 before the first): a layer-wise load's step may start before its
        last layer lands."""
        return min(self.walks.values(), default=0.0)

    def walk(self, rows: int) -> float:
        """A measured lower bound on a step of `rows` rows or more: the largest of the shortest steps seen in the
        row buckets below it (steps grow with their rows; a wrong guess is charged exactly by `step_end`)."""
        top = max(rows, 1).bit_length() - 1
        return max((s for b, s in self.walks.items() if b < top), default=0.0)

    def loading(self, now: float) -> set:
        return {a for a, t in self.ready_at.items() if t is None or t > now}

    def set_ready(self, a, layers: list[float], walk_s: float) -> None:
        """Places a measured load: `layers` holds when each of its layers is in place (one entry: the whole
        adapter). A step that reaches layer l of L no sooner than l/L of `walk_s` after it starts (the shortest
        step so far) may start once every layer is in place by then; `step_end` charges any layer still late."""
        n = len(layers)
        self.ready_at[a] = max(t - i / n * walk_s for i, t in enumerate(layers))
        if n > 1:
            self.layers_at[a] = layers
        else:
            self.layers_at.pop(a, None)

    def step_end(self, start: float, compute_s: float, adapters) -> float:
        """When a step of `compute_s` that starts at `start` ends, if it stops at each layer whose load is late."""
        end = start + compute_s
        for a in adapters:
            layers = self.layers_at.get(a)
            if layers is not None and layers[-1] > start:
                n = len(layers)
                end = max([end] + [t + (n - i) / n * compute_s for i, t in enumerate(layers)])
        return end

    def start_load(self, a, victim) -> None:
        if victim is not None:
            del self.ready_at[victim]
            self.layers_at.pop(victim, None)
            self.lru.pop(victim, None)
        if len(self.ready_at) >= self.num_slots:
            raise RuntimeError(f"load of {a!r} without a free slot ({len(self.ready_at)} resident)")
        self.ready_at[a] = None
        self.lru[a] = True

    def touch(self, adapters) -> None:
        for a in adapters:
            if a is not None:
                self.lru[a] = True
                self.lru.move_to_end(a)


@dataclass
class StepPlan:
    batch: list[tuple[RequestState, int]] = field(default_factory=list)  # (request, rows) in row order
    loads: list[tuple[object, object]] = field(default_factory=list)  # (adapter, victim or None)
    stages: list = field(default_factory=list)  # adapters to read into host memory only (no slot yet)
    waits_on_load: bool = False  # a waiting request is held back only by a load in flight

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.batch)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.waiting: list[RequestState] = []
        self.running: list[RequestState] = []

    def add(self, r: RequestState) -> None:
        self.waiting.append(r)

    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _try_load(self, i: int, in_use: set, cache: AdapterState, now: float, plan: StepPlan) -> bool:
        """Plans the load of waiting[i]'s adapter now (on demand); False if no slot can be freed for it."""
        p = plan_prefetch([r.adapter for r in self.waiting[i:]], resident=cache.ready_at.keys(),
                          loading=cache.loading(now), in_use=in_use, num_slots=cache.num_slots,
                          lru=list(cache.lru), horizon=1)
        for a, v in p:
            cache.start_load(a, v)
            plan.loads.append((a, v))
        return bool(p.loads)

    def schedule(self, now: float, cache: AdapterState) -> StepPlan:
        cfg, plan = self.cfg, StepPlan()
        budget = cfg.max_batch_tokens
        for r in sorted(self.running, key=lambda r: r.pos < r.req.prompt_len):  # decodes first (stable)
            n = r.next_tokens(cfg.chunk)
            if n <= budget:
                plan.batch.append((r, n))
                budget -= n
        in_use = {r.adapter for r in self.running if r.adapter is not None}
        self._admit(now, cache, plan, budget, in_use)
        if cfg.policy == "overlap+prefetch":
            self._prefetch(now, cache, plan, in_use)
        cache.touch(r.adapter for r, _ in plan.batch)
        return plan

    def on_arrival(self, now: float, cache: AdapterState) -> StepPlan:
        """Loads and host-only stages that overlap+prefetch starts when a request arrives at `now`, between
        step boundaries (no batch; running requests' adapters are protected). Empty for other policies."""
        plan = StepPlan()
        if self.cfg.policy == "overlap+prefetch":
            self._prefetch(now, cache, plan, {r.adapter for r in self.running if r.adapter is not None})
        return plan

    def _admit(self, now: float, cache: AdapterState, plan: StepPlan, budget: int, in_use: set) -> None:
        """Waiting requests join `plan`, first come first served, under the policy's loading rule."""
        cfg = self.cfg
        blocking = cfg.policy in BLOCKING
        seats = cfg.max_running - len(self.running)
        virt_budget, virt_seats = budget, seats  # as if every adapter were resident: bounds on-demand loads
        admitted: list[int] = []
        for i, r in enumerate(self.waiting):
            n = r.next_tokens(cfg.chunk)
            if n > budget or seats == 0:
                break
            on_demand = n <= virt_budget and virt_seats > 0
            if on_demand:
                virt_budget, virt_seats = virt_budget - n, virt_seats - 1
            a = r.adapter
            rows = cfg.max_batch_tokens - budget + n
            ok = a is None or cache.is_ready(a, now, rows) or (
                not blocking and cache.ready_soon(a, now, rows, cfg.admit_within))
            if not ok and a in cache.ready_at:
                # Loading. Blocking: a load issued earlier in this step, which the step waits for
                # anyway. Overlap: the overlap rule keeps the request waiting.
                ok = blocking
                plan.waits_on_load |= not blocking
            elif not ok and on_demand:
                ok = self._try_load(i, in_use, cache, now, plan) and blocking
                plan.waits_on_load |= not blocking and a in cache.ready_at
            if ok:
                admitted.append(i)
                plan.batch.append((r, n))
                budget, seats = budget - n, seats - 1
                if a is not None:
                    in_use.add(a)
        for i in reversed(admitted):
            r = self.waiting.pop(i)
            r.admitted_at = now
            self.running.append(r)

    def _prefetch(self, now: float, cache: AdapterState, plan: StepPlan, in_use: set) -> None:
        """GPU loads ahead for the waiting queue (nearest need first, `max_prefetch` in flight), then host-only
        stages for the next adapters it needs that hold no slot (with a host tier)."""
        cfg = self.cfg
        if not self.waiting:
            return
        waiting = self.waiting if cfg.lookahead is None else self.waiting[: cfg.lookahead]
        p = plan_prefetch([r.adapter for r in waiting], resident=cache.ready_at.keys(),
                          loading=cache.loading(now), in_use=in_use, num_slots=cache.num_slots,
                          lru=list(cache.lru), max_inflight=cfg.max_prefetch)
        for a, v in p:
            cache.start_load(a, v)
            plan.loads.append((a, v))
            plan.waits_on_load = True
        if cache.host is not None:
            self._stage_ahead(waiting, cache, plan)

    def _stage_ahead(self, waiting: list[RequestState], cache: AdapterState, plan: StepPlan) -> None:
        """Host-tier prefetch: adapters the queue needs soonest that hold no GPU slot, within a byte window
        that this step's cold loads and one more adapter cannot push out of the LRU host memory (else
        staged adapters would evict each other before use)."""
        size = cache.host_bytes
        room = cache.host_capacity - max(size) - sum(size[a] for a, _ in plan.loads if a not in cache.host)
        for a in first_need(r.adapter for r in waiting):
            if a in cache.ready_at:
                continue
            if len(plan.stages) == self.cfg.max_prefetch or size[a] > room:
                break
            room -= size[a]
            cache.host.add(a)
            plan.stages.append(a)  # a read if not in host memory, else a touch

    def complete(self, plan: StepPlan, t_end: float) -> list[RequestState]:
        """Advances every request of `plan` by its rows at simulated time t_end; returns those finished."""
        finished = []
        for r, n in plan.batch:
            r.pos += n
            if r.pos >= r.req.prompt_len:  # the step computed the logits of the last processed position
                r.produced += 1
                if r.first_token_at is None:
                    r.first_token_at = t_end
                if r.produced >= r.req.output_len:
                    r.finished_at = t_end
                    finished.append(r)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        return finished
