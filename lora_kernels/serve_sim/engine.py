"""`ModelEngine`: runs the simulator's steps through the real kernels, batch-info builder and adapter loader.

The model is a stack of decoder layers reduced to their linear layers: per layer, the base GEMMs of
qkv_proj, o_proj, gate_up_proj and down_proj of a `ModelSpec` (random weights), each followed by
`apply_lora` on that layer's pool tensors, with RMS norms, residual adds and SiLU-gating between
them. Attention is replaced by passing the q slice on to o_proj, so every row depends only on its own
token: a request's outputs cannot depend on how it was batched, which is what the policy-equality
check relies on. Layer 0's input is the token embedding itself (no norm), so its LoRA outputs depend
only on the token, the adapter and the kernel.

Timing (see sim.py): on CUDA, every step's GPU work (and the loads issued with it) is queued behind a
"gate" — a sleep kernel on the compute stream, which the load stream waits for too, lasting 1.25x the
host's recent queueing time — so that the CUDA events around the step and around each load time GPU
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
from lora_kernels.adapters import AdapterLoader, GpuAdapterPool, HostAdapterStore, ModelSpec
from lora_kernels.serve_sim.scheduler import StepPlan
from lora_kernels.serve_sim.sim import StepTiming

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
                 vocab: int = 4096, seed: int = 0, record: Records | None = None):
        self.spec, self.dtype, self.device, self.backend = spec, dtype, torch.device(device), backend
        self.max_tokens, self.record = max_tokens, record
        self.is_cuda = self.device.type == "cuda"
        self.keys = [f"adapter_{k:03d}" for k in range(len(adapter_dirs))]
        self.store = HostAdapterStore(spec, dtype, pin=self.is_cuda, max_rank=max_rank)
        for key, path in zip(self.keys, adapter_dirs):
            self.store.register_path(key, path)
        # Read and pack every adapter now (a load in the run is then only the copy); the store is
        # thread-safe and reading releases the GIL, so a few threads cut the start-up time.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            self.ranks = [p.rank for p in pool.map(self.store.get, self.keys)]
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
        self._pending_gate = None

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
        self.loader = AdapterLoader(self.pool, self.store)
        self.unfed_steps = self.remeasured_steps = self.unfed_loads = 0
        self.steps = 0
        self._pending_gate = None
        if self.record is not None:
            for b in self.record.backends:
                self.record.digests.setdefault(b, {})
                self.record.rows.setdefault(b, {})

    def issue_load(self, adapter: int, victim: int | None):
        key, vkey = self.keys[adapter], None if victim is None else self.keys[victim]
        if not self.is_cuda:
            t0 = time.thread_time()
            self.loader.load_async(key, victim=vkey)
            return time.thread_time() - t0
        if self._pending_gate is None:
            self._pending_gate = self._open_gate(self._gate_len())
        stream = self.loader.load_stream
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        self.loader.load_async(key, victim=vkey)
        e1.record(stream)
        return (e0, e1)

    def load_seconds(self, handle) -> float:
        if not self.is_cuda:
            return handle
        if self._pending_gate is not None:  # loads issued in an iteration without a step: close their gate
            self.unfed_loads += bool(self._pending_gate[0].query())
            self._pending_gate = None
        e0, e1 = handle
        e1.synchronize()
        return e0.elapsed_time(e1) * 1e-3

    def run_step(self, plan: StepPlan) -> StepTiming:
        t_prep = time.perf_counter()
        if self.is_cuda:
            gate, t_gate = self._pending_gate or self._open_gate(self._gate_len())
            self._pending_gate = None
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
