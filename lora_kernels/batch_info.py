"""Batch metadata for the SGMV ops (DESIGN.md §4): host lists in, device tensors out, no sync.

`BatchInfoBuilder.build` turns the scheduler's per-request (token count, slot) lists into a
`LoRABatchInfo` on the device of the pool's `lora_ranks`. It never reads anything back from the GPU:

* The whole batch is written, with a few numpy ops, into one packed int32 record in a pinned staging
  buffer, and moved by one `non_blocking` host-to-device copy; every field is a view of the copy.
* Staging buffers form a ring. A buffer is rewritten only after the CUDA event recorded behind its
  previous copy has completed (`Event.query`, never blocking); if the GPU is so far behind that it has
  not, the build waits on that event and counts a stall (`builder.stalls`).
* Validation (slot range, non-negative counts, capacities) runs on the host arrays.

Record layout, `c` = segment capacity, `m` = tile capacity, `T` = permutation length:

    [ weight_indices c | seg_lens c | seg_indptr c+1 | work 1+3m | permutation T (only when sorting) ]

The work list (`LoRABatchInfo.work`) is what the kernels walk with grids of fixed size (SGMV v3): tiles of at
most TILE_M rows of one segment, each segment with at least one row cut into ceil(len / TILE_M) tiles:

    work[0] = number of tiles n;  for t < n: slot = work[1 + t], first segmented row = work[1 + m + t],
    end row (exclusive, the segment's end) = work[1 + 2m + t]

Slot -1 segments are listed too (the shrink writes their zeros); graph-mode padding is not. Its cost
is a few numpy ops on the host: grids follow the tiles in use, not the capacity.

Eager mode (`cuda_graph=False`) sizes the record to the batch (c = segments, at least 1) and copies it
into a fresh device tensor, so infos stay valid independently of later builds. Graph mode copies into
one static device buffer (addresses never change, c = max_segments, T = max_tokens); tail segments are
empty with slot -1 and permutation rows beyond the batch map to themselves. A pure-decode batch (every
count 1, no sort) uses `seg_lens`/`seg_indptr` precomputed at construction and copies only
`weight_indices`; its segments past the batch are one-row padding segments with slot -1 (rows a kernel
leaves as they were), up to row min(max_segments, max_tokens), which is its `num_tokens`: x and out must
have that many rows, as a graph's static buffers do (the ops check it).

Graph mode hands out two families of static tensors, so a captured graph must be replayed with infos
of the family it was captured with: pure decode (`max_seg_len == 1`, the precomputed segments), or any
other batch (`max_seg_len == max_tokens`); and with the same `sort_by_adapter` (`permutation` None or
the static buffer). `BatchInfoBuilder.graph_family(info)` names the family.

With a CPU `lora_ranks` the builder works on the CPU (no pinning, no events, synchronous copies): the
torch backend and the CPU tests use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from lora_kernels.batch_record import (_SEQ, TILE_M, NumpyRecord, check_host_lists,  # noqa: F401 (TILE_M: public)
                                       tile_count, write_tiles)

try:  # the extension's C++ record filler; without it the numpy path below does the same work
    from lora_kernels._C import fill_batch_record as _fill_record
except (ImportError, OSError):  # not built, or built for another torch
    _fill_record = None
# The ufunc reductions directly: ndarray.min/max add a Python-level wrapper per call.
_min, _max = np.minimum.reduce, np.maximum.reduce
# The current stream as a raw handle: a dict key, cheaper than building a torch Stream per build.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)
# Graph mode on CUDA with the extension: the C++ filler also copies the record and records the ring event (one
# call instead of fill + copy_ + Event.record). Opt-in until measured on a GPU.
NATIVE_COPY = os.environ.get("LORA_KERNELS_NATIVE_COPY", "0") == "1"


@dataclass
class LoRABatchInfo:
    """Segments of a batch, one adapter slot each; all tensors on the kernels' device.

    seg_lens[s]        rows in segment s (int32[cap_segments])
    seg_indptr[s]      exclusive prefix sum of seg_lens (int32[cap_segments + 1])
    weight_indices[s]  slot of segment s, -1 = no LoRA (int32[cap_segments])
    permutation[i]     physical row of segmented row i, or None (int32[cap_tokens])
    num_segments       segments holding this batch's requests; segments beyond are padding with slot -1
    max_seg_len        upper bound on seg_lens, sizes the kernels' grids
    num_tokens         rows the segments cover (= seg_indptr[-1]): every row a kernel touches is below it.
                       The batch's token count, except graph-mode pure decode, whose precomputed
                       segments also cover the padding rows up to min(max_segments, max_tokens)
    lora_ranks         rank per slot (the pool's tensor), scalings: scaling per slot (the pool's)
    work               int32[1 + 3 * max_tiles] work list of TILE_M-row tiles (module docstring), or None
    max_tiles          capacity of the work list (host int; sizes the persistent grids)
    """

    seg_lens: torch.Tensor
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    permutation: torch.Tensor | None
    num_segments: int
    max_seg_len: int
    num_tokens: int
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    work: torch.Tensor | None = None
    max_tiles: int = 0
    _checked: tuple | None = field(default=None, init=False, repr=False, compare=False)  # ops.py's validation

    @classmethod
    def from_segments(cls, seg_lens: Sequence[int], slots: Sequence[int], lora_ranks: torch.Tensor,
                      scalings: torch.Tensor, permutation: torch.Tensor | None = None, cap_segments: int | None = None,
                      max_seg_len: int | None = None) -> "LoRABatchInfo":
        """An info made directly from host segment lists (tests, tools; an engine uses BatchInfoBuilder),
        optionally padded to `cap_segments` empty slot -1 segments."""
        n = len(seg_lens)
        cap = max(cap_segments or n, 1)
        lens = np.zeros(cap, np.int32)
        lens[:n] = seg_lens
        wi = np.full(cap, -1, np.int32)
        wi[:n] = slots
        indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        tiles = tile_count(lens[:n])
        m = max(tiles, 1)
        work = np.zeros(1 + 3 * m, np.int32)
        write_tiles(work, m, wi[:n], lens[:n], indptr, tiles)
        dev = lora_ranks.device

        def put(a):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(dev)

        return cls(seg_lens=put(lens), seg_indptr=put(indptr), weight_indices=put(wi), permutation=permutation,
                   num_segments=n, max_seg_len=max_seg_len or int(max(seg_lens, default=0)),
                   num_tokens=int(indptr[-1]), lora_ranks=lora_ranks, scalings=scalings, work=put(work), max_tiles=m)

    @property
    def num_slots(self) -> int:
        return self.lora_ranks.shape[0]


def _layout(m: int, c: int) -> tuple[int, int, int]:
    """Offsets of weight_indices, seg_lens, seg_indptr in a record of m tiles and c segments."""
    w = 1 + 3 * m
    return w, w + c, w + 2 * c


class _Staging:
    """One ring entry: a (pinned, on CUDA) int32 record, its numpy view, and the event behind its last copy."""

    __slots__ = ("tensor", "array", "event", "perm_dirty", "prefix")

    def __init__(self, length: int, pin: bool, event):
        self.tensor = torch.empty(length, dtype=torch.int32, pin_memory=pin)
        self.array = self.tensor.numpy()
        self.event = event
        self.prefix = {length: self.tensor}  # record[:length] views of the lengths graph mode copies
        self.perm_dirty = 0  # graph mode: permutation entries [0, perm_dirty) may differ from the identity


def _check_pool_tensors(lora_ranks: torch.Tensor, scalings: torch.Tensor) -> None:
    if lora_ranks.dim() != 1 or lora_ranks.dtype != torch.int32:
        raise ValueError(f"lora_ranks must be int32[num_slots], got {tuple(lora_ranks.shape)} {lora_ranks.dtype}")
    if scalings.shape != lora_ranks.shape or scalings.dtype != torch.float32:
        raise ValueError(f"scalings must be float32[{lora_ranks.shape[0]}], got {tuple(scalings.shape)} "
                         f"{scalings.dtype}")
    if scalings.device != lora_ranks.device:
        raise ValueError(f"scalings is on {scalings.device} but lora_ranks is on {lora_ranks.device}")


class _GraphBuffers:
    """Graph mode's static device buffers (addresses never change): the general record, and pure decode's
    precomputed segments and work list [count | slot S | row0 S | end S] (tile s = segment s, whose slot
    array doubles as weight_indices). Starts as the empty batch, as do the staging tails."""

    def __init__(self, b: "BatchInfoBuilder"):
        S, T, m = b.max_segments, b.max_tokens, b._mt
        w, ln, ip = _layout(m, S)
        init = np.zeros(b._record_len, np.int32)  # no tiles, every segment empty with slot -1, identity perm
        init[w:ln] = -1
        init[ip + S + 1:] = np.arange(T)
        dev = torch.from_numpy(init).to(b.device)
        self.record, self.work = dev, dev[:1 + 3 * m]
        self.wi, self.lens, self.indptr, self.perm = dev[w:ln], dev[ln:ip], dev[ip:ip + S + 1], dev[ip + S + 1:]
        self.dst = {ip + S + 1: dev[:ip + S + 1], b._record_len: dev}  # the unsorted and sorted copy lengths
        for st in b._ring:
            st.array[:] = init
            st.prefix[ip + S + 1] = st.tensor[:ip + S + 1]
            st.prefix[S + 1] = st.tensor[:S + 1]
        # Pure decode: segment s holds row s (rows beyond max_tokens cannot exist: those segments are empty).
        covered = min(S, T)
        lens = np.zeros(S, np.int32)
        lens[:covered] = 1
        indptr = np.minimum(np.arange(S + 1), covered).astype(np.int32)
        dec = np.concatenate([[0], np.full(S, -1), indptr[:S], indptr[1:]]).astype(np.int32)
        self.dec_work = torch.from_numpy(dec).to(b.device)
        self.dec_head = self.dec_work[:S + 1]  # what a decode build copies: the count and the slots
        self.dec_wi = self.dec_work[1:1 + S]  # views made once: slicing per build costs µs on the hot path
        self.dec_lens = torch.from_numpy(lens).to(b.device)
        self.dec_indptr = torch.from_numpy(indptr).to(b.device)
        self.dec_rows = covered
        # The native copy's destinations: (address, bytes) of a decode record, an unsorted and a sorted record.
        end = ip + S + 1
        self.copy_plan = (self.dec_head.data_ptr(), 4 * (S + 1), dev.data_ptr(), 4 * end, dev.data_ptr(),
                          4 * b._record_len)
        self.native = NATIVE_COPY and _fill_record is not None and b.device.type == "cuda"
        if self.native:  # the ring's events must exist before the C++ side records them by handle
            for st in b._ring:
                st.event.record(torch.cuda.current_stream(b.device))


class BatchInfoBuilder:
    """Builds `LoRABatchInfo` for batches of at most `max_tokens` rows and `max_segments` requests.

    Counters: `builds` (successful builds), `stalls` (builds that had to wait for a staging buffer's
    previous copy to finish; non-zero only when the host runs more than `ring_size` builds ahead of the GPU).
    """

    ring_size = 16  # staging buffers; class attribute so tests can force reuse with a small ring

    def __init__(self, max_tokens: int, max_segments: int, lora_ranks: torch.Tensor, scalings: torch.Tensor,
                 cuda_graph: bool = False):
        if max_tokens < 1 or max_segments < 1:
            raise ValueError(f"max_tokens and max_segments must be >= 1, got {max_tokens}, {max_segments}")
        if max_tokens >= 2**31 or max_segments >= 2**30:
            raise ValueError(f"max_tokens={max_tokens} / max_segments={max_segments} exceed the int32 metadata")
        _check_pool_tensors(lora_ranks, scalings)
        self.max_tokens, self.max_segments = max_tokens, max_segments
        self.lora_ranks, self.scalings = lora_ranks, scalings
        self.device = lora_ranks.device
        self.cuda_graph = cuda_graph
        self.num_slots = lora_ranks.shape[0]
        self.builds = self.stalls = 0
        self._is_cuda = self.device.type == "cuda"
        S, T = max_segments, max_tokens
        # int32 prefix sums cannot overflow when every count <= max_tokens and S * max_tokens fits.
        self._cumsum_safe = S * T < 2**31
        self._mt = -(-T // TILE_M) + S  # tile capacity: sum of ceil(len / TILE_M) <= T / TILE_M + S
        self._record_len = 3 * self._mt + 3 * S + 2 + T  # the largest record: full capacity plus a permutation
        self._ring = [_Staging(self._record_len, self._is_cuda, torch.cuda.Event() if self._is_cuda else None)
                      for _ in range(self.ring_size)]
        self._next = 0
        self._iota = np.arange(max(T, S + 1), dtype=np.int32)
        self._np = NumpyRecord(T, S, self.num_slots)
        self._req_counts = np.empty(S, dtype=np.int32)
        self._req_slots = np.empty(S, dtype=np.int32)  # sort_by_adapter: the requests before grouping
        self._perm_scratch = np.empty(T, dtype=np.int32)  # eager sort_by_adapter: placed after the record
        self._streams = {}  # raw CUDA stream -> torch Stream, so recording an event costs no Stream creation
        self._dev_index = self.device.index if self._is_cuda else -1
        self._g = _GraphBuffers(self) if cuda_graph else None
        self._dec_rows = self._g.dec_rows if cuda_graph else 0

    def graph_family(self, info: LoRABatchInfo) -> tuple[str, bool]:
        """(\"decode\" | \"general\", sorted): a graph captured with one info replays infos of the same family."""
        if not self.cuda_graph:
            raise ValueError("graph_family is defined for cuda_graph=True builders only")
        return ("decode" if info.seg_indptr is self._g.dec_indptr else "general", info.permutation is not None)

    def _acquire(self) -> _Staging:
        """The next staging buffer, once the GPU has finished reading it (waits, and counts, only if not)."""
        st = self._ring[self._next]
        ev = st.event
        if ev is not None and not ev.query():
            ev.synchronize()
            self.stalls += 1
        return st

    def build(self, seg_token_counts: Sequence[int], slots: Sequence[int], sort_by_adapter: bool = False
              ) -> LoRABatchInfo:
        """Metadata for one batch: request i owns the next `seg_token_counts[i]` rows of x and uses slot
        `slots[i]` (-1 = no LoRA). Host-side work and one non-blocking copy; never waits for the GPU
        (unless the staging ring is exhausted, see `stalls`). A builder of one row (`max_tokens == 1`) ignores
        `sort_by_adapter`: its batches' sorted order is the identity, and a permutation would only add a gather
        to every kernel (the same rows, the same bits: batch invariance covers the choice)."""
        n = check_host_lists(seg_token_counts, slots, self.max_segments)
        sort_by_adapter = sort_by_adapter and self.max_tokens > 1
        st = self._acquire()
        if _fill_record is not None and type(slots) in _SEQ and type(seg_token_counts) in _SEQ:
            if self._g is not None and self._g.native:
                return _graph_build_native(self, st, seg_token_counts, slots, n, sort_by_adapter)
            return self._build_native(st, seg_token_counts, slots, n, sort_by_adapter)
        rec = st.array
        # Slots go to rec[1:1+n] first: the decode record's slot array and, for one-tile segments, the work list's.
        w, c = rec[1:1 + n], self._req_counts[:n]
        cmin, cmax, ones = self._np.requests(w, c, seg_token_counts, slots)
        if ones:
            c.fill(1)
        if sort_by_adapter:
            w = self._req_slots[:n]
            w[:] = rec[1:1 + n]
            return self._build_sorted(st, w, c, n)
        S = self.max_segments
        if self.cuda_graph and ones and n <= self._dec_rows:  # precomputed segments: copy count + slots only
            rec[0] = n
            rec[1 + n:1 + S] = -1
            self._copy(st, S + 1, self._g.dec_head)
            return self._decode_info(n)
        one_each = n > 0 and cmin >= 1 and cmax <= TILE_M
        return self._emit(st, w, c, n, cmax, one_each, None)

    def _build_native(self, st: _Staging, seg_token_counts, slots, n: int, sort: bool) -> LoRABatchInfo:
        """build() through the extension's fill_batch_record (same record, same checks, a few µs)."""
        graph = self.cuda_graph
        S = self.max_segments
        perm = self._perm_target(st) if sort else st.array  # unused when not sorting
        res = _fill_record(seg_token_counts, slots, st.array, perm, self.num_slots, self.max_tokens, sort,
                           S if graph else 0, self._mt if graph else 0, self._dec_rows, TILE_M)
        if res[0] == 0:  # graph-mode pure decode: count + slots only
            self._copy(st, S + 1, self._g.dec_head)
            return self._decode_info(n)
        _, k, max_len, total, _, m, cap = res
        if sort:
            self._restore_identity(st, total)
        return self._finish(st, k, max_len, total, m, cap, perm if sort else None)

    def _decode_info(self, n: int) -> LoRABatchInfo:
        g, S = self._g, self.max_segments
        return self._info(g.dec_wi, g.dec_lens, g.dec_indptr, None, n, 1, self._dec_rows, g.dec_work, S)

    def _emit(self, st: _Staging, w: np.ndarray, c: np.ndarray, n: int, max_len: int, one_each: bool,
              perm: np.ndarray | None) -> LoRABatchInfo:
        """Writes segments (slots w, counts c) and their work list into the record, copies it, returns the info."""
        rec = st.array
        cap = self.max_segments if self.cuda_graph else max(n, 1)
        tiles = n if one_each else tile_count(c)
        m = self._mt if self.cuda_graph else max(tiles, 1)
        wo, lo, io = _layout(m, cap)
        wi, lens, indptr = rec[wo:lo], rec[lo:io], rec[io:io + cap + 1]
        wi[:n] = w
        wi[n:] = -1
        lens[:n] = c
        lens[n:] = 0
        total = self._np.prefix_sum(lens, indptr, n)
        write_tiles(rec[:1 + 3 * m], m, wi[:n], lens[:n], indptr, tiles, one_each)
        return self._finish(st, n, max_len, total, m, cap, perm)

    def _finish(self, st: _Staging, n: int, max_len: int, total: int, m: int, cap: int,
                perm: np.ndarray | None) -> LoRABatchInfo:
        """Copies the record written for m tiles and cap segments (and perm[:total]) and returns its info."""
        rec = st.array
        end = _layout(m, cap)[2] + cap + 1
        if self.cuda_graph:
            if perm is not None:  # the whole record: its permutation tail included
                self._copy(st, self._record_len, self._g.record)
            else:
                self._copy(st, end, self._g.dst[end])
            return self._graph_info(n, total, m, perm is not None)
        plen = 0 if perm is None else total
        if plen:
            rec[end:end + plen] = perm[:plen]
        dev = self._copy(st, end + plen, None)
        parts = dev.split_with_sizes((1 + 3 * m, cap, cap, cap + 1, plen))
        return self._info(parts[1], parts[2], parts[3], parts[4] if perm is not None else None, n, max_len, total,
                          parts[0], m)

    def _build_sorted(self, st: _Staging, w: np.ndarray, c: np.ndarray, n: int) -> LoRABatchInfo:
        """Requests sharing a slot merged into one segment (ascending slot, request order kept within it);
        `permutation` maps each segmented row to its physical row."""
        total = int(np.add.reduce(c, dtype=np.int64)) if n else 0
        if total > self.max_tokens:
            raise ValueError(f"{total} tokens exceed max_tokens={self.max_tokens}")
        p = self._perm_target(st)
        self._restore_identity(st, total)
        if not n:
            return self._emit(st, w[:0], c[:0], 0, 0, False, p)
        seg_slots, lens, max_len, min_len = self._np.group(w, c, total, p)
        return self._emit(st, seg_slots, lens, seg_slots.size, max_len, max_len <= TILE_M and min_len >= 1, p)

    def _perm_target(self, st: _Staging) -> np.ndarray:
        """Where the permutation goes: the graph record's tail, or scratch that _finish copies after the record."""
        return st.array[self._record_len - self.max_tokens:] if self.cuda_graph else self._perm_scratch

    def _restore_identity(self, st: _Staging, total: int) -> None:
        """Graph mode: rows past `total` map to themselves again where this buffer's last batch permuted them."""
        if self.cuda_graph:
            p = self._perm_target(st)
            if st.perm_dirty > total:
                p[total:st.perm_dirty] = self._iota[total:st.perm_dirty]
            st.perm_dirty = total

    def _copy(self, st: _Staging, length: int, dst: torch.Tensor | None) -> torch.Tensor:
        """Copies record[:length] to dst (a fresh device tensor when None), marks the staging buffer busy
        until the copy is done, and advances the ring."""
        src = st.prefix.get(length)
        if src is None:
            src = st.tensor.narrow(0, 0, length)
        if dst is not None:
            dst.copy_(src, non_blocking=self._is_cuda)
        elif self._is_cuda:
            dst = src.to(self.device, non_blocking=True)
        else:
            dst = src.clone()
        if st.event is not None:  # the copy ran on the destination device's current stream
            st.event.record(_current_stream(self) if self._is_cuda else None)
        self._advance()
        return dst

    def _advance(self) -> None:
        """A build's copy is queued: the next build takes the next staging buffer."""
        self._next = (self._next + 1) % len(self._ring)
        self.builds += 1

    def _graph_info(self, n: int, total: int, m: int, sort: bool) -> LoRABatchInfo:
        """The info over graph mode's static general buffers (the permutation when sorted)."""
        g = self._g
        return self._info(g.wi, g.lens, g.indptr, g.perm if sort else None, n, self.max_tokens, total, g.work, m)

    def _info(self, wi, lens, indptr, perm, num_segments, max_seg_len, num_tokens, work, max_tiles) -> LoRABatchInfo:
        return LoRABatchInfo(seg_lens=lens, seg_indptr=indptr, weight_indices=wi, permutation=perm,
                             num_segments=num_segments, max_seg_len=max_seg_len, num_tokens=num_tokens,
                             lora_ranks=self.lora_ranks, scalings=self.scalings, work=work, max_tiles=max_tiles)


def _current_stream(b: BatchInfoBuilder):
    """The builder's device's current torch Stream, cached by raw handle (no Stream object built per build)."""
    raw = _raw_stream(b._dev_index)
    stream = b._streams.get(raw)
    if stream is None:
        stream = b._streams[raw] = torch.cuda.current_stream(b.device)
    return stream


def _graph_build_native(b: BatchInfoBuilder, st: _Staging, seg_token_counts, slots, n: int, sort: bool):
    """Graph-mode build in one C++ call: fill, restore the permutation tail, copy to the static buffers on the
    current stream, record the ring event (the same record and info as _build_native + _copy)."""
    S = b.max_segments
    copy = (st.perm_dirty, b._dev_index, _raw_stream(b._dev_index), st.event.cuda_event, *b._g.copy_plan)
    res = _fill_record(seg_token_counts, slots, st.array, b._perm_target(st) if sort else st.array, b.num_slots,
                       b.max_tokens, sort, S, b._mt, b._dec_rows, TILE_M, copy)
    b._advance()
    if res[0] == 0:
        return b._decode_info(n)
    _, k, _, total, _, m, _ = res
    if sort:
        st.perm_dirty = total
    return b._graph_info(k, total, m, sort)
