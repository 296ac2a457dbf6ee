"""How serve-sim times a step's GPU work without the host's launch gaps: the timing gate.

On CUDA, every step's GPU work (and the copies issued with it) is queued behind a "gate" — a sleep kernel
on the compute stream, which the load stream waits for too, lasting 1.25x the host's recent queueing
time — so that the CUDA events around the step and around each copy time GPU work only, never host
launch gaps. If the gate ends before the host has queued the whole step (a Triton compile, a GC pause),
the step's forward, which has no side effects, is timed again behind a longer gate (`remeasured_steps`);
`unfed_steps` counts steps that stayed unfed after 4 tries. On the CPU, steps are timed with the thread's
CPU time (`time.thread_time`; torch runs on this one thread there), which other processes on a busy
machine do not inflate as they do wall time.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np
import torch

LOAD_GATE_S = 2e-3  # gate time per copy issued behind it (a load_async call takes ~0.5 ms of host time)
_TRIES = 4


class StepTimer:
    """Times forwards (`timed`) and opens gates for copies (`open`); counts unfed and re-measured steps."""

    def __init__(self, device: torch.device):
        self.is_cuda = torch.device(device).type == "cuda"
        self._cycles_per_s = self._calibrate() if self.is_cuda else 0.0
        self._host_s: deque[float] = deque(maxlen=16)  # host queueing time of recent fed steps
        self.reset()

    def reset(self) -> None:
        self.unfed_steps = self.remeasured_steps = self.unfed_loads = 0

    @staticmethod
    def _calibrate() -> float:
        torch.cuda.synchronize()
        cycles = 20_000_000
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        e1.synchronize()
        return cycles / (e0.elapsed_time(e1) * 1e-3)

    def length(self) -> float:
        """1.25x the median host queueing time of recent steps (a step's host work varies little)."""
        if not self._host_s:
            return 5e-3
        return min(1.25 * float(np.median(self._host_s)) + 3e-4, 0.05)

    def open(self, seconds: float, load_stream) -> tuple[torch.cuda.Event, float]:
        """Queues the sleep kernel that holds the GPU while the host queues a step; `load_stream` waits for
        it too. Returns (event at the gate's end, host time it was opened)."""
        torch.cuda._sleep(int(seconds * self._cycles_per_s))
        gate = torch.cuda.Event()
        gate.record()
        load_stream.wait_event(gate)
        return gate, time.perf_counter()

    def timed(self, forward: Callable[[], torch.Tensor], gate, load_stream) -> tuple[float, torch.Tensor]:
        """Runs `forward` and returns (its GPU time on CUDA behind `gate` = (event, opened at), else its
        thread CPU time; its output)."""
        if not self.is_cuda:
            t1 = time.thread_time()
            out = forward()
            return time.thread_time() - t1, out
        gate, t_gate = gate
        for attempt in range(_TRIES):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t_fwd = time.perf_counter()
            out = forward()
            e1.record()
            now = time.perf_counter()
            if attempt == 0:
                self._host_s.append(now - t_gate)  # a median of these sizes the next gates
            if not gate.query():  # fed: the GPU was still held when the host finished queueing
                break
            # The host outran the gate (a Triton compile, a GC pause): the events may hold host gaps.
            # The forward has no side effects, so time it again behind a longer gate.
            e1.synchronize()
            if attempt == _TRIES - 1:
                self.unfed_steps += 1
                break
            self.remeasured_steps += attempt == 0
            gate, t_gate = self.open(min(2 * (now - t_fwd) + 1e-3, 0.5), load_stream)
        e1.synchronize()
        return e0.elapsed_time(e1) * 1e-3, out
