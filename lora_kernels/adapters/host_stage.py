"""`HostStager`: the host stage of an adapter load — PEFT folder on disk to a packed (pinned) host buffer —
on a background thread.

A serving engine keeps N adapters as PEFT folders on disk, a byte-bounded LRU `HostAdapterStore` of
packed buffers, and a few GPU slots. Loading a cold adapter is two stages: the host stage (read and
read each tensor of the safetensors file straight into its place in the packed pinned buffer, one pass:
`reader.read_packed`) and the H2D copy (`AdapterLoader.load_async(id, packed=...)` on the loader's side
stream). The stager runs host stages on N worker threads (default min(4, cores)), so the scheduler thread
never reads a file and several cold adapters are read at once:

    stage = stager.submit("adapter_007")      # returns at once
    ...                                        # the scheduler keeps running steps
    loader.load_async("adapter_007", packed=stage.result())

- `submit(id)`: a store hit completes at once on the caller's thread (`store.lookup`, no read); a
  miss queues `store.get(id)` on the worker; a second submit of an id whose read is in flight joins it.
- `stage.result()` is the `PackedAdapter` (it re-raises the worker's error, e.g. AdapterFormatError
  naming the file); `stage.cold` is True for the submit that started the read, and `stage.seconds` is
  that read's wall time (0.0 for hits and joins, so no read is counted twice), from its submit when a
  worker was idle (waking the worker, which takes the GIL, is part of the cost), else from the
  worker's start. Wall time, not CPU time: waiting on the disk is part of the cost.
- The stage holds its `PackedAdapter`: if the store drops it (LRU) before the H2D copy is issued, the
  buffer stays alive and the copy is still right.
- Layer-wise (`HostStager(..., layerwise=True)`): a cold read reports each layer as it lands
  (`stage.progress`, a `LayerProgress`; `stage.layer_seconds` once done). Its buffer is published before it
  is filled, so a loader can enqueue the copies of a read still in flight (`AdapterLoader.load_async(...,
  progress=stage.progress)`), each layer's copy waiting on the GPU for its layer. With the extension, a
  layer-wise read starts on the submitting thread and runs on the extension's reader threads (`store.start_get`):
  the first byte moves before `submit` returns, with no worker waiting for the GIL first, and the stage is timed
  from its submit; the worker then only ends it (`store.finish_get`). Such reads do not queue behind the workers.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Hashable

from lora_kernels.adapters.host_store import HostAdapterStore, PackedAdapter
from lora_kernels.adapters.progress import LayerProgress


class HostStage:
    """One submit's view of a host stage (see the module docstring)."""

    def __init__(self, adapter_id: Hashable, future: Future, cold: bool, progress: LayerProgress | None = None):
        self.adapter_id, self.future, self.cold, self.progress = adapter_id, future, cold, progress
        self._seconds = 0.0
        self._t0 = 0.0  # monotonic start of the read: its submit when a worker was idle, else the worker's start
        self._submitted: float | None = None  # set when an idle worker takes it: the hand-off counts as its time

    @property
    def layer_seconds(self) -> tuple[float, ...] | None:
        """When each layer of a layer-wise read was in place, seconds from the read's start (valid once done; each
        at most `seconds`: the stage ends after its last layer, with the store's bookkeeping); None unless this
        submit started a layer-wise read that succeeded."""
        p = self.progress
        if not self.cold or p is None or p.failed or len(p.times) < p.layers:
            return None
        return tuple(min(max(t - self._t0, 0.0), self._seconds) for t in p.times)

    @property
    def seconds(self) -> float:
        """Wall time of the read on the worker (valid once done); 0.0 unless this submit started it."""
        return self._seconds if self.cold else 0.0

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> PackedAdapter:
        return self.future.result(timeout)


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class HostStager:
    """Runs `store.get` of cold adapters on `workers` threads (default min(4, cores)); thread-safe `submit`.
    layerwise: cold reads report each layer (`HostStage.progress`)."""

    def __init__(self, store: HostAdapterStore, workers: int | None = None, layerwise: bool = False):
        workers = default_workers() if workers is None else workers
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        self.store, self.workers, self.layerwise = store, workers, layerwise
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lora-host-stage")
        self._lock = threading.Lock()
        self._inflight: dict[Hashable, HostStage] = {}
        self._running = 0  # cold reads submitted and not finished
        self.stats = {"hits": 0, "reads": 0, "joins": 0, "errors": 0, "read_s": 0.0}

    def submit(self, adapter_id: Hashable) -> HostStage:
        t_submit = time.monotonic()  # a read started here is timed from now (its progress made below included)
        with self._lock:
            running = self._inflight.get(adapter_id)
            if running is not None and not running.done():
                self.stats["joins"] += 1
                return HostStage(adapter_id, running.future, cold=False)
            packed = self.store.lookup(adapter_id)
            if packed is not None:
                self.stats["hits"] += 1
                done: Future = Future()
                done.set_result(packed)
                return HostStage(adapter_id, done, cold=False)
            progress = LayerProgress(self.store.spec.layers, self.store.pin) if self.layerwise else None
            stage = HostStage(adapter_id, Future(), cold=True, progress=progress)
            if self._running < self.workers:  # an idle worker takes it now: waking it is part of the stage
                stage._submitted = time.monotonic()
            self._running += 1
            self._inflight[adapter_id] = stage
        started = self._start(stage, t_submit) if progress is not None else None
        self._pool.submit(self._read, stage, started)
        return stage

    def _start(self, stage: HostStage, t: float):
        """A layer-wise read started here, on the submitting thread (`store.start_get`): no worker's GIL hand-off
        comes before its first byte. The stage is then timed from its submit (`t`). Returns what `_read` finishes:
        a `reader.PendingRead`, a packed adapter (a hit), None (the worker does the whole stage) or the error."""
        try:
            started = self.store.start_get(stage.adapter_id, stage.progress)
        except Exception as e:  # delivered by the worker, which owns the stage's end
            started = e
        if started is not None:
            stage._submitted = t
        return started

    def _read(self, stage: HostStage, started=None) -> None:
        t0 = stage._t0 = stage._submitted if stage._submitted is not None else time.monotonic()
        packed, error = None, None
        try:
            p = stage.progress
            if isinstance(started, BaseException):
                raise started
            if isinstance(started, PackedAdapter):
                packed = started
            elif started is not None:
                packed = self.store.finish_get(stage.adapter_id, started)
            else:
                packed = self.store.get(stage.adapter_id) if p is None else self.store.get(stage.adapter_id, progress=p)
        except BaseException as e:  # delivered to whoever waits on the stage
            error = e
            if stage.progress is not None:
                stage.progress.fail(e)  # releases any GPU wait on it
        del started
        stage._seconds = time.monotonic() - t0
        # Out of the in-flight table before the waiter wakes: a done stage is never found there (a later
        # submit of the id then hits the store, or reads again after an error).
        with self._lock:
            self._running -= 1
            if self._inflight.get(stage.adapter_id) is stage:
                del self._inflight[stage.adapter_id]
            if error is None:
                self.stats["reads"] += 1
                self.stats["read_s"] += stage._seconds
            else:
                self.stats["errors"] += 1
        if error is None:
            stage.future.set_result(packed)
        else:
            stage.future.set_exception(error)

    def close(self) -> None:
        """Waits for the reads in flight and stops the worker."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "HostStager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
