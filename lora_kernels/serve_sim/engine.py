"""`ModelEngine`: runs the simulator's steps through the real kernels, batch-info builder and adapter loader.

The model is a stack of decoder layers reduced to their linear layers: per layer, the base GEMMs of
qkv_proj, o_proj, gate_up_proj and down_proj of a `ModelSpec` (random weights), each followed by
`apply_lora` on that layer's pool tensors, with RMS norms, residual adds and SiLU-gating between
them. Attention is replaced by passing the q slice on to o_proj, so every row depends only on its own
token: a request's outputs cannot depend on how it was batched, which is what the policy-equality
check relies on. Layer 0's input is the token embedding itself (no norm), so its LoRA outputs depend
only on the token, the adapter and the kernel.

Adapter memory is three tiers: the PEFT folders on disk, a `HostAdapterStore` of packed (pinned) buffers
bounded by `host_budget` (LRU by bytes; "all" = every adapter packed at start, no disk reads in the
run), and the GPU pool. A load's host stage (`store.get`: read, parse, pack) runs on a `HostStager`
worker thread under every policy, timed there with wall time; its H2D copy is issued through
`AdapterLoader.load_async(packed=...)` in issue order, once the host stage is done, before the next
step is queued (the scheduler has already placed the load in simulated time; waiting here for a read
is real time only, never on the clock).

Timing (see sim.py): on CUDA, every step's GPU work (and the copies issued with it) is queued behind a
"gate" — a sleep kernel on the compute stream, which the load stream waits for too, lasting 1.25x the
host's recent queueing time — so that the CUDA events around the step and around each copy time GPU
work only, never host launch gaps. If the gate ends before the host has queued the whole step (a
Triton compile, a GC pause), the step's forward, which has no side effects, is timed again behind a
longer gate (`remeasured_steps`); `unfed_steps` counts steps that stayed unfed after 4 tries. On the
CPU, steps and loads are timed with the thread's CPU time (`time.thread_time`; torch runs on this one
thread there), which other processes on a busy machine do not inflate as they do wall time.
"""

from __future__ import annotations

import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lora_kernels import BatchInfoBuilder, apply_lora
from lora_kernels.adapters import AdapterLoader, GpuAdapterPool, HostAdapterStore, HostStager, ModelSpec
from lora_kernels.adapters.host_stage import HostStage
from lora_kernels.serve_sim.scheduler import StepPlan
from lora_kernels.serve_sim.sim import LoadTiming, StepTiming

_LOAD_GATE_S = 2e-3  # gate time per copy issued behind it (a load_async call takes ~0.5 ms of host time)


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


@dataclass
class _Load:
    key: str
    victim: str | None
    stage: HostStage
    h2d: object = None  # CPU: measured seconds; CUDA: (start, end) events on the load stream


@dataclass
class Records:
    """Per request: digest of layer 0's qkv LoRA output per position, and sample rows for tolerance checks.

    digests[backend][rid]: int64 per processed position (exact bit pattern digest);
    rows[backend][rid]: {position: fp32 row of the LoRA output} for the positions in `sample`;
    final[rid]: {position: fp32 row of the last layer's output} for the positions in `sample`.
    """

    backends: tuple[str, ...]
    sample: str = "ends"  # "ends": first/last prompt and output positions; "all": every position
    digests: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    final: dict = field(default_factory=dict)

    def positions(self, req) -> set[int]:
        if self.sample == "all":
            return set(range(req.num_positions))
        return {0, req.prompt_len - 1, req.num_positions - 1}


