"""The packed adapter byte layout and the copy plans that read it: the one place that knows both.

One adapter of rank r lives on the host in one contiguous buffer ("pool order"), each block starting on
a 256-byte boundary:

    [int32 rank][float32 scaling]                              -> pool.lora_ranks[slot], pool.scalings[slot]
    for layer in 0..L-1, for group in qkv, o, gate_up, down (if the adapter targets it):
        A block: [S*r, in_dim]  (slice i in rows [i*r, (i+1)*r))  -> pool lora_a[slot] rows [i*R, i*R + r)
        B block: [out_total, r]                               -> pool lora_b[slot][:, :r]

`PackedLayout` gives every block's offset; `PackedAdapter` is one adapter's buffer with views of its blocks
(`pack_adapter` fills it from `AdapterWeights`, `reader.read_packed` reads each file tensor straight into
it); `source_views` and `dest_plan` turn it into the loader's copy lists. Nothing else knows the layout.

Copy plan. When r equals the pool's max rank R every block is one contiguous copy (two per group). When
r < R, A slices are still contiguous in the pool (r of R rows each), but B's r columns are strided (rows
of R): B blocks are copied contiguously into a device staging buffer, ordered by group and then layer,
and one strided copy per group (`GpuAdapterPool.lora_b_stacked`, all layers at once: 4 launches per
load, not one per layer and group) scatters them into the slot. The loader runs those scatters on a side
stream while the A blocks are still being copied, so they cost no time on the load stream: a load moves
the adapter's own bytes and no padding.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from lora_kernels.adapters.peft import AdapterWeights
from lora_kernels.adapters.spec import ModelSpec

HEADER_BYTES = 8
ALIGN = 256

Key = tuple[int, str]  # (layer, group name)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def allocator_nbytes(nbytes: int, pinned: bool) -> int:
    """Bytes the allocator really holds for a request of `nbytes`: torch's caching pinned-host allocator
    rounds every request up to a power of two (its default; `pinned_max_round_threshold` is unlimited),
    the CPU allocator does not round."""
    if not pinned or nbytes <= 1:
        return max(nbytes, 0)
    return 1 << (nbytes - 1).bit_length()


@dataclass(frozen=True)
class Span:
    """One block of the packed buffer: `rows` x `cols` elements at byte `offset`."""

    offset: int
    rows: int
    cols: int
    esize: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.esize

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """This block's bytes of `buffer` (uint8)."""
        return buffer[self.offset:self.offset + self.nbytes]


@dataclass(frozen=True)
class PackedLayout:
    """Where each block of an adapter of rank `rank` over blocks `keys` lies in its packed buffer."""

    rank: int
    esize: int
    keys: tuple[Key, ...]
    a: dict[Key, Span] = field(compare=False)
    b: dict[Key, Span] = field(compare=False)
    nbytes: int = 0

    @property
    def payload_bytes(self) -> int:
        """Bytes a load moves: the header plus every block (alignment padding excluded)."""
        return HEADER_BYTES + sum(s.nbytes for d in (self.a, self.b) for s in d.values())


@functools.lru_cache(maxsize=256)
def packed_layout(spec: ModelSpec, rank: int, keys: tuple[Key, ...], esize: int) -> PackedLayout:
    """The layout of an adapter of `rank` holding blocks `keys` (pool order) with `esize`-byte elements."""
    a, b = {}, {}
    off = align(HEADER_BYTES)
    for key in keys:
        g = spec.group(key[1])
        a[key] = Span(off, g.num_slices * rank, g.in_dim, esize)
        off = align(off + a[key].nbytes)
        b[key] = Span(off, g.out_total, rank, esize)
        off = align(off + b[key].nbytes)
    return PackedLayout(rank, esize, keys, a, b, off)


def write_header(buffer: torch.Tensor, rank: int, scaling: float) -> float:
    """Writes (rank, scaling) into the buffer's header; returns the scaling as stored (float32)."""
    header = buffer[:HEADER_BYTES].numpy()  # numpy: no torch op per scalar on the host stage's path
    header[:4].view(np.int32)[0] = rank
    header[4:].view(np.float32)[0] = scaling
    return float(header[4:].view(np.float32)[0])


