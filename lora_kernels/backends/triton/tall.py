"""Tall tiles for long segments (prefill): each item is one group of GROUP consecutive work-list tiles and one
column tile, run with dots of GROUP * BLOCK_M rows (BLOCK_M: the work list's tile height, 16).

With 16-row tiles a prefill module re-reads every adapter's A and B blocks once per 16 rows, and each program
streams a chain of column tiles with one load in flight: the split path's expand reached 1.1-2.6x a memcpy of
base_out's bytes on the H200. Here the work list's tiles are taken GROUP at a time (group g: tiles
[g * GROUP, (g + 1) * GROUP)), and every item (group, column tile) is one program of a grid sized by the work
list's capacity (programs past the batch's items exit at once), so each SM keeps as many base_out tiles in
flight as fit. (A persistent grid striding over the items measured slower: one item in flight per program.)

A group may hold tiles of several segments (a prefill segment's last tile, decode rows of a mixed batch). Its
tiles are cut into runs: consecutive tiles with the same slot whose rows follow each other. Each run is one dot
of GROUP * BLOCK_M rows, masked to the run's rows, so a row is only ever computed with its own adapter.

Bits: the shrink runs the SPLIT K chunks of the split-K path (same BLOCK_K chains), and adds them in split
order in registers, as `_sum_splits` adds the partials, and stores v cast to the adapter's dtype (the cast the split
path's expand makes before its dot: the same bits, half the bytes of fp32 v); the expand runs one dot over
BLOCK_R, as `_expand_col` does. The per-row result of a `tl.dot` does not depend on the
tile height on sm90 (wgmma for 64-row tiles, mma.sync for 16 and 32: scripts/triton_dot_bits.py, and the GPU
tests assert the bits against the split path), so `apply_lora` may pick this path by the number of rows without
breaking batch invariance. The interpreter's numpy dots do depend on the height: there, only GROUP = 1 gives the
split path's bits (tested), taller groups are checked against float64.
"""

import triton
import triton.language as tl
from triton.language.extra import cuda as _gdc

from lora_kernels.backends.triton.kernels import _expand_col, _load_b, _load_v, _rank, _rows


