"""Host-side adapter store: each adapter packed once into one contiguous pinned buffer, LRU by bytes.

The buffer's byte layout, the `PackedAdapter` over it, packing, and the copy plans that read it live in
`layout.py`. An adapter registered as a
PEFT folder is read by `reader.read_packed`: each tensor of the safetensors file straight into its place
in the buffer, in one pass. Registration is thread-safe (reading and packing run outside the lock). An
adapter dropped from the store while a load still reads its buffer stays alive: the loader holds the
`PackedAdapter` until its load event completes.

Bytes: the budget counts what the allocator really holds for each buffer (`layout.allocator_nbytes`: torch's
pinned allocator rounds every request up to a power of two), not the bytes requested. A store given a pinned arena
(`reserve_pinned`, `arena.py`) carves its buffers from it instead: no page pinning on a cold read, and a buffer
holds its bytes rounded up to whole pages.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch

# The packed buffer and its packing live in layout.py; re-exported here, where callers found them first.
from lora_kernels.adapters import layout as lay
from lora_kernels.adapters.arena import PinnedArena
from lora_kernels.adapters.layout import HEADER_BYTES, PackedAdapter, alloc_buffer, pack_adapter
from lora_kernels.adapters.peft import AdapterWeights
from lora_kernels.adapters.spec import ModelSpec
from lora_kernels.adapters.tp import full_spec, shard_spec

__all__ = ["HEADER_BYTES", "HostAdapterStore", "PackedAdapter", "alloc_buffer", "pack_adapter"]


class HostAdapterStore:
    """Packed adapters by id, bounded by `capacity_bytes` (None = unbounded), least recently used dropped first.

    `register(id, weights)` packs now; `register_path(id, path)` checks and plans a PEFT folder (header only)
    that is read and packed on first `get` (and again after being dropped). `get(id)` marks the adapter recently used;
    `lookup(id)` does too but never reads (None when not packed). A serving engine runs the reading
    `get` of a cold adapter off its scheduler thread (`host_stage.HostStager`).
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.bfloat16, capacity_bytes: int | None = None,
                 pin: bool | None = None, max_rank: int | None = None, check_finite: bool = False,
                 read_threads: int | None = None, tp_rank: int = 0, tp_size: int = 1):
        if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool)
                                           or capacity_bytes < 1):
            raise ValueError(f"capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
        self.spec = shard_spec(spec, tp_rank, tp_size)  # a TP rank packs only its shard (adapters/tp.py)
        self.dtype = dtype
        self.capacity_bytes = capacity_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.max_rank = max_rank
        # A finite check reads every byte again (aminmax): off by default on the host stage's hot path;
        # `load_peft_adapter` always checks.
        self.check_finite = check_finite
        # Threads per read: from the page cache one thread copies a few GB/s (H200 host, 16 cores, rank 64 layer by
        # layer: 4 threads 4.2 ms, 8 threads 1.9-2.8 ms, 16 threads 1.9 ms, and 2.5 against 3.5 ms beside a busy Python
        # thread; `bench/profile/host_stage_parts.py`).
        self.read_threads = read_threads if read_threads is not None else max(1, min(16, os.cpu_count() or 1))
        self._lock = threading.Lock()
        self._packed: OrderedDict[str, PackedAdapter] = OrderedDict()
        self._paths: dict[str, Path] = {}
        self._bytes = 0
        self.arena: PinnedArena | None = None
        self.stats = {"packs": 0, "drops": 0}

    def reserve_pinned(self, nbytes: int) -> PinnedArena:
        """Pins `nbytes` once now and carves every later buffer from them (`arena.PinnedArena`; a buffer that does
        not fit comes from torch's allocator). Size it to `capacity_bytes` plus the adapters a serving engine holds
        beyond the budget at once (loads and reads in flight). Buffers packed before keep their memory."""
        self.arena = PinnedArena(nbytes, self.pin)
        return self.arena

    def held_nbytes(self, nbytes: int) -> int:
        """Bytes a buffer of `nbytes` holds in this store (an arena's pages, or torch's allocator rounding)."""
        return lay.held_nbytes(nbytes, self.pin, self.arena)

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._packed or adapter_id in self._paths

    def __len__(self) -> int:
        with self._lock:
            return len(self._packed.keys() | self._paths.keys())

    @property
    def resident_bytes(self) -> int:
        return self._bytes

    def is_packed(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._packed

    def register(self, adapter_id: str, weights: AdapterWeights) -> PackedAdapter:
        if self.max_rank is not None and weights.rank > self.max_rank:
            raise ValueError(f"adapter {adapter_id!r} has rank {weights.rank}, above the pool's max rank "
                             f"{self.max_rank}")
        packed = pack_adapter(adapter_id, weights, self.spec, self.dtype, self.pin, self.arena)
        self._insert(packed)
        return packed

    def register_path(self, adapter_id: str, path: str | Path, check: bool = True) -> None:
        """Records a PEFT folder for `adapter_id`. check (default): plan it now (config and safetensors header
        parsed and checked, ~1 ms for 8 Llama layers; no tensor data read), so that a bad folder raises
        AdapterFormatError naming the adapter and its file here, and the first `get` (a cold request's host
        stage) finds the plan cached and skips the parse. The plan is re-validated at every read (its cache key
        is the config's and header's bytes and the file size), so a folder changed later still fails its read."""
        if check:
            from lora_kernels.adapters.peft import AdapterFormatError, plan_peft_adapter

            try:
                plan_peft_adapter(path, full_spec(self.spec), max_rank=self.max_rank)
            except AdapterFormatError as e:
                raise AdapterFormatError(f"adapter {adapter_id!r}: {e}") from None
        with self._lock:
            self._paths[adapter_id] = Path(path)

    def lookup(self, adapter_id: str) -> PackedAdapter | None:
        """The packed adapter if the store holds it (marked recently used), else None; never reads a folder."""
        with self._lock:
            packed = self._packed.get(adapter_id)
            if packed is not None:
                self._packed.move_to_end(adapter_id)
            return packed

    def demote(self, adapter_id: str) -> None:
        """Marks the adapter the first to drop (a no-op when not packed): the loader calls it once the adapter is
        on the GPU, so that host memory goes to adapters the GPU does not hold."""
        with self._lock:
            if adapter_id in self._packed:
                self._packed.move_to_end(adapter_id, last=False)

    def packed_ids(self) -> list[str]:
        """Ids of the adapters held packed now, least recently used first."""
        with self._lock:
            return list(self._packed)

    def get(self, adapter_id: str, progress=None) -> PackedAdapter:
        """The packed adapter, reading and packing its folder first when the store does not hold it.

        Raises KeyError for an unknown id, ValueError when the adapter alone needs more than
        `capacity_bytes` (checked from the file's header, before any allocation or read), and
        AdapterFormatError naming the adapter and its file when the folder is missing or bad.
        progress: a `LayerProgress` the read publishes its buffer and each complete layer to (a store hit
        publishes the held buffer, complete)."""
        from lora_kernels.adapters.reader import read_packed

        held, path = self._held(adapter_id, progress)
        if held is not None:
            return held
        with _named(adapter_id):
            plan = self._checked_plan(adapter_id, path)
            packed = read_packed(adapter_id, path, self.spec, self.dtype, pin=self.pin, plan=plan,
                                 check_finite=self.check_finite, read_threads=self.read_threads, progress=progress,
                                 arena=self.arena)
        self._insert(packed)
        return packed

    def start_get(self, adapter_id: str, progress):
        """`get(adapter_id, progress)` begun on the caller's thread for a layer-wise host stage: the held adapter (a
        hit, published complete), or its read started on the extension's reader threads (a `reader.PendingRead`,
        ended by `finish_get`), or None where such a read cannot run (then `get` does the whole stage). Raises
        what `get` raises for errors found before the read (unknown id, capacity, a bad header)."""
        from lora_kernels.adapters.reader import start_packed

        held, path = self._held(adapter_id, progress)
        if held is not None:
            return held
        with _named(adapter_id):
            plan = self._checked_plan(adapter_id, path)
            return start_packed(adapter_id, self.spec, self.dtype, pin=self.pin, plan=plan,
                                read_threads=self.read_threads, progress=progress, arena=self.arena,
                                check_finite=self.check_finite)

    def finish_get(self, adapter_id: str, pending) -> PackedAdapter:
        """Waits for a read begun by `start_get` and holds its adapter; raises its AdapterFormatError, naming the
        adapter and its file."""
        with _named(adapter_id):
            packed = pending.wait()
        self._insert(packed)
        return packed

    def _held(self, adapter_id: str, progress) -> tuple[PackedAdapter | None, Path]:
        """(the held adapter, marked recently used and published to progress, None) or (None, its folder)."""
        with self._lock:
            packed = self._packed.get(adapter_id)
            if packed is not None:
                self._packed.move_to_end(adapter_id)
                if progress is not None:
                    progress.publish(packed)
                    progress.complete()
                return packed, None
            path = self._paths.get(adapter_id)
        if path is None:
            raise KeyError(f"adapter {adapter_id!r} is not in the host store (register it first)")
        return None, path

    def _checked_plan(self, adapter_id: str, path: Path):
        """The folder's read plan, checked against the spec and the store's capacity (before any allocation)."""
        from lora_kernels.adapters.peft import plan_peft_adapter
        from lora_kernels.adapters.reader import planned_nbytes

        plan = plan_peft_adapter(path, full_spec(self.spec), max_rank=self.max_rank)  # checks: the full model
        need = planned_nbytes(plan, self.spec, self.dtype, self.pin, self.arena)
        if self.capacity_bytes is not None and need > self.capacity_bytes:
            raise ValueError(f"adapter {adapter_id!r} ({path}) needs {need} bytes of host memory, above the "
                             f"store's capacity_bytes={self.capacity_bytes}")
        return plan

    def drop(self, adapter_id: str) -> None:
        """Forgets the packed buffer (a registered path stays and is re-read on the next get)."""
        with self._lock:
            self._drop_locked(adapter_id)

    def _drop_locked(self, adapter_id: str) -> None:
        packed = self._packed.pop(adapter_id, None)
        if packed is not None:
            self._bytes -= packed.nbytes
            self.stats["drops"] += 1

    def _insert(self, packed: PackedAdapter) -> None:
        if self.capacity_bytes is not None and packed.nbytes > self.capacity_bytes:
            raise ValueError(f"adapter {packed.adapter_id!r} needs {packed.nbytes} bytes of host memory, above the "
                             f"store's capacity_bytes={self.capacity_bytes}")
        with self._lock:
            self._drop_locked(packed.adapter_id)
            self._packed[packed.adapter_id] = packed
            self._bytes += packed.nbytes
            self.stats["packs"] += 1
            while self.capacity_bytes is not None and self._bytes > self.capacity_bytes:
                self._drop_locked(next(iter(self._packed)))


@contextlib.contextmanager
def _named(adapter_id: str):
    """Re-raises an AdapterFormatError with the adapter's id in front (its text already names the file)."""
    from lora_kernels.adapters.peft import AdapterFormatError

    try:
        yield
    except AdapterFormatError as e:
        raise AdapterFormatError(f"adapter {adapter_id!r}: {e}") from None