# ---- the packed buffer -------------------------------------------------------------------------------

class BlockViews(Mapping):
    """(layer, group) -> uint8 view of that block of a packed buffer, made on first access (a read that needs none
    of them, the common case, does not pay for ~14 tensor views per layer)."""

    def __init__(self, spans: dict, buffer: torch.Tensor):
        self._spans, self._buffer, self._views = spans, buffer, {}

    def __getitem__(self, key) -> torch.Tensor:
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = self._spans[key].view(self._buffer)
        return v

    def __iter__(self):
        return iter(self._spans)

    def __len__(self) -> int:
        return len(self._spans)


@dataclass(eq=False)
class PackedAdapter:
    """One adapter in one host buffer; `a`/`b` are uint8 views of its blocks, keyed (layer, group), in pool order."""

    adapter_id: str
    rank: int
    scaling: float
    dtype: torch.dtype
    buffer: torch.Tensor
    header: torch.Tensor
    blocks: PackedLayout
    plans: dict = field(default_factory=dict, repr=False)  # the loader's per-pool source lists, cached
    held_bytes: int = 0

    def __post_init__(self):
        self.a, self.b = BlockViews(self.blocks.a, self.buffer), BlockViews(self.blocks.b, self.buffer)

    @property
    def layout(self) -> tuple[tuple[int, str], ...]:
        """The (layer, group) blocks present, in pool order."""
        return self.blocks.keys

    @property
    def nbytes(self) -> int:
        """Host bytes this adapter costs: what the allocator holds for its buffer (rounded up when pinned)."""
        return self.held_bytes or self.buffer.numel()

    @property
    def payload_bytes(self) -> int:
        """Bytes a load moves: the header plus every block (alignment padding excluded)."""
        return self.blocks.payload_bytes


def alloc_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def held_nbytes(nbytes: int, pin: bool, arena=None) -> int:
    """Host bytes a packed buffer of `nbytes` holds: whole pages from an arena (`arena.PinnedArena`), else what
    torch's allocator holds (`allocator_nbytes`)."""
    return arena.held(nbytes) if arena is not None else allocator_nbytes(nbytes, pin)


def wrap_buffer(adapter_id: str, blocks: PackedLayout, buf: torch.Tensor, scaling: float, dtype: torch.dtype,
                pin: bool, held: int | None = None) -> PackedAdapter:
    """The `PackedAdapter` over a buffer laid out as `blocks` (header written here); held: the bytes it holds
    (default: what torch's allocator holds for it)."""
    stored = write_header(buf, blocks.rank, scaling)
    return PackedAdapter(adapter_id, blocks.rank, stored, dtype, buf, buf[:HEADER_BYTES], blocks=blocks,
                         held_bytes=allocator_nbytes(buf.numel(), pin) if held is None else held)


def new_packed(adapter_id: str, blocks: PackedLayout, scaling: float, dtype: torch.dtype, pin: bool,
               arena=None) -> PackedAdapter:
    """A `PackedAdapter` over a new buffer laid out as `blocks` (header written, blocks not): carved from `arena`
    when one is given and has room (returned to it when the adapter is collected), else from torch's allocator."""
    got = arena.alloc(blocks.nbytes) if arena is not None else None
    if got is None:
        return wrap_buffer(adapter_id, blocks, alloc_buffer(blocks.nbytes, pin), scaling, dtype, pin)
    packed = wrap_buffer(adapter_id, blocks, got[0], scaling, dtype, pin, held=arena.held(blocks.nbytes))
    arena.adopt(packed, got[1], blocks.nbytes)
    return packed


