"""`PinnedArena`: one pinned host allocation, reserved once, that the host store carves packed adapters from.

A cold adapter's host stage needs a pinned buffer of its packed size. torch's caching pinned allocator serves a
request from its cache when a freed block of the same rounded size (a power of two) is free, and otherwise calls
`cudaHostAlloc`, which pins fresh pages: in bench_serving's zipf:1.5 runs on the H200 host that took 24-87 ms in
one cold stage in ten (median 0.013 ms), while the stage's read takes 0.2-2.5 ms. An arena pins its bytes once, when
the engine sets its host budget (`HostAdapterStore.reserve_pinned`), and every later buffer is a view of it: no
pinning on the hot path, and the store's budget counts the bytes held exactly (page-aligned sizes, no rounding to a
power of two).

Allocation is first fit over a list of free ranges, coalesced on release. A buffer goes back when its
`PackedAdapter` is collected (`adopt`): whoever reads the bytes holds the adapter (the loader keeps it until its
copies complete), never a bare view of it. When no free range fits, `alloc` returns None and the caller takes a
buffer from torch's allocator (counted in `stats["misses"]`): the arena bounds the time of an allocation, never
whether it succeeds.
"""

from __future__ import annotations

import bisect
import threading
import weakref

import torch

PAGE = 4096


class PinnedArena:
    def __init__(self, nbytes: int, pin: bool):
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < PAGE:
            raise ValueError(f"PinnedArena needs nbytes >= {PAGE}, got {nbytes!r}")
        self.nbytes = self.held(nbytes)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self._starts = [0]  # free ranges, sorted by start; _sizes[i] is the size of the range at _starts[i]
        self._sizes = [self.nbytes]
        self._lock = threading.Lock()
        self.stats = {"allocs": 0, "misses": 0, "in_use": 0}

    @staticmethod
    def held(nbytes: int) -> int:
        """Bytes an allocation of `nbytes` holds in an arena (whole pages)."""
        return max(PAGE, (nbytes + PAGE - 1) // PAGE * PAGE)

    def alloc(self, nbytes: int) -> tuple[torch.Tensor, int] | None:
        """(a view of `nbytes` bytes, its offset), or None when no free range fits (a miss)."""
        size = self.held(nbytes)
        with self._lock:
            i = next((k for k, s in enumerate(self._sizes) if s >= size), None)
            if i is None:
                self.stats["misses"] += 1
                return None
            off = self._starts[i]
            if self._sizes[i] == size:
                del self._starts[i], self._sizes[i]
            else:
                self._starts[i] += size
                self._sizes[i] -= size
            self.stats["allocs"] += 1
            self.stats["in_use"] += size
        return self.buffer[off:off + nbytes], off

    def release(self, offset: int, nbytes: int) -> None:
        """Returns the range of an allocation of `nbytes` at `offset`, merged with its free neighbours."""
        size = self.held(nbytes)
        with self._lock:
            i = bisect.bisect_left(self._starts, offset)
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] > offset or (
                    i < len(self._starts) and offset + size > self._starts[i]):
                raise RuntimeError(f"PinnedArena.release({offset}, {nbytes}): the range is already free")
            self._starts.insert(i, offset)
            self._sizes.insert(i, size)
            if i + 1 < len(self._starts) and offset + size == self._starts[i + 1]:  # merge the next range
                self._sizes[i] += self._sizes.pop(i + 1)
                self._starts.pop(i + 1)
            if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == offset:  # merge into the previous range
                self._sizes[i - 1] += self._sizes.pop(i)
                self._starts.pop(i)
            self.stats["in_use"] -= size

    def adopt(self, owner, offset: int, nbytes: int) -> None:
        """Releases the range when `owner` (the `PackedAdapter` over it) is collected."""
        weakref.finalize(owner, self.release, offset, nbytes)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes)
