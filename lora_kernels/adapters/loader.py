"""`AdapterLoader`: moves packed adapters from the host store into pool slots on a side stream.

Ordering, all on the GPU (the host never waits):
- a load of slot s runs on `load_stream` after waiting on the events recorded at s's releases
  (the compute streams' last use of the old adapter), then records a load event;
- `acquire(ids)` makes the current (compute) stream wait on the load events still pending;
- `release(ids)` records an event on the current stream; the slot becomes evictable when no
  acquire is outstanding, and a later load into it waits on that event.
Eviction picks the least recently used slot that is neither acquired nor still loading (an event
query, never a wait). A load copies the header (rank, scaling) and the blocks with `batched_h2d_copy`
following the copy plan of `layout.py`; when the adapter's rank r is below the pool's R, B blocks land in
a device staging buffer first and one strided copy per group scatters them into the slot on a side
stream while the A blocks are still copying. The load's completion event is recorded on the scatter stream
after both; the load stream never waits for a scatter except to reuse a staging buffer (two of them,
alternating): a scatter kernel can queue behind compute kernels for a whole GEMM, and loads issued back to
back must not queue with it;
groups the adapter does not target get their A rows zeroed. With a CPU pool every copy is synchronous
and no events exist. Not thread-safe: call it from the scheduler's thread.

References: the loader holds a load's `PackedAdapter` (its pinned source) until the load's event has
completed, and drops it at the next event query that sees it complete (`is_loading`, `load_async`,
`acquire`, `loading_ids`): nothing else keeps host buffers alive.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable

import torch

from lora_kernels.adapters import layout as lay
from lora_kernels.adapters.h2d import batched_h2d_copy
from lora_kernels.adapters.host_store import HostAdapterStore
from lora_kernels.adapters.layout import PackedAdapter
from lora_kernels.adapters.pool import GpuAdapterPool
from lora_kernels.adapters.progress import LayerProgress

_PLAN_CACHE_MAX = 512


_STAGING_BUFFERS = 2  # a load's B copies go to the buffer whose scatter is the older one


class _CopyIssuer:
    """Issues one load's copies (the layout's copy plan) on the load stream; owns the plan cache, the
    device staging buffers and the scatter stream."""

    def __init__(self, pool: GpuAdapterPool, load_stream, backend: str):
        self.pool, self.load_stream, self.backend = pool, load_stream, backend
        # High priority: the scatter kernels are a load's only SM work; queued behind a compute kernel's CTAs they
        # would end the load long after its copies (H200: 73.9% of the load hidden at r < R against 99.3% at r = R).
        self.scatter_stream = (torch.cuda.Stream(pool.device, priority=-1) if load_stream is not None else None)
        self._staging: list[torch.Tensor | None] = [None] * _STAGING_BUFFERS
        self._staging_free: list[torch.cuda.Event | None] = [None] * _STAGING_BUFFERS  # its last scatter's end
        self._staging_next = 0
        self._dst_plans: dict = {}

    def sources(self, packed: PackedAdapter) -> list[torch.Tensor]:
        """Host byte views in copy order (cached on the packed adapter per pool rank)."""
        R = self.pool.max_rank
        plan = packed.plans.get(R)
        if plan is None:
            plan = packed.plans[R] = lay.source_views(packed.blocks, packed.buffer, self.pool.spec, R)
        return plan

    def dests(self, slot: int, packed: PackedAdapter, buf: int = 0) -> lay.DestPlan:
        key = (slot, packed.rank, packed.layout, buf)
        plan = self._dst_plans.get(key)
        if plan is None:
            staging = self._staging_buffer(buf, packed.rank) if packed.rank < self.pool.max_rank else None
            plan = lay.dest_plan(packed.blocks, self.pool, slot, staging)
            if len(self._dst_plans) >= _PLAN_CACHE_MAX:
                self._dst_plans.clear()
            self._dst_plans[key] = plan
        return plan

    def _next_staging(self, rank: int) -> int:
        """The staging buffer a load of `rank` writes its B blocks to: the one whose scatter is the older (0 when
        it has none to stage, or on a CPU pool, where copies are synchronous)."""
        if rank >= self.pool.max_rank or self.load_stream is None:
            return 0
        buf, self._staging_next = self._staging_next, (self._staging_next + 1) % _STAGING_BUFFERS
        return buf

    def issue(self, slot: int, packed: PackedAdapter, waits: Iterable[torch.cuda.Event]):
        """Enqueues the load; returns its completion event (None for a CPU pool: the copies are done)."""
        buf = self._next_staging(packed.rank)
        srcs, plan = self.sources(packed), self.dests(slot, packed, buf)
        if self.load_stream is None:
            batched_h2d_copy(srcs, plan.dsts, backend=self.backend, check=False)
            self._scatter_and_zero(plan)
            return None
        stream = self.load_stream
        with torch.cuda.stream(stream):
            for ev in waits:
                stream.wait_event(ev)
            if not plan.scatter:
                batched_h2d_copy(srcs, plan.dsts, stream, backend=self.backend, check=False)
                for t in plan.zero:
                    t.zero_()
                done = torch.cuda.Event(enable_timing=True)  # timing: serve-sim charges the load's span
                done.record(stream)
                return done
            if self._staging_free[buf] is not None:  # the scatter that last read this buffer
                stream.wait_event(self._staging_free[buf])
            k = plan.split
            batched_h2d_copy(srcs[:k], plan.dsts[:k], stream, backend=self.backend, check=False)
            staged = torch.cuda.Event()
            staged.record(stream)
            batched_h2d_copy(srcs[k:], plan.dsts[k:], stream, backend=self.backend, check=False)
            for t in plan.zero:
                t.zero_()
            copied = torch.cuda.Event()
            copied.record(stream)
        side = self.scatter_stream
        with torch.cuda.stream(side):  # the scatters run while the A blocks above are copying
            side.wait_event(staged)
            for dst, src in plan.scatter:
                dst.copy_(src)
            # The buffer may be replaced by a larger one before this scatter has read it: its memory must not be
            # handed out again until then.
            self._staging[buf].record_stream(side)
            free = self._staging_free[buf] = torch.cuda.Event()
            free.record(side)
            side.wait_event(copied)
            done = torch.cuda.Event(enable_timing=True)  # timing: serve-sim charges the load's span
            done.record(side)
        return done

    def issue_layered(self, slot: int, packed: PackedAdapter, waits: Iterable[torch.cuda.Event],
                      progress: LayerProgress | None) -> tuple[torch.cuda.Event | None, list[torch.cuda.Event]]:
        """Enqueues the load layer by layer; returns (an event after the header's copy, before any layer's, each
        layer's completion event) ((None, []) for a CPU pool: the copies are done). With `progress`, layer l's
        copy first waits on the GPU for the host stage to have read layer l."""
        staged = packed.rank < self.pool.max_rank
        buf = self._next_staging(packed.rank)
        staging = self._staging_buffer(buf, packed.rank) if staged else None
        key = ("layers", self.pool, slot, buf)  # the pool itself: an id could be reused
        plans = packed.plans.get(key)
        if plans is None or plans[2] is not staging:  # views of the buffer, slot and staging: cached on the adapter
            plans = packed.plans[key] = (lay.header_copy(packed.buffer, self.pool, slot),
                                         lay.layer_copies(packed.blocks, packed.buffer, self.pool, slot, staging),
                                         staging)
        (hsrc, hdst), layers, _ = plans
        if self.load_stream is None:
            batched_h2d_copy(hsrc, hdst, backend=self.backend, check=False)
            for lc in layers:
                batched_h2d_copy(lc.srcs, lc.dsts, backend=self.backend, check=False)
                for dst, src in lc.scatter:
                    dst.copy_(src)
                for t in lc.zero:
                    t.zero_()
            return None, []
        stream, side, events = self.load_stream, self.scatter_stream, []
        with torch.cuda.stream(stream):
            for ev in waits:
                stream.wait_event(ev)
            if staged and self._staging_free[buf] is not None:  # the scatters that last read this buffer
                stream.wait_event(self._staging_free[buf])
            batched_h2d_copy(hsrc, hdst, stream, backend=self.backend, check=False)  # written before publication
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for layer, lc in enumerate(layers):
                if progress is not None and progress.count <= layer:
                    progress.wait_on_stream(layer, stream)
                batched_h2d_copy(lc.srcs[:lc.split], lc.dsts[:lc.split], stream, backend=self.backend, check=False)
                if staged:
                    b_done = torch.cuda.Event()
                    b_done.record(stream)
                batched_h2d_copy(lc.srcs[lc.split:], lc.dsts[lc.split:], stream, backend=self.backend, check=False)
                for t in lc.zero:
                    t.zero_()
                done = torch.cuda.Event(enable_timing=True)
                done.record(stream)
                if staged:  # the layer ends on the side stream, after its scatters and its A copies
                    with torch.cuda.stream(side):
                        side.wait_event(b_done)
                        for dst, src in lc.scatter:
                            dst.copy_(src)
                        side.wait_event(done)
                        done = torch.cuda.Event(enable_timing=True)
                        done.record(side)
                events.append(done)
        if staged:
            staging.record_stream(side)
            self._staging_free[buf] = events[-1]
        return start, events

    @staticmethod
    def _scatter_and_zero(plan: lay.DestPlan) -> None:
        for dst, src in plan.scatter:
            dst.copy_(src)
        for t in plan.zero:
            t.zero_()

    def _staging_buffer(self, buf: int, rank: int) -> torch.Tensor:
        """Device room for every B block of an adapter of rank `rank` < R: buffer `buf`, allocated on first use and
        replaced by a larger one when a higher rank comes (so two buffers cost about what one sized for R - 1 did
        when the ranks below R are at most half of it). A buffer is rewritten only after the scatter that last read
        it (an event the load stream waits on)."""
        need = lay.staging_numel(self.pool.spec, rank)
        cur = self._staging[buf]
        if cur is None or cur.numel() < need:
            if self.load_stream is not None:
                with torch.cuda.stream(self.load_stream):
                    cur = torch.empty(need, dtype=self.pool.dtype, device=self.pool.device)
            else:
                cur = torch.empty(need, dtype=self.pool.dtype)
            self._staging[buf] = cur
            self._dst_plans.clear()  # cached plans hold views of the buffer this one replaces
        return cur


class _SlotTable:
    """The loader's host-side state: which adapter holds which slot (LRU order), acquire counts, free slots,
    and each slot's pending load event and the events its last users recorded at release."""

    def __init__(self, n: int):
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()  # resident adapters, least recent first
        self._id_of: list[Hashable | None] = [None] * n
        self._refs = [0] * n
        self._free = list(range(n - 1, -1, -1))
        self._load_event: list[torch.cuda.Event | None] = [None] * n
        self._load_src: list[PackedAdapter | None] = [None] * n  # kept alive until its copies complete
        self._layer_events: list[list[torch.cuda.Event] | None] = [None] * n  # a layer-wise load's, per layer
        self._load_progress: list[LayerProgress | None] = [None] * n  # its host stage (the GPU polls its flag)
        self._failed: dict[Hashable, BaseException] = {}  # layer-wise loads whose host stage failed after issue
        self._drop_on_release: set[int] = set()  # failed slots still acquired by a batch
        self._release_events: list[dict[int, torch.cuda.Event]] = [{} for _ in range(n)]
        self._pending: set[int] = set()  # slots whose load event has not been seen complete
        self.stats = {"loads": 0, "evictions": 0, "bytes": 0, "stall_events": 0, "hits": 0}

    # -- queries -------------------------------------------------------------------------------------------

    def slot_of(self, adapter_id: Hashable) -> int | None:
        return self._slot_of.get(adapter_id)

    def resident(self) -> list[Hashable]:
        """Adapters with a slot (loaded or loading), least recently used first."""
        return list(self._slot_of)

    def in_use(self, slot: int) -> bool:
        return self._refs[slot] > 0

    def is_loading(self, slot: int) -> bool:
        """True while the slot's load has not completed (an event query: never blocks)."""
        ev = self._load_event[slot]
        if ev is None:
            return False
        if not ev.query():
            return True
        self._load_event[slot] = None
        self._load_src[slot] = None
        self._layer_events[slot] = None
        progress, self._load_progress[slot] = self._load_progress[slot], None
        self._pending.discard(slot)
        if progress is not None and progress.failed:
            self._fail_slot(slot, progress.error)
        return False

    def _fail_slot(self, slot: int, error: BaseException | None) -> None:
        """A layer-wise load whose host stage failed after its copies were queued: the slot holds garbage. The
        adapter leaves the table (now, or at the release of the batches that hold it) and its error is kept for
        `take_failures`: the engine fails the requests that used it; a later load reads the folder again."""
        aid = self._id_of[slot]
        self._failed[aid] = error if error is not None else RuntimeError(f"host stage of {aid!r} failed")
        self._drop_on_release.add(slot)  # forgotten by `_reap` or `release` (never while the table is iterated)

    def _forget(self, slot: int) -> None:
        aid = self._id_of[slot]
        if aid is not None and self._slot_of.get(aid) == slot:
            del self._slot_of[aid]
        self._id_of[slot] = None
        self._drop_on_release.discard(slot)
        self._free.append(slot)

    def take_failures(self) -> dict[Hashable, BaseException]:
        """Adapters whose layer-wise load failed since the last call (id -> the host stage's error); every request
        that used one in a batch must be failed (its rows hold garbage; other rows are exact)."""
        self._reap()
        failed, self._failed = self._failed, {}
        return failed

    def loading_ids(self) -> list[Hashable]:
        return [a for a, s in self._slot_of.items() if self.is_loading(s)]

    def load_event(self, adapter_id: Hashable) -> torch.cuda.Event | None:
        """The completion event (timing enabled) of the adapter's load while it is in flight, else None."""
        slot = self._slot_of.get(adapter_id)
        return None if slot is None or not self.is_loading(slot) else self._load_event[slot]

    def layer_events(self, adapter_id: Hashable) -> list[torch.cuda.Event] | None:
        """Each layer's completion event (timing enabled) of a layer-wise load in flight, else None."""
        slot = self._slot_of.get(adapter_id)
        events = None if slot is None or not self.is_loading(slot) else self._layer_events[slot]
        return None if events is None else events[1:]

    def in_use_ids(self) -> list[Hashable]:
        return [a for a, s in self._slot_of.items() if self._refs[s] > 0]

    def is_ready(self, adapter_id: Hashable) -> bool:
        slot = self._slot_of.get(adapter_id)
        return slot is not None and not self.is_loading(slot) and slot not in self._drop_on_release

    def free_or_evictable(self) -> int:
        """Slots a load could take now."""
        return len(self._free) + sum(1 for s in self._slot_of.values() if self._evictable(s))

    def _evictable(self, slot: int) -> bool:
        return self._refs[slot] == 0 and not self.is_loading(slot)

    def unload(self, adapter_id: Hashable) -> None:
        """Frees the adapter's slot now (it must not be acquired or loading); the slot's data stays stale."""
        slot = self._slot_of.get(adapter_id)
        if slot is None:
            return
        if not self._evictable(slot):
            raise RuntimeError(f"cannot unload adapter {adapter_id!r}: it is acquired or still loading")
        self._forget(slot)

    def _take_slot(self, adapter_id: Hashable, victim: Hashable | None) -> int:
        if victim is not None:
            slot = self._slot_of.get(victim)
            if slot is None or not self._evictable(slot):
                raise RuntimeError(f"cannot replace adapter {victim!r} by {adapter_id!r}: it is "
                                   f"{'not resident' if slot is None else 'acquired or still loading'}")
            del self._slot_of[victim]
            self._id_of[slot] = None
            self.stats["evictions"] += 1
            return slot
        if self._free:
            return self._free.pop()
        for victim, slot in self._slot_of.items():
            if self._evictable(slot):
                del self._slot_of[victim]
                self._id_of[slot] = None
                self.stats["evictions"] += 1
                return slot
        raise RuntimeError(f"no slot for adapter {adapter_id!r}: all {len(self._refs)} slots are acquired or "
                           f"still loading")

    def _reap(self) -> None:
        """Drops the references of loads that completed (event queries, never a wait) and the failed loads that no
        batch holds."""
        for slot in list(self._pending):
            self.is_loading(slot)
        for slot in [s for s in self._drop_on_release if self._refs[s] == 0]:
            self._forget(slot)


class AdapterLoader(_SlotTable):
    """Slot assignment, async loads, LRU eviction and GPU-side ordering for one pool and one host store.

    host_exclusive (default True): an adapter loaded into a slot becomes the host store's first to drop, so
    that a bounded store spends its memory on adapters the GPU does not hold (a victim cache: with as much host
    memory as slots, up to twice the adapters stay a copy away instead of a folder read). False keeps the
    store's plain LRU order.

    layerwise (default False): loads are copied layer by layer, with an event per layer, and
    `acquire(ids, layerwise=True)` + `wait_layer(l)` let a batch start while its adapters' later layers are
    still copying. A load given a host stage still in flight (`load_async(..., progress=...)`) is always
    layer-wise: its copies are queued at once and each waits on the GPU for its layer's bytes.
    """

    def __init__(self, pool: GpuAdapterPool, store: HostAdapterStore, load_stream: torch.cuda.Stream | None = None,
                 backend: str = "auto", host_exclusive: bool = True, layerwise: bool = False):
        if store.spec != pool.spec or store.dtype != pool.dtype:
            raise ValueError(f"store ({store.spec}, {store.dtype}) and pool ({pool.spec}, {pool.dtype}) differ "
                             f"(under tensor parallelism both take this rank's tp_rank, tp_size)")
        self.pool, self.store, self.backend, self.host_exclusive = pool, store, backend, host_exclusive
        self.layerwise = layerwise
        self._batch_layers: list[list[torch.cuda.Event]] = []  # the last layer-wise acquire's loads in flight
        self.is_cuda = pool.device.type == "cuda"
        self.load_stream = None
        if self.is_cuda:
            self.load_stream = load_stream or torch.cuda.Stream(pool.device)
            # The pool's tensors were zeroed on the current stream: the first loads come after that.
            self.load_stream.wait_stream(torch.cuda.current_stream(pool.device))
        super().__init__(pool.num_slots)
        self._issuer = _CopyIssuer(pool, self.load_stream, backend)

    # -- loading -------------------------------------------------------------------------------------------

    def load_async(self, adapter_id: Hashable, victim: Hashable | None = None,
                   packed: PackedAdapter | None = None, progress: LayerProgress | None = None) -> int:
        """The adapter's slot, starting its load on the load stream if it is not resident.

        victim: a resident adapter to replace (a prefetch plan's choice; it must be evictable); by
        default a free slot, else the least recently used evictable one. packed: the adapter's host
        buffer when a host stage already produced it (`HostStager`); by default `store.get`, which
        reads and packs a cold adapter's folder here, on the caller's thread. progress: the
        `LayerProgress` of a host stage still reading the adapter (`HostStage.progress`, published:
        its buffer is `packed` by default); the copies are queued now, each layer's waiting on the GPU
        for its bytes (a GPU pool needs the extension's stream wait). Raises RuntimeError when no slot
        can be taken (every slot acquired or still loading, or `victim` is not evictable), KeyError
        when the store does not know the adapter, ValueError when its rank exceeds the pool's max rank,
        `packed` is another adapter's or `progress` has not published its buffer, and the host
        stage's own error when `progress` has already failed.
        """
        slot = self._slot_of.get(adapter_id)
        if slot is not None:
            self._slot_of.move_to_end(adapter_id)
            self.stats["hits"] += 1
            return slot
        self._reap()
        if progress is not None:
            if progress.failed:
                raise progress.error or RuntimeError(f"host stage of adapter {adapter_id!r} failed")
            if not progress.published():
                raise ValueError(f"progress of adapter {adapter_id!r} has not published its buffer yet")
            packed = packed or progress.packed
        if packed is None:
            packed = self.store.get(adapter_id)
        elif packed.adapter_id != adapter_id or packed.dtype != self.pool.dtype:
            raise ValueError(f"packed adapter {packed.adapter_id!r} ({packed.dtype}) given for adapter "
                             f"{adapter_id!r} ({self.pool.dtype})")
        if packed.rank > self.pool.max_rank:
            raise ValueError(f"adapter {adapter_id!r} has rank {packed.rank}, above the pool's max rank "
                             f"{self.pool.max_rank}")
        slot = self._take_slot(adapter_id, victim)
        self._drop_on_release.discard(slot)  # an evicted failed load: its slot is this adapter's now
        self._issue(slot, packed, progress)
        if self.host_exclusive:
            self.store.demote(adapter_id)
        self._slot_of[adapter_id] = slot
        self._id_of[slot] = adapter_id
        return slot

    def _issue(self, slot: int, packed: PackedAdapter, progress: LayerProgress | None = None) -> None:
        waits = list(self._release_events[slot].values())
        self._release_events[slot].clear()
        if self.layerwise or progress is not None:
            header, layers = self._issuer.issue_layered(slot, packed, waits, progress)
            ev = layers[-1] if layers else None
            if ev is not None:
                self._layer_events[slot] = [header, *layers]  # the header (rank, scaling) first
                self._load_progress[slot] = progress
        else:
            ev = self._issuer.issue(slot, packed, waits)
        if ev is not None:
            self._load_event[slot] = ev
            self._load_src[slot] = packed  # the pinned source stays alive until the copies complete
            self._pending.add(slot)
        self.stats["loads"] += 1
        self.stats["bytes"] += packed.payload_bytes

    def wait_loads(self, stream=None) -> None:
        """Makes `stream` (default: the current one) wait, on the GPU, for every load still in flight (a load's
        end is not on the load stream when its B rows are scattered on the side stream)."""
        for slot in list(self._pending):
            ev = self._load_event[slot]
            if ev is not None:
                (stream or torch.cuda.current_stream(self.pool.device)).wait_event(ev)

    # -- batches -------------------------------------------------------------------------------------------

    def acquire(self, adapter_ids: Iterable[Hashable | None], layerwise: bool = False) -> list[int]:
        """Slots for a batch (None -> -1, no LoRA), loading what is missing; pins them until `release`.

        The current stream waits (on the GPU) for loads still in flight; the host does not block.
        layerwise: it waits only for a layer-wise load's header (rank, scaling); the caller must call
        `wait_layer(l)` before the batch's first kernel that reads layer l (a load that is not layer-wise is
        waited for whole, here).
        Each id counts once per occurrence; release the same list after the batch is enqueued.
        """
        ids = list(adapter_ids)
        if self._drop_on_release:
            self._reap()  # a failed layer-wise load is never handed out again
        slots: list[int | None] = [None] * len(ids)
        pinned: list[int] = []
        try:
            # Pin the resident ones first, so that loading the missing ones cannot evict them.
            for i, aid in enumerate(ids):
                if aid is None:
                    slots[i] = -1
                elif (s := self._slot_of.get(aid)) is not None:
                    self._slot_of.move_to_end(aid)
                    self._refs[s] += 1
                    pinned.append(s)
                    slots[i] = s
            for i, aid in enumerate(ids):
                if slots[i] is None:
                    s = self._slot_of.get(aid)
                    if s is None:
                        s = self.load_async(aid)
                    else:
                        self._slot_of.move_to_end(aid)
                    self._refs[s] += 1
                    pinned.append(s)
                    slots[i] = s
        except BaseException:
            for s in pinned:
                self._refs[s] -= 1
            raise
        self._batch_layers = []
        if self.is_cuda:
            stream = torch.cuda.current_stream(self.pool.device)
            for s in set(pinned):
                if self.is_loading(s):
                    if layerwise and self._layer_events[s] is not None:
                        stream.wait_event(self._layer_events[s][0])  # rank and scaling: any kernel reads them
                        self._batch_layers.append(self._layer_events[s][1:])
                    else:
                        stream.wait_event(self._load_event[s])
                    self.stats["stall_events"] += 1
        return slots  # type: ignore[return-value]

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """`stream` (default: the current one) waits, on the GPU, for layer `layer` of the loads the last
        `acquire(..., layerwise=True)` found in flight."""
        if not self._batch_layers:
            return
        stream = stream or torch.cuda.current_stream(self.pool.device)
        for events in self._batch_layers:
            stream.wait_event(events[layer])

    def release(self, adapter_ids: Iterable[Hashable | None]) -> None:
        """Ends a batch's use of its adapters; their slots' next load waits for the current stream's work so far."""
        slots: list[int] = []
        for aid in adapter_ids:
            if aid is None:
                continue
            s = self._slot_of.get(aid)
            if s is None or self._refs[s] <= slots.count(s):
                raise ValueError(f"release of adapter {aid!r}, which is not acquired (or released more often "
                                 f"than acquired)")
            slots.append(s)
        ev = None
        if self.is_cuda and slots:
            stream = torch.cuda.current_stream(self.pool.device)
            ev = torch.cuda.Event()
            ev.record(stream)
        for s in slots:
            self._refs[s] -= 1
            if ev is not None:
                self._release_events[s][stream.cuda_stream] = ev
            if self._refs[s] == 0 and s in self._drop_on_release:
                self._forget(s)