def pack_adapter(adapter_id: str, w: AdapterWeights, spec: ModelSpec, dtype: torch.dtype, pin: bool,
                 arena=None) -> PackedAdapter:
    """Packs `w` (converted to `dtype`) into one (pinned) uint8 buffer in pool order."""
    if w.spec != spec:
        raise ValueError(f"adapter {adapter_id!r} was read for {w.spec}, the store holds {spec}")
    keys = tuple((layer, g.name) for layer in range(spec.layers) for g in spec.groups if (layer, g.name) in w.lora_a)
    for key in keys:
        g = spec.group(key[1])
        a, b = w.lora_a[key], w.lora_b.get(key)
        want_a, want_b = (g.num_slices * w.rank, g.in_dim), (g.out_total, w.rank)
        if tuple(a.shape) != want_a or b is None or tuple(b.shape) != want_b:
            raise ValueError(f"adapter {adapter_id!r} layer {key[0]} {g.name}: lora_a {tuple(a.shape)} / lora_b "
                             f"{None if b is None else tuple(b.shape)}, expected {want_a} / {want_b}")
    esize = torch.empty((), dtype=dtype).element_size()
    blocks = packed_layout(spec, w.rank, keys, esize)
    p = new_packed(adapter_id, blocks, w.scaling, dtype, pin, arena)
    for key in keys:
        for view, t in ((p.a[key], w.lora_a[key]), (p.b[key], w.lora_b[key])):
            view.view(dtype).view(t.shape).copy_(t)
    return p


# ---- copy plans --------------------------------------------------------------------------------------------

def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _header_srcs(buffer: torch.Tensor) -> list[torch.Tensor]:
    return [buffer[:4], buffer[4:HEADER_BYTES]]


def _header_dsts(pool, slot: int) -> list[torch.Tensor]:
    return [_bytes(pool.lora_ranks[slot:slot + 1]), _bytes(pool.scalings[slot:slot + 1])]


def _a_slice_srcs(layout: PackedLayout, key: Key, buffer: torch.Tensor, num_slices: int) -> list[torch.Tensor]:
    """An A block's slices (r rows each) of the packed buffer: each lands in its own R-row slot range."""
    a = layout.a[key].view(buffer)
    step = a.numel() // num_slices
    return [a[i * step:(i + 1) * step] for i in range(num_slices)]


def _a_slice_dsts(pool, key: Key, slot: int, r: int, num_slices: int) -> list[torch.Tensor]:
    a, R = pool.lora_a[key[0]][key[1]][slot], pool.max_rank
    return [_bytes(a[i * R:i * R + r]) for i in range(num_slices)]


def source_views(layout: PackedLayout, buffer: torch.Tensor, spec: ModelSpec, max_rank: int) -> list[torch.Tensor]:
    """Host byte views of `buffer` in the copy order `dest_plan` uses for a pool of max rank `max_rank`."""
    r = layout.rank
    srcs = _header_srcs(buffer)
    if r == max_rank:
        for key in layout.keys:
            srcs += [layout.a[key].view(buffer), layout.b[key].view(buffer)]
        return srcs
    for key in _staging_order(layout.keys):  # B blocks first: their scatter overlaps the A copies
        srcs.append(layout.b[key].view(buffer))
    for key in layout.keys:
        srcs += _a_slice_srcs(layout, key, buffer, spec.group(key[1]).num_slices)
    return srcs


def _staging_order(keys: tuple[Key, ...]) -> list[Key]:
    """B blocks by group (spec order of first appearance), then layer: each group's blocks are adjacent."""
    groups = list(dict.fromkeys(g for _, g in keys))
    return sorted(keys, key=lambda k: (groups.index(k[1]), k[0]))


@dataclass
class DestPlan:
    """Device byte views in copy order; strided B scatters (dst, staging src) to run after the B copies;
    A views of untargeted groups to zero (a zero A row adds exactly 0 whatever stale B holds)."""

    dsts: list[torch.Tensor]
    scatter: list[tuple[torch.Tensor, torch.Tensor]]
    zero: list[torch.Tensor]
    split: int  # copies [0, split) are the header and the staged B blocks: the scatters wait for them only
    staged_bytes: int = 0


def staging_numel(spec: ModelSpec, rank: int) -> int:
    """Elements of a staging buffer that holds every B block of an adapter of rank `rank`."""
    return spec.layers * sum(g.out_total for g in spec.groups) * rank


