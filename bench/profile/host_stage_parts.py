"""Where a layer-wise host stage's time goes before its first layer lands (issue 20: the serving TTFT of a cold
request waits for that layer).

The bench_serving adapters' shape (Llama-3-8B dims, 8 layers), one rank at a time, page cache warm, buffers from
the allocator's cache (pinned where CUDA is present): the median µs of each step of `reader.read_packed` done by
hand (plan check, allocation, wrapping, read plan, the native layer-wise read up to its first and last layer), then
the same read through `HostStager` (timed from its submit), alone and with a busy Python thread beside it (the
serving engine's scheduler thread), where the worker waits for the GIL before and after its read, at several
switch intervals.

    python bench/profile/host_stage_parts.py [--ranks 8,64] [--threads 4,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from lora_kernels.adapters import HostAdapterStore, HostStager, ModelSpec, layout as lay, reader
from lora_kernels.adapters.peft import plan_peft_adapter
from lora_kernels.adapters.progress import LayerProgress
from lora_kernels.serve_sim.folders import write_adapter


def parts(path: Path, spec: ModelSpec, threads: int, pin: bool, reps: int) -> dict[str, float]:
    rows = []
    for _ in range(reps):
        t = [time.perf_counter()]
        plan = plan_peft_adapter(path, spec)
        t.append(time.perf_counter())
        blocks = lay.packed_layout(spec, plan.rank, plan.keys, 2)
        buf = lay.alloc_buffer(blocks.nbytes, pin)
        t.append(time.perf_counter())
        packed = lay.wrap_buffer("x", blocks, buf, plan.scaling, torch.bfloat16, pin)
        t.append(time.perf_counter())
        rp = reader._read_plan(plan, spec, blocks, torch.bfloat16)
        reads = reader._direct_by_layer(rp, blocks)
        progress = LayerProgress(spec.layers, pin)
        t.append(time.perf_counter())
        failed, stamps = reader._native_pread_layers(str(plan.weights_path), packed.buffer.numpy(), reads,
                                                     spec.layers, threads, progress.flag.numpy())
        t.append(time.perf_counter())
        assert failed is None
        rows.append([t[1] - t[0], t[2] - t[1], t[3] - t[2], t[4] - t[3], stamps[0] - t[4], stamps[-1] - t[4],
                     t[5] - stamps[-1]])
        del packed, buf
    names = ["plan check", "alloc", "wrap", "read plan", "to layer 0", "to last layer", "return"]
    return {n: statistics.median(r[i] for r in rows) * 1e6 for i, n in enumerate(names)}


def staged(store: HostAdapterStore, busy: bool, reps: int, switch: float | None = None) -> tuple[float, float, float]:
    """(layer 0, last layer, stage end) µs through a one-worker stager, from the submit; `busy`: a Python loop runs
    beside it; `switch`: the interpreter's switch interval meanwhile (seconds; None: as it is)."""
    stop = threading.Event()
    old = sys.getswitchinterval()
    if switch is not None:
        sys.setswitchinterval(switch)

    def spin():
        x = 0
        while not stop.is_set():
            x += 1

    th = threading.Thread(target=spin) if busy else None
    if th:
        th.start()
    rows = []
    try:
        with HostStager(store, workers=1, layerwise=True) as stager:
            for _ in range(reps):
                store.drop("x")
                st = stager.submit("x")
                st.result()
                s = st.layer_seconds
                rows.append((s[0], s[-1], st.seconds))
    finally:
        stop.set()
        if th:
            th.join()
        sys.setswitchinterval(old)
    return tuple(statistics.median(r[i] for r in rows) * 1e6 for i in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,64")
    ap.add_argument("--threads", default="4,8")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    spec = ModelSpec.preset("llama3-8b", layers=8)
    pin = torch.cuda.is_available()
    root = Path(tempfile.gettempdir()) / "lora_kernels_host_parts"
    print(f"host stage parts, µs (median of {args.reps}); {'pinned' if pin else 'unpinned'} buffers; "
          f"{os.cpu_count()} cores; switch interval {1e3 * sys.getswitchinterval():.1f} ms")
    for r in (int(x) for x in args.ranks.split(",")):
        path = root / f"r{r}"
        if not path.exists():
            write_adapter(path, spec, r, torch.bfloat16, seed=r)
        for n in (int(x) for x in args.threads.split(",")):
            p = parts(path, spec, n, pin, args.reps)
            print(f"  r{r:<3} {n} threads: " + ", ".join(f"{k} {v:.0f}" for k, v in p.items()))
            store = HostAdapterStore(spec, torch.bfloat16, pin=pin, read_threads=n)
            store.register_path("x", path)
            for busy, switch in ((False, None), (True, None), (True, 5e-4), (True, 1e-4), (True, 2e-5)):
                l0, last, end = staged(store, busy, args.reps, switch)
                label = f" beside a busy thread, switch interval {1e3 * (switch or sys.getswitchinterval()):.2f} ms"
                print(f"      stager{label if busy else ''}: layer 0 {l0:.0f}, last layer {last:.0f}, end {end:.0f}")


if __name__ == "__main__":
    main()
