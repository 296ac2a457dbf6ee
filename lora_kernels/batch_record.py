"""The host side of BatchInfoBuilder's record: validation of the scheduler's lists, and the numpy path
that writes segments and the work list (used for numpy/tensor inputs, or when the extension's C++
filler, csrc/host/batch_record.cpp, is not built). The record layout is in batch_info.py."""

from __future__ import annotations

import numpy as np
import torch

_SEQ = (list, tuple)
TILE_M = 16  # rows per work-list tile; the Triton kernels' BLOCK_M (one value for every batch: invariance)
# The ufunc reductions directly: ndarray.min/max add a Python-level wrapper per call.
_min, _max = np.minimum.reduce, np.maximum.reduce


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


def fill(dst: np.ndarray, values, name: str) -> None:
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


def check_host_lists(seg_token_counts, slots, max_segments: int) -> int:
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


class NumpyRecord:
    """Scratch arrays and the numpy steps of one builder (capacity max_segments requests / max_tokens rows)."""

    def __init__(self, max_tokens: int, max_segments: int, num_slots: int):
        S, T = max_segments, max_tokens
        self.max_tokens, self.num_slots = max_tokens, num_slots
        # int32 prefix sums cannot overflow when every count <= max_tokens and S * max_tokens fits.
        self.cumsum_safe = S * T < 2**31
        self.scratch64 = np.empty(S, dtype=np.int64)
        self.iota = np.arange(max(T, S + 1), dtype=np.int32)
        self._flags = np.empty(S, dtype=bool)
        self._sorted_slots = np.empty(S, dtype=np.int32)
        self._seg_scratch = np.empty(S, dtype=np.int32)
        self._keys16 = np.empty(S, dtype=np.uint16)

    def requests(self, w: np.ndarray, c: np.ndarray, seg_token_counts, slots) -> tuple[int, int, bool]:
        """w[:] = slots and c[:] = counts, both checked on the host; returns (min count, max count, every count
        is 1). When every count is 1, c is left unwritten."""
        fill(w, slots, "slots")
        if w.size and (_min(w) < -1 or _max(w) >= self.num_slots):
            bad = int(w[(w < -1) | (w >= self.num_slots)][0])
            raise ValueError(f"slot {bad} out of range: slots must be -1 or in [0, {self.num_slots})")
        n = c.size
        if not n:
            return 0, 0, False
        # Decode batches arrive as lists of 1s: list.count is one C loop, no conversion, nothing to check.
        if type(seg_token_counts) in _SEQ and seg_token_counts.count(1) == n:
            return 1, 1, True
        fill(c, seg_token_counts, "seg_token_counts")
        cmin, cmax = int(_min(c)), int(_max(c))
        if cmin < 0:
            raise ValueError(f"seg_token_counts must be >= 0, got {cmin}")
        if cmax > self.max_tokens:
            raise ValueError(f"{cmax} tokens exceed max_tokens={self.max_tokens}")
        return cmin, cmax, cmin == 1 and cmax == 1

    def prefix_sum(self, lens: np.ndarray, indptr: np.ndarray, n: int) -> int:
        """indptr[0] = 0, indptr[1:n+1] = cumsum(lens[:n]), the rest = the total (empty tail segments);
        returns the total after checking it against max_tokens."""
        indptr[0] = 0
        total = 0
        if n and self.cumsum_safe:
            np.cumsum(lens[:n], dtype=np.int32, out=indptr[1:n + 1])
            total = int(indptr[n])
        elif n:
            acc = self.scratch64[:n]
            np.cumsum(lens[:n], out=acc)
            total = int(acc[-1])
            if total <= self.max_tokens:
                indptr[1:n + 1] = acc
        if total > self.max_tokens:
            raise ValueError(f"{total} tokens exceed max_tokens={self.max_tokens}")
        indptr[n + 1:] = total
        return total

    def group(self, w: np.ndarray, c: np.ndarray, total: int, p: np.ndarray):
        """Groups n >= 1 requests (slots w, counts c) by slot: ascending slot, request order kept within it.
        Writes the permutation p[:total] (physical row of each segmented row); returns (segment slots,
        segment lengths, max length, min length)."""
        n = w.size
        order = self._sort_order(w)
        ss = np.take(w, order, out=self._sorted_slots[:n])
        new = self._flags[:n]
        new[0] = True
        np.not_equal(ss[1:], ss[:-1], out=new[1:])
        first = np.flatnonzero(new)  # first sorted request of each segment
        k = first.size
        lens = self._seg_scratch[:k]
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
            np.add(np.repeat(shift, cs), self.iota[:total], out=p[:total])
        return ss[first], lens, int(_max(lens)), int(_min(lens))

    def _sort_order(self, w: np.ndarray) -> np.ndarray:
        """Stable argsort of the slots; as uint16 keys numpy sorts them by radix (O(n), 2-3x faster)."""
        if self.num_slots < 65535:
            keys = self._keys16[:w.size]
            np.add(w, 1, out=keys, casting="unsafe")
            return np.argsort(keys, kind="stable")
        return np.argsort(w, kind="stable")