def dest_plan(layout: PackedLayout, pool, slot: int, staging: torch.Tensor | None) -> DestPlan:
    """The pool-side half of a load of `layout` into `slot` (pairs with `source_views`)."""
    spec, r, R = pool.spec, layout.rank, pool.max_rank
    dsts = _header_dsts(pool, slot)
    present = set(layout.keys)
    zero = [pool.lora_a[layer][g.name][slot] for layer in range(spec.layers) for g in spec.groups
            if (layer, g.name) not in present]
    if r == R:
        for layer, g in layout.keys:
            dsts += [_bytes(pool.lora_a[layer][g][slot]), _bytes(pool.lora_b[layer][g][slot])]
        return DestPlan(dsts, [], zero, len(dsts))
    assert staging is not None, "an adapter below the pool's max rank needs the staging buffer"
    scatter, off = [], 0
    order = _staging_order(layout.keys)
    for gname in dict.fromkeys(g for _, g in order):
        layers = [layer for layer, g in order if g == gname]
        out = spec.group(gname).out_total
        st = staging[off:off + len(layers) * out * r].view(len(layers), out, r)
        off += st.numel()
        dsts += [_bytes(st[i]) for i in range(len(layers))]
        stacked = pool.lora_b_stacked[gname]
        if layers == list(range(spec.layers)):  # every layer: one strided copy for the whole group
            scatter.append((stacked[:, slot, :, :r], st))
        else:
            scatter += [(stacked[layer, slot, :, :r], st[i]) for i, layer in enumerate(layers)]
    split = len(dsts)
    for key in layout.keys:
        dsts += _a_slice_dsts(pool, key, slot, r, spec.group(key[1]).num_slices)
    return DestPlan(dsts, scatter, zero, split, off * staging.element_size())


# ---- layer-wise copy plans -----------------------------------------------------------------------------------

@dataclass
class LayerCopy:
    """One layer's share of a layer-wise load: host sources and device views in copy order; when r < R, copies
    [0, split) put the layer's B blocks into the staging buffer and `scatter` moves them into the slot's strided
    columns; `zero`: A of the layer's untargeted groups."""

    srcs: list[torch.Tensor]
    dsts: list[torch.Tensor]
    split: int
    scatter: list[tuple[torch.Tensor, torch.Tensor]]
    zero: list[torch.Tensor]


def header_copy(buffer: torch.Tensor, pool, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(sources, destinations) of the header: rank and scaling into the pool's per-slot entries."""
    return _header_srcs(buffer), _header_dsts(pool, slot)


def layer_copies(layout: PackedLayout, buffer: torch.Tensor, pool, slot: int,
                 staging: torch.Tensor | None) -> list[LayerCopy]:
    """A load of `layout` into `slot`, layer by layer (every layer of the pool's spec, in order). When r < R the
    staging buffer holds the B blocks layer-major and each block is scattered on its own (one copy per block,
    not per group as `dest_plan` does), so that layer l is complete without waiting for later layers."""
    spec, r, R = pool.spec, layout.rank, pool.max_rank
    present = set(layout.keys)
    by_layer: dict[int, list[Key]] = {}
    for key in layout.keys:
        by_layer.setdefault(key[0], []).append(key)
    if r < R:
        assert staging is not None, "an adapter below the pool's max rank needs the staging buffer"
    plans, off = [], 0
    for layer in range(spec.layers):
        keys = by_layer.get(layer, [])
        zero = [pool.lora_a[layer][g.name][slot] for g in spec.groups if (layer, g.name) not in present]
        srcs, dsts, scatter = [], [], []
        if r < R:
            for key in keys:
                out = spec.group(key[1]).out_total
                st = staging[off:off + out * r].view(out, r)
                off += out * r
                srcs.append(layout.b[key].view(buffer))
                dsts.append(_bytes(st))
                scatter.append((pool.lora_b_stacked[key[1]][layer, slot, :, :r], st))
        split = len(dsts)
        for key in keys:
            if r == R:
                srcs += [layout.a[key].view(buffer), layout.b[key].view(buffer)]
                dsts += [_bytes(pool.lora_a[layer][key[1]][slot]), _bytes(pool.lora_b[layer][key[1]][slot])]
                continue
            n = spec.group(key[1]).num_slices
            srcs += _a_slice_srcs(layout, key, buffer, n)
            dsts += _a_slice_dsts(pool, key, slot, r, n)
        plans.append(LayerCopy(srcs, dsts, split, scatter, zero))
    return plans