@triton.jit
def _group(work, g0, n_tiles, MT, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The group's tiles g0 + [0, GROUP) as vectors, loaded together: (slot, first row, end row, link, count).
    The work list holds each tile's first row and its segment's end: a tile ends BLOCK_M rows on, or at that end.
    link[q]: tile q continues tile q - 1's run (same slot, rows that follow on); count: the tiles that exist."""
    idx = tl.arange(0, GROUP)
    t = g0 + idx
    valid = t < n_tiles
    slot = tl.load(work + 1 + t, mask=valid, other=-1)
    lo = tl.load(work + 1 + MT + t, mask=valid, other=0)
    hi = tl.minimum(tl.load(work + 1 + 2 * MT + t, mask=valid, other=0), lo + BLOCK_M)
    has_prev = valid & (idx > 0)
    prev_slot = tl.load(work + t, mask=has_prev, other=-2)
    prev_lo = tl.load(work + MT + t, mask=has_prev, other=0)
    prev_hi = tl.minimum(tl.load(work + 2 * MT + t, mask=has_prev, other=-1), prev_lo + BLOCK_M)
    link = has_prev & (slot == prev_slot) & (lo == prev_hi)
    return slot, lo, hi, link, tl.minimum(n_tiles - g0, GROUP)


@triton.jit
def _next_run(r, slot_v, lo_v, hi_v, link_v, GROUP: tl.constexpr):
    """The run that starts at tile r of the group: (slot, first row, end row, the tile after it)."""
    idx = tl.arange(0, GROUP)
    end = tl.min(tl.where((idx > r) & (link_v == 0), idx, GROUP), axis=0)
    slot = tl.sum(tl.where(idx == r, slot_v, 0), axis=0)
    lo = tl.sum(tl.where(idx == r, lo_v, 0), axis=0)
    hi = tl.sum(tl.where(idx == end - 1, hi_v, 0), axis=0)
    return slot, lo, hi, end


@triton.jit(do_not_specialize=["MT"])
def _tall_shrink_kernel(x_ptr, a_ptr, out_ptr, work, lora_ranks, perm_ptr, MT, K, R, NR, k_chunk,
                        HAS_PERM: tl.constexpr, SPLIT: tl.constexpr, GROUP: tl.constexpr, N_COLS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                        PDL: tl.constexpr):
    """Item (group, column tile): v[row, c] = the sum over the SPLIT K chunks, in split order, of each chunk's
    BLOCK_K dot chain, for every run of the group; 0 for columns j >= rank and rows of slot -1 / rank 0."""
    if PDL:
        _gdc.gdc_launch_dependents()
    it = tl.program_id(0)
    n_tiles = tl.load(work)
    if PDL:
        _gdc.gdc_wait()
    if it < tl.cdiv(n_tiles, GROUP) * N_COLS:
        g0 = (it // N_COLS) * GROUP
        cols = (it % N_COLS) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < NR
        slot_v, lo_v, hi_v, link_v, count = _group(work, g0, n_tiles, MT, GROUP, BLOCK_M)
        r = 0
        while r < count:
            slot, lo, hi, r = _next_run(r, slot_v, lo_v, hi_v, link_v, GROUP)
            rank, slot64 = _rank(slot, lora_ranks)
            rows, row_mask = _rows(perm_ptr, lo, hi, GROUP * BLOCK_M, HAS_PERM)
            live = col_mask & ((cols % R) < rank)
            acc = tl.zeros((GROUP * BLOCK_M, BLOCK_N), dtype=tl.float32)
            if rank > 0:
                a_rows = a_ptr + (slot64 * NR + cols[:, None]) * K
                x_rows = x_ptr + rows[:, None] * K
                for s in range(SPLIT):
                    k_begin = s * k_chunk
                    k_end = tl.minimum(k_begin + k_chunk, K)
                    chain = tl.zeros((GROUP * BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for k in range(k_begin, k_end, BLOCK_K):
                        kk = k + tl.arange(0, BLOCK_K)
                        k_mask = kk < k_end
                        at = tl.load(a_rows + kk[None, :], mask=live[:, None] & k_mask[None, :], other=0.0)
                        xt = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                        chain = tl.dot(xt, tl.trans(at), chain, input_precision=DOT_PREC)
                    if s == 0:
                        acc = chain
                    else:
                        acc += chain
            acc = tl.where(live[None, :], acc, 0.0)
            tl.store(out_ptr + rows[:, None] * NR + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _col_span(c, off1, off2, off3, t1, t2, t3, OUT, BLOCK_N: tl.constexpr):
    """Column tile c (numbered over all slices, slice i owning tiles [t_i, t_{i+1})): its slice i, columns n and
    their mask (columns of slice i only)."""
    i = (c >= t1).to(tl.int32) + (c >= t2).to(tl.int32) + (c >= t3).to(tl.int32)
    ts = tl.where(i == 0, 0, tl.where(i == 1, t1, tl.where(i == 2, t2, t3)))
    lo = tl.where(i == 0, 0, tl.where(i == 1, off1, tl.where(i == 2, off2, off3)))
    hi = tl.where(i == 0, off1, tl.where(i == 1, off2, tl.where(i == 2, off3, OUT)))
    n = lo + (c - ts) * BLOCK_N + tl.arange(0, BLOCK_N)
    return i, n, n < hi


@triton.jit(do_not_specialize=["MT"])
def _tall_expand_kernel(v_ptr, b_ptr, out_ptr, work, lora_ranks, scalings, perm_ptr,
                        MT, R, NR, OUT, off1, off2, off3, t1, t2, t3,
                        HAS_PERM: tl.constexpr, GROUP: tl.constexpr, N_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
                        ASSIGN: tl.constexpr):
    """Item (group, column tile): out[row, n] += scaling * v[row, i*R:(i+1)*R] B[slot, n, :]ᵀ for every run of the
    group with rank > 0 (v reduced, in the adapter's dtype); base_out's tile is loaded before v and B (the kernel is bound by
    base_out's read and write). ASSIGN: out[row, n] = that delta instead (0 for rows of slot -1 / rank 0), with
    no read of out: `lora_linear`'s "first" mode, whose base GEMM then adds onto it."""
    if PDL:
        _gdc.gdc_launch_dependents()
    it = tl.program_id(0)
    n_tiles = tl.load(work)
    if PDL:
        _gdc.gdc_wait()
    if it < tl.cdiv(n_tiles, GROUP) * N_COLS:
        g0 = (it // N_COLS) * GROUP
        i, n, n_mask = _col_span(it % N_COLS, off1, off2, off3, t1, t2, t3, OUT, BLOCK_N)
        j = tl.arange(0, BLOCK_R)
        slot_v, lo_v, hi_v, link_v, count = _group(work, g0, n_tiles, MT, GROUP, BLOCK_M)
        r = 0
        for q in tl.static_range(GROUP):  # unrolled, not a loop: a loop's hoisted invariants took 126 registers
            if r < count:
                slot, lo, hi, r = _next_run(r, slot_v, lo_v, hi_v, link_v, GROUP)
                rank, slot64 = _rank(slot, lora_ranks)
                if rank > 0:
                    rows, row_mask = _rows(perm_ptr, lo, hi, GROUP * BLOCK_M, HAS_PERM)
                    if ASSIGN:  # 0 + scaling * acc: the delta alone, as the base's own rounding will add it
                        base = tl.zeros((GROUP * BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
                    else:
                        base = tl.load(out_ptr + rows[:, None] * OUT + n[None, :],
                                       mask=row_mask[:, None] & n_mask[None, :], other=0.0)
                    j_mask = j < rank
                    vt = _load_v(v_ptr, rows, row_mask, i, R, j, j_mask, 0, NR, 1, False).to(b_ptr.dtype.element_ty)
                    bt = _load_b(b_ptr + slot64 * OUT * R, n, n_mask, j, j_mask, R)
                    _expand_col(vt, bt, base, out_ptr, rows, row_mask, n, n_mask, tl.load(scalings + slot64), OUT,
                                DOT_PREC)
                elif ASSIGN:
                    rows, row_mask = _rows(perm_ptr, lo, hi, GROUP * BLOCK_M, HAS_PERM)
                    tl.store(out_ptr + rows[:, None] * OUT + n[None, :],
                             tl.zeros((GROUP * BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty),
                             mask=row_mask[:, None] & n_mask[None, :])
