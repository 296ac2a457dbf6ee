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

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

_SEQ = (list, tuple)
try:  # the extension's C++ record filler; without it the numpy path below does the same work
    from lora_kernels._C import fill_batch_record as _fill_record
except (ImportError, OSError):  # not built, or built for another torch
    _fill_record = None
TILE_M = 16  # rows per work-list tile; the Triton kernels' BLOCK_M (one value for every batch: invariance)
# The ufunc reductions directly: ndarray.min/max add a Python-level wrapper per call.
_min, _max = np.minimum.reduce, np.maximum.reduce
# The current stream as a raw handle: a dict key, cheaper than building a torch Stream per build.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def tile_count(lens: np.ndarray) -> int:
    """Work-list tiles that segments of these lengths need (ceil(len / TILE_M) each)."""
    return int(np.add.reduce((lens + (TILE_M - 1)) // TILE_M)) if lens.size else 0


def write_tiles(work: np.ndarray, m: int, slots: np.ndarray, lens: np.ndarray, indptr: np.ndarray, tiles: int,
                one_each: bool = False) -> None:
    """Writes the work list of segments (slots, lens, indptr[:n+1]) into `work` (capacity m tiles).
    one_each: every segment has 1..TILE_M rows, so tile s is segment s."""
    n = lens.size
    work[0] = tiles
    slot_a, row0, end = work[1:1 + m], work[1 + m:1 + 2 * m], work[1 + 2 * m:1 + 3 * m]
    if one_each:
        slot_a[:n], row0[:n], end[:n] = slots, indptr[:n], indptr[1:n + 1]
        return
    nt = (lens + (TILE_M - 1)) // TILE_M
    seg = np.repeat(np.arange(n), nt)
    first = np.cumsum(nt) - nt
    np.take(slots, seg, out=slot_a[:tiles])
    np.take(indptr, seg + 1, out=end[:tiles])
    row0[:tiles] = indptr[seg] + (np.arange(tiles) - first[seg]) * TILE_M


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


class _Staging:
    """One ring entry: a (pinned, on CUDA) int32 record, its numpy view, and the event behind its last copy."""

    __slots__ = ("tensor", "array", "event", "perm_dirty", "prefix")

    def __init__(self, length: int, pin: bool, event):
        self.tensor = torch.empty(length, dtype=torch.int32, pin_memory=pin)
        self.array = self.tensor.numpy()
        self.event = event
        self.prefix = {length: self.tensor}  # record[:length] views of the lengths graph mode copies
        self.perm_dirty = 0  # graph mode: permutation entries [0, perm_dirty) may differ from the identity


def _fill(dst: np.ndarray, values, name: str) -> None:
    """dst[:] = values (host ints); numpy arrays/tensors of wider ints are range-checked, not wrapped."""
    if type(values) not in _SEQ and isinstance(values, (np.ndarray, torch.Tensor)):
        a = values.numpy() if isinstance(values, torch.Tensor) else values
        if a.dtype.kind not in "iu":
            raise ValueError(f"{name} must hold integers, got {tuple(a.shape)} {a.dtype}")
        if a.dtype.itemsize >= 4 and a.dtype != np.int32 and a.size and (a.min() < -2**31 or a.max() >= 2**31):
            raise ValueError(f"{name} holds values outside int32 ({a.min()}..{a.max()})")
        values = a
    try:
        dst[:] = values
    except OverflowError:
        raise ValueError(f"{name} holds values outside int32") from None


def _check_host_lists(seg_token_counts, slots, max_segments: int) -> int:
    if type(slots) not in _SEQ or type(seg_token_counts) not in _SEQ:
        for name, v in (("seg_token_counts", seg_token_counts), ("slots", slots)):
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                raise ValueError(f"{name} must be host ints (reading a {v.device} tensor would sync), got "
                                 f"{tuple(v.shape)} {v.dtype} on {v.device}")
    n = len(slots)
    if len(seg_token_counts) != n:
        raise ValueError(f"seg_token_counts has {len(seg_token_counts)} entries but slots has {n}")
    if n > max_segments:
        raise ValueError(f"{n} requests exceed max_segments={max_segments}")
    return n


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
        if lora_ranks.dim() != 1 or lora_ranks.dtype != torch.int32:
            raise ValueError(f"lora_ranks must be int32[num_slots], got {tuple(lora_ranks.shape)} {lora_ranks.dtype}")
        if scalings.shape != lora_ranks.shape or scalings.dtype != torch.float32:
            raise ValueError(f"scalings must be float32[{lora_ranks.shape[0]}], got {tuple(scalings.shape)} "
                             f"{scalings.dtype}")
        if scalings.device != lora_ranks.device:
            raise ValueError(f"scalings is on {scalings.device} but lora_ranks is on {lora_ranks.device}")
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
        self._scratch64 = np.empty(S, dtype=np.int64)
        self._req_counts = np.empty(S, dtype=np.int32)
        self._req_slots = np.empty(S, dtype=np.int32)  # sort_by_adapter: the requests before grouping
        self._perm_scratch = np.empty(T, dtype=np.int32)  # eager sort_by_adapter: placed after the record
        self._flags = np.empty(S, dtype=bool)
        self._sorted_slots = np.empty(S, dtype=np.int32)
        self._seg_scratch = np.empty(S, dtype=np.int32)
        self._keys16 = np.empty(S, dtype=np.uint16)
        self._streams = {}  # raw CUDA stream -> torch Stream, so recording an event costs no Stream creation
        self._dev_index = self.device.index if self._is_cuda else -1
        if cuda_graph:
            self._init_graph_buffers()

    def _layout(self, m: int, c: int) -> tuple[int, int, int]:
        """Offsets of weight_indices, seg_lens, seg_indptr in a record of m tiles and c segments."""
        w = 1 + 3 * m
        return w, w + c, w + 2 * c

    def _init_graph_buffers(self) -> None:
        S, T, m = self.max_segments, self.max_tokens, self._mt
        w, ln, ip = self._layout(m, S)
        # Initial contents: an empty batch (no tiles, all segments empty with slot -1, identity permutation).
        init = np.zeros(self._record_len, np.int32)
        init[w:ln] = -1
        init[ip + S + 1:] = np.arange(T)
        dev = torch.from_numpy(init).to(self.device)
        self._dev, self._g_work = dev, dev[:1 + 3 * m]
        self._g_wi, self._g_lens, self._g_indptr, self._g_perm = dev[w:ln], dev[ln:ip], dev[ip:ip + S + 1], dev[ip + S + 1:]
        # Destinations of the copy lengths graph mode uses: decode (count + slots), unsorted, sorted.
        self._g_dst = {ip + S + 1: dev[:ip + S + 1], self._record_len: dev}
        for st in self._ring:  # staging tails start as the empty batch too
            st.array[:] = init
            st.prefix[ip + S + 1] = st.tensor[:ip + S + 1]
            st.prefix[S + 1] = st.tensor[:S + 1]
        # Pure decode: segment s holds row s (rows beyond max_tokens cannot exist: those segments are empty);
        # its work list [count | slot S | row0 S | end S] has tile s = segment s, and slot doubles as weight_indices.
        covered = min(S, T)
        lens = np.zeros(S, np.int32)
        lens[:covered] = 1
        indptr = np.minimum(np.arange(S + 1), covered).astype(np.int32)
        dec = np.concatenate([[0], np.full(S, -1), indptr[:S], indptr[1:]]).astype(np.int32)
        self._dec_work = torch.from_numpy(dec).to(self.device)
        self._dec_lens = torch.from_numpy(lens).to(self.device)
        self._dec_indptr = torch.from_numpy(indptr).to(self.device)
        self._dec_rows = covered

    def graph_family(self, info: LoRABatchInfo) -> tuple[str, bool]:
        """(\"decode\" | \"general\", sorted): a graph captured with one info replays infos of the same family."""
        if not self.cuda_graph:
            raise ValueError("graph_family is defined for cuda_graph=True builders only")
        return ("decode" if info.seg_indptr is self._dec_indptr else "general", info.permutation is not None)

    def _acquire(self) -> _Staging:
        """The next staging buffer, once the GPU has finished reading it (waits, and counts, only if not)."""
        st = self._ring[self._next]
        ev = st.event
        if ev is not None and not ev.query():
            ev.synchronize()
            self.stalls += 1
        return st

    def _write_requests(self, w: np.ndarray, c: np.ndarray, seg_token_counts, slots) -> tuple[int, int, bool]:
        """w[:] = slots and c[:] = counts, both checked on the host; returns (min count, max count, every count
        is 1). When every count is 1, c is left unwritten."""
        _fill(w, slots, "slots")
        if w.size and (_min(w) < -1 or _max(w) >= self.num_slots):
            bad = int(w[(w < -1) | (w >= self.num_slots)][0])
            raise ValueError(f"slot {bad} out of range: slots must be -1 or in [0, {self.num_slots})")
        n = c.size
        if not n:
            return 0, 0, False
        # Decode batches arrive as lists of 1s: list.count is one C loop, no conversion, nothing to check.
        if type(seg_token_counts) in _SEQ and seg_token_counts.count(1) == n:
            return 1, 1, True
        _fill(c, seg_token_counts, "seg_token_counts")
        cmin, cmax = int(_min(c)), int(_max(c))
        if cmin < 0:
            raise ValueError(f"seg_token_counts must be >= 0, got {cmin}")
        if cmax > self.max_tokens:
            raise ValueError(f"{cmax} tokens exceed max_tokens={self.max_tokens}")
        return cmin, cmax, cmin == 1 and cmax == 1

    def _prefix_sum(self, lens: np.ndarray, indptr: np.ndarray, n: int) -> int:
        """indptr[0] = 0, indptr[1:n+1] = cumsum(lens[:n]), the rest = the total (empty tail segments);
        returns the total after checking it against max_tokens."""
        indptr[0] = 0
        total = 0
        if n and self._cumsum_safe:
            np.cumsum(lens[:n], dtype=np.int32, out=indptr[1:n + 1])
            total = int(indptr[n])
        elif n:
            acc = self._scratch64[:n]
            np.cumsum(lens[:n], out=acc)
            total = int(acc[-1])
            if total <= self.max_tokens:
                indptr[1:n + 1] = acc
        if total > self.max_tokens:
            raise ValueError(f"{total} tokens exceed max_tokens={self.max_tokens}")
        indptr[n + 1:] = total
        return total

    def build(self, seg_token_counts: Sequence[int], slots: Sequence[int], sort_by_adapter: bool = False
              ) -> LoRABatchInfo:
        """Metadata for one batch: request i owns the next `seg_token_counts[i]` rows of x and uses slot
        `slots[i]` (-1 = no LoRA). Host-side work and one non-blocking copy; never waits for the GPU
        (unless the staging ring is exhausted, see `stalls`)."""
        n = _check_host_lists(seg_token_counts, slots, self.max_segments)
        st = self._acquire()
        if _fill_record is not None and type(slots) in _SEQ and type(seg_token_counts) in _SEQ:
            return self._build_native(st, seg_token_counts, slots, n, sort_by_adapter)
        rec = st.array
        # Slots go to rec[1:1+n] first: the decode record's slot array and, for one-tile segments, the work list's.
        w, c = rec[1:1 + n], self._req_counts[:n]
        cmin, cmax, ones = self._write_requests(w, c, seg_token_counts, slots)
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
            self._copy(st, S + 1, self._dec_work[:S + 1])
            return self._info(self._dec_work[1:1 + S], self._dec_lens, self._dec_indptr, None, n, 1, self._dec_rows,
                              self._dec_work, S)
        one_each = n > 0 and cmin >= 1 and cmax <= TILE_M
        return self._emit(st, w, c, n, cmax, one_each, None)

    def _build_native(self, st: _Staging, seg_token_counts, slots, n: int, sort: bool) -> LoRABatchInfo:
        """build() through the extension's fill_batch_record (same record, same checks, a few µs)."""
        graph = self.cuda_graph
        S = self.max_segments
        perm = (st.array[self._record_len - self.max_tokens:] if graph else self._perm_scratch) if sort else st.array
        res = _fill_record(seg_token_counts, slots, st.array, perm, self.num_slots, self.max_tokens, sort,
                           S if graph else 0, self._mt if graph else 0, self._dec_rows if graph else 0, TILE_M)
        if res[0] == 0:  # graph-mode pure decode: count + slots only
            self._copy(st, S + 1, self._dec_work[:S + 1])
            return self._info(self._dec_work[1:1 + S], self._dec_lens, self._dec_indptr, None, n, 1, self._dec_rows,
                              self._dec_work, S)
        _, k, max_len, total, _, m, cap = res
        if sort and graph:
            self._perm_buffer(st, total)  # restores the identity past this batch's rows
        return self._finish(st, k, max_len, total, m, cap, perm if sort else None)

    def _emit(self, st: _Staging, w: np.ndarray, c: np.ndarray, n: int, max_len: int, one_each: bool,
              perm: np.ndarray | None) -> LoRABatchInfo:
        """Writes segments (slots w, counts c) and their work list into the record, copies it, returns the info."""
        rec = st.array
        cap = self.max_segments if self.cuda_graph else max(n, 1)
        tiles = n if one_each else tile_count(c)
        m = self._mt if self.cuda_graph else max(tiles, 1)
        wo, lo, io = self._layout(m, cap)
        wi, lens, indptr = rec[wo:lo], rec[lo:io], rec[io:io + cap + 1]
        wi[:n] = w
        wi[n:] = -1
        lens[:n] = c
        lens[n:] = 0
        total = self._prefix_sum(lens, indptr, n)
        write_tiles(rec[:1 + 3 * m], m, wi[:n], lens[:n], indptr, tiles, one_each)
        return self._finish(st, n, max_len, total, m, cap, perm)

    def _finish(self, st: _Staging, n: int, max_len: int, total: int, m: int, cap: int,
                perm: np.ndarray | None) -> LoRABatchInfo:
        """Copies the record written for m tiles and cap segments (and perm[:total]) and returns its info."""
        rec = st.array
        end = self._layout(m, cap)[2] + cap + 1
        if self.cuda_graph:
            if perm is not None:
                self._copy(st, self._record_len, self._dev)
                return self._info(self._g_wi, self._g_lens, self._g_indptr, self._g_perm, n, self.max_tokens,
                                  total, self._g_work, m)
            self._copy(st, end, self._g_dst[end])
            return self._info(self._g_wi, self._g_lens, self._g_indptr, None, n, self.max_tokens, total,
                              self._g_work, m)
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
        T = self.max_tokens
        total = int(np.add.reduce(c, dtype=np.int64)) if n else 0
        if total > T:
            raise ValueError(f"{total} tokens exceed max_tokens={T}")
        if not n:
            return self._emit(st, w[:0], c[:0], 0, 0, False, self._perm_buffer(st, 0))
        order = self._sort_order(w)
        ss = np.take(w, order, out=self._sorted_slots[:n])
        new = self._flags[:n]
        new[0] = True
        np.not_equal(ss[1:], ss[:-1], out=new[1:])
        first = np.flatnonzero(new)  # first sorted request of each segment
        k = first.size
        lens = self._seg_scratch[:k]
        p = self._perm_buffer(st, total)
        if total == n:  # one row per request (decode): the permutation is the sort order
            p[:n] = order
            np.subtract(first[1:], first[:-1], out=lens[:k - 1])
            lens[k - 1] = n - first[-1]
        else:
            cs = c[order]
            end = np.cumsum(cs, dtype=np.int32)  # end of each sorted request (int32: partial sums <= total)
            starts = end[first - 1]
            starts[0] = 0
            np.subtract(starts[1:], starts[:-1], out=lens[:k - 1])
            lens[k - 1] = total - starts[-1]
            # Segmented row i of sorted request j is physical row start_j + (i - segmented start_j).
            shift = (np.cumsum(c, dtype=np.int32) - c)[order] - end + cs
            np.add(np.repeat(shift, cs), self._iota[:total], out=p[:total])
        max_len, min_len = int(_max(lens)), int(_min(lens))
        return self._emit(st, ss[first], lens, k, max_len, max_len <= TILE_M and min_len >= 1, p)

    def _sort_order(self, w: np.ndarray) -> np.ndarray:
        """Stable argsort of the slots; as uint16 keys numpy sorts them by radix (O(n), 2-3x faster)."""
        if self.num_slots < 65535:
            keys = self._keys16[:w.size]
            np.add(w, 1, out=keys, casting="unsafe")
            return np.argsort(keys, kind="stable")
        return np.argsort(w, kind="stable")

    def _perm_buffer(self, st: _Staging, total: int) -> np.ndarray:
        """Where the permutation is written: the graph record's tail (restoring the identity the previous batch
        of this staging buffer overwrote), or a scratch array that _emit places after the eager record."""
        if not self.cuda_graph:
            return self._perm_scratch
        p = st.array[self._record_len - self.max_tokens:]
        if st.perm_dirty > total:
            p[total:st.perm_dirty] = self._iota[total:st.perm_dirty]
        st.perm_dirty = total
        return p

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
            st.event.record(self._current_stream() if self._is_cuda else None)
        self._next = (self._next + 1) % len(self._ring)
        self.builds += 1
        return dst

    def _current_stream(self):
        raw = _raw_stream(self._dev_index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        return stream

    def _info(self, wi, lens, indptr, perm, num_segments, max_seg_len, num_tokens, work, max_tiles) -> LoRABatchInfo:
        return LoRABatchInfo(seg_lens=lens, seg_indptr=indptr, weight_indices=wi, permutation=perm,
                             num_segments=num_segments, max_seg_len=max_seg_len, num_tokens=num_tokens,
                             lora_ranks=self.lora_ranks, scalings=self.scalings, work=work, max_tiles=max_tiles)