class ModelEngine:
    def __init__(self, spec: ModelSpec, adapter_dirs: list[Path], *, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, backend: str | None, max_tokens: int, max_segments: int,
                 vocab: int = 4096, seed: int = 0, record: Records | None = None, host_budget: str = "all"):
        self.spec, self.dtype, self.device, self.backend = spec, dtype, torch.device(device), backend
        self.max_tokens, self.record = max_tokens, record
        self.is_cuda = self.device.type == "cuda"
        self.keys = [f"adapter_{k:03d}" for k in range(len(adapter_dirs))]
        self._index = {key: k for k, key in enumerate(self.keys)}
        self.store = HostAdapterStore(spec, dtype, pin=self.is_cuda, max_rank=max_rank)
        for key, path in zip(self.keys, adapter_dirs):
            self.store.register_path(key, path)
        # Read and pack every adapter once now: a bad folder fails here, with its name, and the ranks and
        # packed sizes are known. The store is thread-safe and reading releases the GIL, so a few threads
        # cut the start-up time.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            packed = [(p.rank, p.nbytes) for p in pool.map(self.store.get, self.keys)]
        self.ranks = [r for r, _ in packed]
        self.packed_bytes = [n for _, n in packed]
        kind, value = parse_host_budget(host_budget)
        # A share is raised to the largest adapter if it is below (a few adapters); a size is taken as given.
        budget = {"all": None, "share": max(value * sum(self.packed_bytes), max(self.packed_bytes)),
                  "bytes": value}[kind]
        if budget is not None and budget < max(self.packed_bytes):
            raise ValueError(f"--host-budget {host_budget} is {budget / 2 ** 20:.1f} MB, less than the largest "
                             f"adapter's {max(self.packed_bytes) / 2 ** 20:.1f} MB")
        self.host_tier = budget is not None
        self.store.capacity_bytes = None if budget is None else int(budget)
        self.stager = HostStager(self.store)
        self._queued: list[_Load] = []  # loads whose copy is not issued yet, in issue order
        self.pool = GpuAdapterPool(spec, num_slots, max_rank, dtype, self.device)
        self.builder = BatchInfoBuilder(max_tokens, max_segments, self.pool.lora_ranks, self.pool.scalings)
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def rand(*shape, scale):
            return (torch.randn(*shape, generator=gen, device=self.device) * scale).to(dtype)

        self.embed = rand(vocab, spec.hidden, scale=1.0)
        self.weights = []
        for _ in range(spec.layers):
            self.weights.append({g.name: rand(g.out_total, g.in_dim, scale=g.in_dim ** -0.5) for g in spec.groups})
        self.q_dim = spec.num_heads * spec.head_dim
        self.loader: AdapterLoader | None = None
        self._gate_cycles_per_s = self._calibrate_sleep() if self.is_cuda else 0.0
        self._host_s: deque[float] = deque(maxlen=16)  # host queueing time of recent fed steps
        self.unfed_steps = self.remeasured_steps = self.unfed_loads = 0
        self.steps = 0

    def close(self) -> None:
        self.stager.close()

    def host_capacity_adapters(self) -> float:
        """The host budget in adapters of the mean packed size (inf: every adapter)."""
        cap = self.store.capacity_bytes
        return float("inf") if cap is None else cap / (sum(self.packed_bytes) / len(self.packed_bytes))

    # -- timing helpers -------------------------------------------------------------------------------

    def _calibrate_sleep(self) -> float:
        torch.cuda.synchronize()
        cycles = 20_000_000
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        e1.synchronize()
        return cycles / (e0.elapsed_time(e1) * 1e-3)

    def _gate_len(self) -> float:
        """1.25x the median host queueing time of recent steps (a step's host work varies little)."""
        if not self._host_s:
            return 5e-3
        return min(1.25 * float(np.median(self._host_s)) + 3e-4, 0.05)

    def _open_gate(self, seconds: float) -> tuple[torch.cuda.Event, float]:
        """Queues the sleep kernel that holds the GPU while the host queues a step; the load stream waits
        for it too. Returns (event at the gate's end, host time it was opened)."""
        torch.cuda._sleep(int(seconds * self._gate_cycles_per_s))
        gate = torch.cuda.Event()
        gate.record()
        self.loader.load_stream.wait_event(gate)
        return gate, time.perf_counter()

    # -- Engine protocol ------------------------------------------------------------------------------

    def reset(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()
        if self.host_tier:  # every policy starts with an empty host tier, as with an empty GPU pool
            for key in self.store.packed_ids():
                self.store.drop(key)
        self.loader = AdapterLoader(self.pool, self.store)
        self._queued.clear()
        self.unfed_steps = self.remeasured_steps = self.unfed_loads = 0
        self.steps = 0
        if self.record is not None:
            for b in self.record.backends:
                self.record.digests.setdefault(b, {})
                self.record.rows.setdefault(b, {})

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
            return LoadTiming(handle.seconds, 0.0, handle.cold)
        if handle.h2d is None:  # loads issued in an iteration without a step
            self._issue_queued(0.0)
        if self.is_cuda:
            e0, e1 = handle.h2d
            e1.synchronize()
            h2d_s = e0.elapsed_time(e1) * 1e-3
        else:
            h2d_s = handle.h2d
        return LoadTiming(handle.stage.seconds, h2d_s, handle.stage.cold)

    def _issue_queued(self, gate_s: float):
        """Issues the copies of the queued loads, in issue order, once their host stages are done; on CUDA
        behind a gate of `gate_s` plus room for the copies, returned (None when nothing was queued)."""
        if not self._queued:
            return None
        packed = [load.stage.result() for load in self._queued]  # real time only (the clock placed them)
        gate = self._open_gate(gate_s + _LOAD_GATE_S * len(self._queued)) if self.is_cuda else None
        for load, p in zip(self._queued, packed):
            if not self.is_cuda:
                t0 = time.thread_time()
                self.loader.load_async(load.key, victim=load.victim, packed=p)
                load.h2d = time.thread_time() - t0
                continue
            stream = self.loader.load_stream
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(stream)
            self.loader.load_async(load.key, victim=load.victim, packed=p)
            e1.record(stream)
            load.h2d = (e0, e1)
        if gate is not None and gate[0].query():  # the GPU passed the gate before the copies were queued
            self.unfed_loads += 1
        self._queued.clear()
        return gate

    def run_step(self, plan: StepPlan) -> StepTiming:
        gate = self._issue_queued(self._gate_len() if self.is_cuda else 0.0)
        t_prep = time.perf_counter()
        if self.is_cuda:
            gate, t_gate = gate or self._open_gate(self._gate_len())
        keys = [None if r.adapter is None else self.keys[r.adapter] for r, _ in plan.batch]
        slots = self.loader.acquire(keys)
        info = self.builder.build([n for _, n in plan.batch], slots)
        ids = torch.from_numpy(np.concatenate([r.req.tokens[r.pos:r.pos + n] for r, n in plan.batch]))
        if self.is_cuda:
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        prep_s = time.perf_counter() - t_prep
        if not self.is_cuda:
            t1 = time.thread_time()
            h = self._forward(ids, info)
            compute_s = time.thread_time() - t1
        else:
            for attempt in range(4):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                t_fwd = time.perf_counter()
                h = self._forward(ids, info)
                e1.record()
                now = time.perf_counter()
                if attempt == 0:
                    self._host_s.append(now - t_gate)  # a median of these sizes the next gates
                if not gate.query():  # fed: the GPU was still held when the host finished queueing
                    break
                # The host outran the gate (a Triton compile, a GC pause): the events may hold host gaps.
                # The forward has no side effects, so time it again behind a longer gate.
                e1.synchronize()
                if attempt == 3:
                    self.unfed_steps += 1
                    break
                self.remeasured_steps += attempt == 0
                gate, t_gate = self._open_gate(min(2 * (now - t_fwd) + 1e-3, 0.5))
            e1.synchronize()
            compute_s = e0.elapsed_time(e1) * 1e-3
        self.loader.release(keys)  # after the last forward that reads the slots
        self.steps += 1
        if self.record is not None:
            self._record(plan, ids, info, h)
        return StepTiming(compute_s, prep_s)

    # -- the model ------------------------------------------------------------------------------------

    def _rms(self, h: torch.Tensor) -> torch.Tensor:
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(self.dtype)

    def _linear(self, layer: int, group: str, x: torch.Tensor, info) -> torch.Tensor:
        out = x @ self.weights[layer][group].T
        a, b, offs = self.pool.weights(layer, group)
        apply_lora(x, out, a, b, info, offs, backend=self.backend)
        return out

    def _forward(self, ids: torch.Tensor, info) -> torch.Tensor:
        h = self.embed[ids]
        inter = self.spec.intermediate
        for layer in range(self.spec.layers):
            x = h if layer == 0 else self._rms(h)
            qkv = self._linear(layer, "qkv_proj", x, info)
            h = h + self._linear(layer, "o_proj", qkv[:, : self.q_dim].contiguous(), info)
            gu = self._linear(layer, "gate_up_proj", self._rms(h), info)
            act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            h = h + self._linear(layer, "down_proj", act, info)
        return h

    # -- recording (after the timed step, outside the clock) --------------------------------------------

    def _record(self, plan: StepPlan, ids: torch.Tensor, info, h: torch.Tensor) -> None:
        rec = self.record
        x0 = self.embed[ids]
        a, b, offs = self.pool.weights(0, "qkv_proj")
        outs = {}
        for backend in rec.backends:
            out = torch.zeros(x0.shape[0], offs[-1], dtype=self.dtype, device=self.device)
            apply_lora(x0, out, a, b, info, offs, backend=backend)
            outs[backend] = out
        weights = self._digest_weights(offs[-1] * out.element_size() // 2)
        digests = {bk: _digest(o, weights).cpu().numpy() for bk, o in outs.items()}
        row = 0
        for r, n in plan.batch:
            rid, pos = r.req.rid, r.pos
            keep = [p for p in range(pos, pos + n) if p in rec.positions(r.req)]
            for bk in rec.backends:
                d = rec.digests[bk].setdefault(rid, np.zeros(r.req.num_positions, dtype=np.int64))
                d[pos:pos + n] = digests[bk][row:row + n]
                for p in keep:
                    rec.rows[bk].setdefault(rid, {})[p] = outs[bk][row + p - pos].float().cpu()
            for p in keep:
                rec.final.setdefault(rid, {})[p] = h[row + p - pos].float().cpu()
            row += n

    def _digest_weights(self, n: int) -> torch.Tensor:
        w = getattr(self, "_dw", None)
        if w is None or w.numel() < n:
            gen = torch.Generator().manual_seed(1234)
            self._dw = torch.randint(1, 1 << 20, (n,), generator=gen, dtype=torch.int64).to(self.device)
        return self._dw[:n]


def _digest(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """int64 per row: Σ bits16[j] · w[j] over the row's 16-bit words — equal rows give equal digests, and
    any changed bit changes it (|terms| < 2^35, so the sum of ≤ 2^13 terms cannot overflow)."""
    words = out.contiguous().view(torch.int16).to(torch.int64)
    return (words * weights[: words.shape[1]]).sum(1)
