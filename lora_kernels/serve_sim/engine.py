"""`ModelEngine`: runs the simulator's steps through the real kernels, batch-info builder and adapter loader.

The model is `model.LinearStack` (the linear layers of a `ModelSpec`, each with `apply_lora`); its steps
are timed by `gate.StepTimer`; what each request computed is kept by `records.Records`.

Adapter memory is three tiers: the PEFT folders on disk, a `HostAdapterStore` of packed (pinned) buffers
bounded by `host_budget` (LRU by bytes; "all" = every adapter packed at start, no disk reads in the
run; a bounded tier carves its buffers from one pinned arena reserved at start), and the GPU pool. A load's host stage (`store.get`: read, parse, pack) runs on a `HostStager`
worker thread (`host_workers` of them) under every policy, timed there with wall time; its H2D copy is
issued through `AdapterLoader.load_async(packed=...)` in issue order, once the host stage is done, before
the next step is queued (the scheduler has already placed the load in simulated time; waiting here for
a read is real time only, never on the clock).

Layer-wise (`layerwise=True`): the host stage reports each layer as it lands (`HostStager(layerwise=True)`),
the copy is issued layer by layer with an event per layer, and a step acquires its adapters without waiting
for their loads, waiting on the GPU before each layer for that layer's copy (`acquire(..., layerwise=True)`,
`wait_layer`). `load_seconds` reports the per-layer host and copy times, which the simulator places layer by
layer. In real time the engine still issues a load's copies once its host stage is done, as above.

The host-stage workers are Python threads: each read takes the GIL a few times (starting, around the
native read), and with Python's default switch interval (5 ms) a worker waits up to that long each time
while this scheduler thread runs Python (H200 host: a worker's first layer landed 11-16 ms after its submit
beside a busy Python thread, against 0.26-0.6 ms alone; `bench/profile/host_stage_parts.py`). The engine
sets the interval to `SWITCH_INTERVAL_S` while it lives, as a serving engine with host threads must.

`timed_layers` (None: all) runs only the last k of the model's L layers in each step and charges the
measured time x L/k: every layer has the same shapes and kernels, so this estimates the full step in k/L
of the device time (the bench reports how close the estimate is, step by step, against all L layers).
The recorded outputs (layer 0's LoRA output, recomputed after the step) do not depend on it.
Loads always copy every layer. On the CPU, steps and copies are timed with the thread's CPU time.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lora_kernels import BatchInfoBuilder
from lora_kernels.adapters import AdapterLoader, GpuAdapterPool, HostAdapterStore, HostStager, ModelSpec
from lora_kernels.adapters.arena import PinnedArena
from lora_kernels.adapters.host_stage import HostStage
from lora_kernels.adapters.tp import agree_max
from lora_kernels.serve_sim.gate import LOAD_GATE_S, StepTimer
from lora_kernels.serve_sim.model import LinearStack
from lora_kernels.serve_sim.records import Records
from lora_kernels.serve_sim.scheduler import StepPlan
from lora_kernels.serve_sim.sim import LoadTiming, StepTiming

SWITCH_INTERVAL_S = 1e-4  # the GIL hand-off a host-stage worker waits for at most (see the module docstring)
# The host tier's pinned arena: the budget plus room for this many of the largest adapters held beyond it at once
# (reads in flight, copies in flight from buffers the store has dropped); a buffer that does not fit still comes
# from torch's allocator (`engine.store.arena.stats["misses"]`).
ARENA_SPARE_ADAPTERS = 8


def parse_host_budget(spec: str) -> tuple[str, float]:
    """'all' | 'P%' (share of the adapters' packed bytes) | 'N[MB|GB]' -> (kind, value); raises ValueError."""
    text = str(spec).strip().upper()
    try:
        if text == "ALL":
            return "all", 0.0
        if text.endswith("%"):
            value = float(text[:-1])
            if 0 < value <= 100:
                return "share", value / 100
        else:
            scale = 1024.0 if text.endswith("GB") else 1.0
            value = float(text.removesuffix("GB").removesuffix("MB")) * scale
            if value > 0:
                return "bytes", value * 2 ** 20
    except ValueError:
        pass
    raise ValueError(f"--host-budget must be all, P% (a share of the adapters' bytes, 0 < P <= 100) or a size such "
                     f"as 512MB or 2GB, got {spec!r}")


def make_stager(store: HostAdapterStore, workers: int, layerwise: bool = False) -> tuple[HostStager, int]:
    """A `HostStager` with `workers` threads where its constructor takes a worker count; returns (stager, the
    threads it really runs), read back from the stager so that the simulator places host stages on as many
    simulated workers as ran them."""
    params = inspect.signature(HostStager).parameters
    name = next((n for n in ("workers", "num_workers", "max_workers") if n in params), None)
    stager = HostStager(store, **({name: workers} if name else {}), **({"layerwise": True} if layerwise else {}))
    for attr in ("workers", "num_workers", "max_workers"):
        value = getattr(stager, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return stager, value
    pool = getattr(stager, "_pool", None)  # the one-worker stager's executor
    return stager, int(getattr(pool, "_max_workers", 1))


@dataclass
class _Load:
    key: str
    victim: str | None
    stage: HostStage
    h2d: object = None  # CPU: measured seconds; CUDA: (start, end, layer events or None) on the load stream


class ModelEngine:
    def __init__(self, spec: ModelSpec, adapter_dirs: list[Path], *, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, backend: str | None, max_tokens: int, max_segments: int,
                 vocab: int = 4096, seed: int = 0, record: Records | None = None, host_budget: str = "all",
                 host_workers: int | None = None, timed_layers: int | None = None, tp_rank: int = 0,
                 tp_size: int = 1, layerwise: bool = False):
        self.spec, self.dtype, self.device, self.backend = spec, dtype, torch.device(device), backend
        self.max_tokens, self.record = max_tokens, record
        self.is_cuda = self.device.type == "cuda"
        self.keys = [f"adapter_{k:03d}" for k in range(len(adapter_dirs))]
        self._index = {key: k for k, key in enumerate(self.keys)}
        # Tensor parallelism (--tp): this rank's shard of the adapters and of the base layers (adapters/tp.py).
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.tp_size = tp_size
        if layerwise and tp_size > 1:
            raise ValueError("layer-wise loads are not supported under tensor parallelism (tp_size > 1)")
        self.layerwise = layerwise
        self.store = HostAdapterStore(spec, dtype, pin=self.is_cuda, max_rank=max_rank, tp_rank=tp_rank,
                                      tp_size=tp_size)
        self._init_host_tier(adapter_dirs, host_budget)
        workers = host_workers if host_workers is not None else min(4, os.cpu_count() or 1)
        self.stager, self.host_workers = make_stager(self.store, workers, layerwise)
        self._queued: list[_Load] = []  # loads whose copy is not issued yet, in issue order
        self.pool = GpuAdapterPool(spec, num_slots, max_rank, dtype, self.device, tp_rank=tp_rank, tp_size=tp_size)
        self.builder = BatchInfoBuilder(max_tokens, max_segments, self.pool.lora_ranks, self.pool.scalings)
        self.model = LinearStack(self.pool.spec, dtype, self.device, backend, vocab, seed)
        self.timed_layers = timed_layers
        self.loader: AdapterLoader | None = None
        self.timer = StepTimer(self.device)
        self.steps = 0

    def _init_host_tier(self, adapter_dirs: list[Path], host_budget: str) -> None:
        for key, path in zip(self.keys, adapter_dirs):
            self.store.register_path(key, path)
        # Read and pack every adapter once now: a bad folder fails here, with its name, and the ranks and
        # packed sizes are known. The store is thread-safe and reading releases the GIL, so a few threads
        # cut the start-up time.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            packed = [(p.rank, p.blocks.nbytes) for p in pool.map(self.store.get, self.keys)]
        self.ranks = [r for r, _ in packed]
        kind, value = parse_host_budget(host_budget)
        # A bounded tier carves its buffers from one pinned arena (below): sizes as the arena holds them.
        held = PinnedArena.held if kind != "all" else self.store.held_nbytes
        self.packed_bytes = [held(n) for _, n in packed]
        # A share is raised to the largest adapter if it is below (a few adapters); a size is taken as given.
        budget = {"all": None, "share": max(value * sum(self.packed_bytes), max(self.packed_bytes)),
                  "bytes": value}[kind]
        if budget is not None and budget < max(self.packed_bytes):
            raise ValueError(f"--host-budget {host_budget} is {budget / 2 ** 20:.1f} MB, less than the largest "
                             f"adapter's {max(self.packed_bytes) / 2 ** 20:.1f} MB")
        self.host_tier = budget is not None
        self.store.capacity_bytes = None if budget is None else int(budget)
        if budget is not None:  # pinned once now: a cold read never pins pages (24-87 ms a time on the H200 host)
            self.store.reserve_pinned(int(budget) + ARENA_SPARE_ADAPTERS * max(self.packed_bytes))

    def close(self) -> None:
        self.stager.close()
        sys.setswitchinterval(self._switch_interval)

    def host_capacity_adapters(self) -> float:
        """The host budget in adapters of the mean packed size (inf: every adapter)."""
        cap = self.store.capacity_bytes
        return float("inf") if cap is None else cap / (sum(self.packed_bytes) / len(self.packed_bytes))

    # The timer's counters, as the bench and the report read them.
    unfed_steps = property(lambda self: self.timer.unfed_steps)
    remeasured_steps = property(lambda self: self.timer.remeasured_steps)
    unfed_loads = property(lambda self: self.timer.unfed_loads)

    # -- Engine protocol (sim.py) ---------------------------------------------------------------------

    def reset(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()
        if self.host_tier:  # every policy starts with an empty host tier, as with an empty GPU pool
            for key in self.store.packed_ids():
                self.store.drop(key)
        self.loader = AdapterLoader(self.pool, self.store, layerwise=self.layerwise)
        self._queued.clear()
        self.timer.reset()
        self.steps = 0

    def host_resident(self) -> set | None:
        return {self._index[k] for k in self.store.packed_ids()} if self.host_tier else None

    def host_budget(self) -> tuple[float, list[int]] | None:
        return (self.store.capacity_bytes, self.packed_bytes) if self.host_tier else None

    def issue_load(self, adapter: int, victim: int | None) -> _Load:
        load = _Load(self.keys[adapter], None if victim is None else self.keys[victim],
                     self.stager.submit(self.keys[adapter]))
        self._queued.append(load)
        return load

    def issue_stage(self, adapter: int) -> HostStage:
        return self.stager.submit(self.keys[adapter])

    def load_seconds(self, handle) -> LoadTiming:
        if isinstance(handle, HostStage):
            handle.result()
            return LoadTiming(*agree_max(handle.seconds, 0.0), handle.cold, handle.layer_seconds)
        if handle.h2d is None:  # loads issued in an iteration without a step
            self._issue_queued(0.0)
        layers = None
        if self.is_cuda:
            e0, e1, evs = handle.h2d
            e1.synchronize()
            h2d_s = e0.elapsed_time(e1) * 1e-3
            if evs:  # a layer-wise load: each layer's span, back to back from the load's start
                layers = tuple(a.elapsed_time(b) * 1e-3 for a, b in zip([e0, *evs[:-1]], evs))
        else:
            h2d_s = handle.h2d
            if self.layerwise:  # synchronous copies: the CPU time split evenly over the layers
                layers = (h2d_s / self.spec.layers,) * self.spec.layers
        host_layers = handle.stage.layer_seconds if self.layerwise else None
        return LoadTiming(*agree_max(handle.stage.seconds, h2d_s), handle.stage.cold, host_layers, layers)

    def _issue_queued(self, gate_s: float):
        """Issues the copies of the queued loads, in issue order, once their host stages are done; on CUDA
        behind a gate of `gate_s` plus room for the copies, returned (None when nothing was queued)."""
        if not self._queued:
            return None
        packed = [load.stage.result() for load in self._queued]  # real time only (the clock placed them)
        stream = self.loader.load_stream
        gate = self.timer.open(gate_s + LOAD_GATE_S * len(self._queued), stream) if self.is_cuda else None
        for load, p in zip(self._queued, packed):
            if not self.is_cuda:
                t0 = time.thread_time()
                self.loader.load_async(load.key, victim=load.victim, packed=p)
                load.h2d = time.thread_time() - t0
                continue
            e0 = torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            self.loader.load_async(load.key, victim=load.victim, packed=p)
            e1 = self.loader.load_event(load.key)  # the load's end (after its B scatter when r < R)
            evs = self.loader.layer_events(load.key)
            if e1 is None:  # already complete: nothing was copied
                e1 = torch.cuda.Event(enable_timing=True)
                e1.record(stream)
            load.h2d = (e0, e1, evs)
        if gate is not None and gate[0].query():  # the GPU passed the gate before the copies were queued
            self.timer.unfed_loads += 1
        self._queued.clear()
        return gate

    def run_step(self, plan: StepPlan) -> StepTiming:
        gate = self._issue_queued(self.timer.length() if self.is_cuda else 0.0)
        t_prep = time.perf_counter()
        if self.is_cuda and gate is None:
            gate = self.timer.open(self.timer.length(), self.loader.load_stream)
        keys = [None if r.adapter is None else self.keys[r.adapter] for r, _ in plan.batch]
        slots = self.loader.acquire(keys, layerwise=self.layerwise)
        info = self.builder.build([n for _, n in plan.batch], slots)
        ids = torch.from_numpy(np.concatenate([r.req.tokens[r.pos:r.pos + n] for r, n in plan.batch]))
        if self.is_cuda:
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        prep_s = time.perf_counter() - t_prep
        layers = self.spec.layers if self.timed_layers is None else min(self.timed_layers, self.spec.layers)
        wait = self.loader.wait_layer if self.layerwise else None
        compute_s, _ = self.timer.timed(lambda: self.model.forward(ids, info, self.pool, layers, wait), gate,
                                        self.loader.load_stream if self.is_cuda else None)
        compute_s *= self.spec.layers / layers
        if self.layerwise:
            self.loader.wait_layer(0)  # the record below reads layer 0, which a timed-layers step may not have
        self.loader.release(keys)  # after the last forward that reads the slots
        self.steps += 1
        if self.record is not None:  # after the timed step, outside the clock
            self.record.record_step(plan, self.model.embed[ids], self.pool, info)
        return StepTiming(*agree_max(compute_s, prep_s))  # TP: the slowest rank's, the same on every rank
