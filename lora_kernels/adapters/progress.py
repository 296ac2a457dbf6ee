"""`LayerProgress`: how many layers of an adapter's packed host buffer are in place, for a layer-wise load.

A host stage that reads layer by layer (`reader.read_packed(..., progress=p)`) publishes the buffer before
filling it (`p.packed`), then after each complete layer the count of complete layers into a pinned int32
(`p.flag`) and when (`p.times`, `time.monotonic` seconds). A layer-wise load (`AdapterLoader.load_async(...,
progress=p)`) can then enqueue every layer's copy at once: on a GPU, layer l's copy first waits, in the stream,
for the count to reach l + 1 (`wait_on_stream`: a stream memory operation, no kernel), so layer 0 crosses PCIe
while the host still reads layer 7, and a step that reads layer l waits only for layer l's copy. A failed
host stage stores `FAILED` (above any layer count), so no GPU wait can hang; the loader then fails the load.

Only reads that land in place report layer by layer. A read that needs a second pass over the buffer (a dtype
cast, a fused A written into several slices, a rescaled B, the finite check) completes every layer at once, at
its end.
"""

from __future__ import annotations

import threading
import time

import torch

FAILED = 1 << 30

try:  # the extension's stream wait (csrc/host/stream_wait.cpp)
    from lora_kernels._C import stream_wait_geq as _stream_wait_geq
except ImportError:
    _stream_wait_geq = None


class LayerProgress:
    """One host stage's layer count (see the module docstring). Thread-safe: the reader thread writes it, the
    scheduler thread reads it."""

    def __init__(self, layers: int, pin: bool):
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be a positive int, got {layers!r}")
        self.layers = layers
        self.flag = torch.zeros(1, dtype=torch.int32, pin_memory=pin)  # read by the GPU: kept alive by the loader
        self.times: list[float] = []
        self.packed = None  # the buffer, published before it is filled
        self.error: BaseException | None = None
        self._published = threading.Event()
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Layers in place now (FAILED after a failure)."""
        return int(self.flag[0])

    @property
    def failed(self) -> bool:
        return self.count >= FAILED

    def published(self) -> bool:
        return self._published.is_set()

    def publish(self, packed) -> None:
        """Hands out the buffer (not yet filled); a second call is a no-op."""
        with self._lock:
            if self.packed is None:
                self.packed = packed
        self._published.set()

    def reached(self, count: int, at: float | None = None) -> None:
        """Layers [0, count) are in place (at `at`, monotonic seconds; now by default)."""
        at = time.monotonic() if at is None else at
        with self._lock:
            cur = int(self.flag[0])
            if cur >= FAILED:
                return
            while len(self.times) < min(count, self.layers):
                self.times.append(at)
            self.flag[0] = max(cur, min(count, self.layers))

    def record(self, times) -> None:
        """Stamps from the native reader, which already stored the count into the flag as each layer completed."""
        with self._lock:
            self.times[len(self.times):] = list(times)[len(self.times):self.layers]

    def complete(self) -> None:
        self.reached(self.layers)

    def fail(self, error: BaseException | None = None) -> None:
        """Releases every GPU wait (the count jumps above any layer) and marks the stage failed."""
        with self._lock:
            self.error = error
            self.flag[0] = FAILED
        self._published.set()

    def wait_on_stream(self, layer: int, stream: torch.cuda.Stream) -> None:
        """`stream` waits, on the GPU, until layer `layer` is in place (or the stage failed); the host never
        waits. Raises RuntimeError where the driver has no stream memory operations."""
        if _stream_wait_geq is None:
            raise RuntimeError("layer-wise loads of a host stage still in flight need the CUDA extension "
                               "(stream_wait_geq)")
        _stream_wait_geq(stream.cuda_stream, self.flag.data_ptr(), layer + 1)
