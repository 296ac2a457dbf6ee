"""Host-side adapter store: each adapter packed once into one contiguous pinned buffer, LRU by bytes.

Buffer layout ("pool order"), all at the adapter's own rank r, each block starting on a 256-byte
boundary:

    [int32 rank][float32 scaling]                              -> pool.lora_ranks[slot], pool.scalings[slot]
    for layer in 0..L-1, for group in qkv, o, gate_up, down (if targeted):
        A block: [S*r, in_dim]  (slice i in rows [i*r, (i+1)*r))  -> pool lora_a[slot] rows [i*R, i*R + r)
        B block: [out_total, r]                               -> pool lora_b[slot][:, :r]

so a load is one batched call of a few large copies (two per group when r equals the pool's max
rank). Registration is thread-safe (packing runs outside the lock). An adapter dropped from the
store while a load still reads its buffer stays alive: the loader holds the `PackedAdapter` until
its load event completes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_kernels.adapters.peft import AdapterWeights, load_peft_adapter
from lora_kernels.adapters.spec import ModelSpec

HEADER_BYTES = 8
ALIGN = 256


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class PackedAdapter:
    """One adapter in one host buffer; `a`/`b` are uint8 views of its blocks, keyed (layer, group), in pool order."""

    adapter_id: str
    rank: int
    scaling: float
    dtype: torch.dtype
    buffer: torch.Tensor
    header: torch.Tensor
    a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    plans: dict = field(default_factory=dict, repr=False)  # the loader's per-pool source lists, cached

    @property
    def layout(self) -> tuple[tuple[int, str], ...]:
        """The (layer, group) blocks present, in pool order."""
        return tuple(self.a)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def payload_bytes(self) -> int:
        """Bytes a load moves: the header plus every block (alignment padding excluded)."""
        return HEADER_BYTES + sum(v.numel() for d in (self.a, self.b) for v in d.values())


def pack_adapter(adapter_id: str, w: AdapterWeights, spec: ModelSpec, dtype: torch.dtype, pin: bool) -> PackedAdapter:
    """Packs `w` (converted to `dtype`) into one (pinned) uint8 buffer in pool order."""
    if w.spec != spec:
        raise ValueError(f"adapter {adapter_id!r} was read for {w.spec}, the store holds {spec}")
    esize = torch.empty((), dtype=dtype).element_size()
    layout = []  # (key, kind, offset, tensor)
    off = _align(HEADER_BYTES)
    for layer in range(spec.layers):
        for g in spec.groups:
            key = (layer, g.name)
            if key not in w.lora_a:
                continue
            a, b = w.lora_a[key], w.lora_b.get(key)
            want_a, want_b = (g.num_slices * w.rank, g.in_dim), (g.out_total, w.rank)
            if tuple(a.shape) != want_a or b is None or tuple(b.shape) != want_b:
                raise ValueError(f"adapter {adapter_id!r} layer {layer} {g.name}: lora_a {tuple(a.shape)} / lora_b "
                                 f"{None if b is None else tuple(b.shape)}, expected {want_a} / {want_b}")
            for kind, t in (("a", a), ("b", b)):
                layout.append((key, kind, off, t))
                off = _align(off + t.numel() * esize)
    buf = torch.empty(off, dtype=torch.uint8, pin_memory=pin)
    header = buf[:HEADER_BYTES]
    header[:4].view(torch.int32)[0] = w.rank
    header[4:].view(torch.float32)[0] = w.scaling
    p = PackedAdapter(adapter_id, w.rank, float(header[4:].view(torch.float32)[0]), dtype, buf, header)
    for key, kind, o, t in layout:
        n = t.numel() * esize
        view = buf[o:o + n]
        view.view(dtype).view(t.shape).copy_(t)
        getattr(p, kind)[key] = view
    return p


class HostAdapterStore:
    """Packed adapters by id, bounded by `capacity_bytes` (None = unbounded), least recently used dropped first.

    `register(id, weights)` packs now; `register_path(id, path)` records a PEFT folder that is read and
    packed on first `get` (and again after being dropped). `get(id)` marks the adapter recently used;
    `lookup(id)` does too but never reads (None when not packed). A serving engine runs the reading
    `get` of a cold adapter off its scheduler thread (`host_stage.HostStager`).
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.bfloat16, capacity_bytes: int | None = None,
                 pin: bool | None = None, max_rank: int | None = None):
        self.spec = spec
        self.dtype = dtype
        self.capacity_bytes = capacity_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.max_rank = max_rank
        self._lock = threading.Lock()
        self._packed: OrderedDict[str, PackedAdapter] = OrderedDict()
        self._paths: dict[str, Path] = {}
        self._bytes = 0
        self.stats = {"packs": 0, "drops": 0}

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
        packed = pack_adapter(adapter_id, weights, self.spec, self.dtype, self.pin)
        self._insert(packed)
        return packed

    def register_path(self, adapter_id: str, path: str | Path) -> None:
        with self._lock:
            self._paths[adapter_id] = Path(path)

    def lookup(self, adapter_id: str) -> PackedAdapter | None:
        """The packed adapter if the store holds it (marked recently used), else None; never reads a folder."""
        with self._lock:
            packed = self._packed.get(adapter_id)
            if packed is not None:
                self._packed.move_to_end(adapter_id)
            return packed

    def packed_ids(self) -> list[str]:
        """Ids of the adapters held packed now, least recently used first."""
        with self._lock:
            return list(self._packed)

    def get(self, adapter_id: str) -> PackedAdapter:
        with self._lock:
            packed = self._packed.get(adapter_id)
            if packed is not None:
                self._packed.move_to_end(adapter_id)
                return packed
            path = self._paths.get(adapter_id)
        if path is None:
            raise KeyError(f"adapter {adapter_id!r} is not in the host store (register it first)")
        w = load_peft_adapter(path, self.spec, dtype=self.dtype, max_rank=self.max_rank)
        return self.register(adapter_id, w)

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
            raise ValueError(f"adapter {packed.adapter_id!r} needs {packed.nbytes} bytes, above the store's "
                             f"capacity_bytes={self.capacity_bytes}")
        with self._lock:
            self._drop_locked(packed.adapter_id)
            self._packed[packed.adapter_id] = packed
            self._bytes += packed.nbytes
            self.stats["packs"] += 1
            while self.capacity_bytes is not None and self._bytes > self.capacity_bytes:
                self._drop_locked(next(iter(self._packed)))
