"""Shared benchmark helpers: one timer, the machine's measured ceilings, and JSON-lines output.

Every benchmark script reports its figures beside a physical floor measured in the same run
(`copy_bandwidth`, `h2d_bandwidth`), and appends JSON lines keyed by device, versions and commit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
from pathlib import Path
from typing import Callable, Sequence

import torch


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", type=Path, default=None, help="append one JSON line per result here")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke run)")
    return p


def set_env(spec: str) -> None:
    """Sets the variables of spec "K=V[,K2=V2...]" for the rest of the process (a probe's launch-time switches,
    read at capture)."""
    for kv in filter(None, spec.split(",")):
        k, v = kv.split("=", 1)
        os.environ[k] = v


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def meta() -> dict:
    """Device, versions, commit and date, stored with every result."""
    # GIT_COMMIT first: a device copy of the tree may carry a stale .git whose HEAD is not the tree's commit.
    commit = os.environ.get("GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, check=False).stdout.strip()
        except OSError:
            commit = ""
    import triton

    return {"device": device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton.__version__, "commit": commit or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


def write_jsonl(path: Path | None, rows: list[dict]) -> None:
    if path is None:
        return
    m = meta()
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps({**m, **row}) + "\n")


def time_cuda_us(fn: Callable[[], object], warmup: int = 10, reps: int = 100) -> float:
    """Median µs of fn() over `reps` runs, each between CUDA events, after `warmup` runs."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def time_graph_us(fn: Callable[[], object] | Sequence[Callable[[], object]], inner: int = 20, warmup: int = 3,
                  reps: int = 50) -> float:
    """Median µs per call of fn() replayed from a CUDA graph holding `inner` calls (launch gaps shrink
    to what a serving engine sees under graph replay). fn must be graph-capturable. A sequence of fns
    (the same work on different buffers) is captured in rotation, so data a call leaves in L2 is not
    what the next call reads (pass enough of them to exceed the L2 size)."""
    fns = list(fn) if isinstance(fn, Sequence) else [fn]
    return GraphTimer(fns, inner).time_us(reps=reps, warmup=warmup)


class GraphTimer:
    """A CUDA graph of `inner` calls of fns (rotated, as in `time_graph_us`), captured once; `time_us` times
    its replays, so several variants can be timed in interleaved rounds without recapturing."""

    def __init__(self, fns: Sequence[Callable[[], object]], inner: int = 20):
        fns = list(fns)
        self.inner = max(inner, len(fns))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for i in range(self.inner):
                fns[i % len(fns)]()

    def time_us(self, reps: int = 30, warmup: int = 2) -> float:
        """Median µs per call over `reps` replays."""
        return time_cuda_us(self.graph.replay, warmup=warmup, reps=reps) / self.inner


def time_host_us(fn: Callable[[], object], warmup: int = 50, reps: int = 2000,
                 settle: Callable[[], object] | None = None) -> dict:
    """Host wall time of fn() alone, no GPU sync around it: {"median_us", "p99_us", "mean_us"} over `reps`
    calls after `warmup`. For host-side work such as batch preparation, whose cost is the time it takes
    from the launching thread (GC left on, as in a serving process). settle (untimed) runs after each call:
    e.g. torch.cuda.synchronize, so that a call whose kernels outlast its host work does not make the next
    one wait for a full launch queue (that would time the GPU, not the host)."""
    import time

    for _ in range(warmup):
        fn()
        if settle is not None:
            settle()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(reps):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
        if settle is not None:
            settle()
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(len(samples) * 0.99))]
    return {"median_us": samples[len(samples) // 2] / 1e3, "p99_us": p99 / 1e3,
            "mean_us": sum(samples) / len(samples) / 1e3}


def time_host_interleaved_us(fns: dict[str, Callable[[], object]], reps: int = 2000, rounds: int = 5,
                             warmup: int = 50) -> dict[str, dict]:
    """`time_host_us` for several variants of one task, measured in `rounds` interleaved rounds (reps/rounds
    calls of each per round) and pooled, so that a slow phase of the machine lands on all variants alike
    rather than on whichever ran then. Returns {name: {"median_us", "p99_us", "mean_us"}}."""
    import time

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    clock = time.perf_counter_ns
    samples = {name: [] for name in fns}
    per_round = max(reps // rounds, 1)
    for _ in range(rounds):
        for name, fn in fns.items():
            out = samples[name]
            for _ in range(per_round):
                t0 = clock()
                fn()
                out.append(clock() - t0)
    result = {}
    for name, xs in samples.items():
        xs.sort()
        p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
        result[name] = {"median_us": xs[len(xs) // 2] / 1e3, "p99_us": p99 / 1e3, "mean_us": sum(xs) / len(xs) / 1e3}
    return result


def time_span_us(fn: Callable[[], object], stream: torch.cuda.Stream | None = None, warmup: int = 2,
                 reps: int = 10, hold_cycles: int = 0) -> dict:
    """{"gpu_us", "wall_us"} medians for work fn() enqueues on `stream` (default: current): GPU time
    between events recorded on that stream around it, and host wall time from the call until the GPU
    finished (synchronized before and after each rep). For transfers, where the host's part counts too.
    hold_cycles > 0 first parks the stream in a GPU sleep, so that fn() is fully enqueued before the
    start event runs: gpu_us is then the device time alone (wall_us then includes the sleep)."""
    import time

    stream = stream or torch.cuda.current_stream()
    gpu, wall = [], []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        if hold_cycles:
            with torch.cuda.stream(stream):
                torch.cuda._sleep(hold_cycles)
        start.record(stream)
        fn()
        end.record(stream)
        torch.cuda.synchronize()
        if i >= warmup:
            wall.append((time.perf_counter() - t0) * 1e6)
            gpu.append(start.elapsed_time(end) * 1e3)
    return {"gpu_us": statistics.median(gpu), "wall_us": statistics.median(wall)}


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = time_cuda_us(lambda: dst.copy_(src), warmup=3, reps=20)
    return nbytes / us / 1e3


def h2d_bandwidth_gbs(nbytes: int = 256 << 20) -> float:
    """Measured pinned host-to-device copy bandwidth in GB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    us = time_cuda_us(lambda: dst.copy_(src, non_blocking=True), warmup=3, reps=10)
    return nbytes / us / 1e3


def print_table(rows: list[dict], columns: list[str]) -> None:
    """Prints rows as an aligned text table (floats with 3 significant digits)."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
