"""The serving-like loop both profilers record (torch_profile.py, nsys_profile.sh).

Each step: batch preparation (range "batch_prep": `BatchInfoBuilder.build`, or the straightforward
`naive_build` with --baseline), then the LoRA ops of a few layers (one range per layer), then a read-back
of one value (range "sample": an engine reads its sampled tokens back every step, so the host cannot run
ahead of the GPU and the next batch's preparation shows up as GPU idle time). Steps cycle decode, decode,
decode, mixed (chunked prefill + decodes). In --graph mode the builder keeps static buffers and the
decode steps replay one captured CUDA graph.

The steps run once unrecorded (kernel compilation), then again recorded. Run directly (what
nsys_profile.sh profiles): NVTX ranges, and torch.cuda.profiler.start/stop around the recorded steps
for `nsys profile --capture-range=cudaProfilerApi`.

    python bench/profile/workload.py [--steps 40] [--baseline] [--graph]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the baseline builder
sys.path.insert(0, str(Path(__file__).resolve().parent))

from analysis import PREP  # noqa: E402
from bench_batch_info import naive_build  # noqa: E402

import lora_kernels as lk  # noqa: E402

SAMPLE = "sample"


@dataclass
class Problem:
    x: torch.Tensor  # [max_tokens, hidden], static
    out: torch.Tensor  # [max_tokens, out_total], static
    base: torch.Tensor
    layers: list  # (lora_a, lora_b) per layer
    offsets: tuple
    ranks: torch.Tensor
    scalings: torch.Tensor
    max_tokens: int
    max_segments: int


def make_problem(layers=4, hidden=1024, rank=16, num_slots=16, max_tokens=2048, max_segments=256,
                 dtype=torch.float16, seed=0, device="cuda") -> Problem:
    g = torch.Generator(device=device).manual_seed(seed)
    widths = (hidden, hidden // 4, hidden // 4)  # a qkv projection with GQA
    offsets = (0, widths[0], widths[0] + widths[1], sum(widths))
    weights = [(torch.randn(num_slots, 3 * rank, hidden, device=device, dtype=dtype, generator=g) * hidden ** -0.5,
                torch.randn(num_slots, offsets[-1], rank, device=device, dtype=dtype, generator=g) * rank ** -0.5)
               for _ in range(layers)]
    x = torch.randn(max_tokens, hidden, device=device, dtype=dtype, generator=g)
    base = torch.randn(max_tokens, offsets[-1], device=device, dtype=dtype, generator=g)
    ranks = torch.randint(1, rank + 1, (num_slots,), dtype=torch.int32, device=device, generator=g)
    return Problem(x, base.clone(), base, weights, offsets, ranks, (16.0 / ranks).float(), max_tokens, max_segments)


def schedule(steps: int, p: Problem, seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """(counts, slots) per step as Python lists: 3 decode steps then 1 mixed step, ~128 requests each."""
    rng = np.random.default_rng(seed)
    out = []
    num_slots = p.ranks.shape[0]
    for i in range(steps):
        n = int(rng.integers(96, 160))
        slots = [int(s) if rng.random() > 0.1 else -1 for s in rng.integers(0, num_slots, n)]
        if i % 4 == 3:
            counts = [int(c) if rng.random() < 0.1 else 1 for c in rng.integers(16, 256, n)]
            while sum(counts) > p.max_tokens:
                counts = [max(c * 3 // 4, 2) if c > 1 else 1 for c in counts]
        else:
            counts = [1] * n
        out.append((counts, slots))
    return out


class Ranges:
    """Named ranges for torch.profiler (record_function) and/or NVTX (nsys)."""

    def __init__(self, torch_profiler: bool, nvtx: bool):
        self.torch_profiler, self.nvtx = torch_profiler, nvtx

    @contextlib.contextmanager
    def __call__(self, name: str):
        with contextlib.ExitStack() as stack:
            if self.torch_profiler:
                stack.enter_context(torch.profiler.record_function(name))
            if self.nvtx:
                stack.enter_context(torch.cuda.nvtx.range(name))
            yield


class Loop:
    """One step at a time: prepare the batch, run the layers, read one value back."""

    def __init__(self, p: Problem, baseline: bool, graph: bool):
        if baseline and graph:
            raise ValueError("--baseline has no graph mode (its tensors move every step)")
        self.p, self.baseline, self.graph_mode = p, baseline, graph
        self.builder = lk.BatchInfoBuilder(p.max_tokens, p.max_segments, p.ranks, p.scalings, cuda_graph=graph)
        self.graph = None
        self.info = None

    def prepare(self, counts, slots):
        if self.baseline:
            return naive_build(counts, slots, self.p.ranks, self.p.scalings)
        return self.builder.build(counts, slots)

    def layers(self, info, ranges):
        p = self.p
        for i, (a, b) in enumerate(p.layers):
            with ranges(f"lora_layer{i}"):
                lk.apply_lora(p.x, p.out, a, b, info, p.offsets)

    def capture(self, counts, slots):
        """Captures the decode step once (graph mode); later decode steps only rebuild and replay."""
        self.info = self.builder.build(counts, slots)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.layers(self.info, Ranges(False, False))
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.layers(self.info, Ranges(False, False))

    def step(self, counts, slots, ranges) -> float:
        with ranges(PREP):
            info = self.prepare(counts, slots)
        if self.graph is not None and info.max_seg_len == 1 and info.seg_indptr is self.info.seg_indptr:
            with ranges("lora_graph_replay"):
                self.graph.replay()
        else:
            self.layers(info, ranges)
        with ranges(SAMPLE):
            return float(self.p.out[0, 0].item())  # the engine's per-step read-back (a sync by design)


def warm_up(loop: Loop, steps) -> None:
    """Graph capture (graph mode) and the steps once unrecorded: kernel compilation, allocator."""
    if loop.graph_mode:
        loop.capture(*next(s for s in steps if all(c == 1 for c in s[0])))
    for counts, slots in steps:
        loop.step(counts, slots, Ranges(False, False))
    torch.cuda.synchronize()


def measure(loop: Loop, steps, ranges, cuda_profiler_api: bool = False) -> None:
    """The recorded steps; with cuda_profiler_api, between torch.cuda.profiler.start/stop (nsys capture range)."""
    if cuda_profiler_api:
        torch.cuda.profiler.start()
    for counts, slots in steps:
        loop.step(counts, slots, ranges)
    torch.cuda.synchronize()
    if cuda_profiler_api:
        torch.cuda.profiler.stop()


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=40, help="recorded steps (run once before, unrecorded)")
    ap.add_argument("--baseline", action="store_true", help="prepare batches with naive_build (syncs)")
    ap.add_argument("--graph", action="store_true", help="graph-mode builder; decode steps replay a CUDA graph")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("workload.py needs a CUDA device")
        return 2
    p = make_problem()
    loop = Loop(p, args.baseline, args.graph)
    steps = schedule(args.steps, p)
    warm_up(loop, steps)
    measure(loop, steps, Ranges(False, True), cuda_profiler_api=True)
    print(f"ran {args.steps} steps; builder stalls: {loop.builder.stalls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
