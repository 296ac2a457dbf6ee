"""Tall tiles for long segments (prefill): GROUP consecutive work-list tiles of one segment per item.

With 16-row tiles a prefill module re-reads every adapter's A and B blocks once per 16 rows: at r64 that
is about 5 GB of L2 traffic per Llama-3-8B layer of 8192 rows, more than the layer's HBM bytes. Here one
item takes up to GROUP tiles of a segment, loads each A (or B) block once and runs GROUP dots of the
ordinary 16-row height on it, so the L2 traffic drops by GROUP while every row's product is the same
instruction sequence as in the 16-row kernels (a taller `tl.dot` could lower to another tensor-core
instruction, and its bits are not promised to match).

The shrink runs the SPLIT K chunks of its item in one program and adds their chains in split order in
registers: exactly what `_sum_splits` does with the fp32 partials of the split-K path, without writing and
re-reading them. So a row's v and output bits equal those of the 16-row path (tested), and `apply_lora` may
pick this path by the number of rows without breaking batch invariance.

Tall tiles are counted back from each segment's end: tile t leads one if it is its segment's first tile
(tile t - 1 ends elsewhere) or has a multiple of GROUP tiles after it, minus one; it covers itself and the
tiles up to the next leader. Non-leading tiles' items do nothing.
"""

import triton
import triton.language as tl
from triton.language.extra import cuda as _gdc

from lora_kernels.backends.triton.kernels import (_chunk, _expand_col, _expand_tile, _load_b, _load_v, _rank, _rows,
                                                  _shrink_dot, _slice_span, _tile)

GROUP = 4  # work-list tiles per tall tile: the kernels below hold one accumulator per tile


@triton.jit
def _tall_head(work, t, MT, TILE: tl.constexpr):
    """(slot, first row, end row, leads) of the tall tile that tile t leads (leads False: t does not lead one)."""
    slot, row0, end = _tile(work, t, MT)
    prev_end = tl.load(work + 2 * MT + t, mask=t > 0, other=-1)  # end row of tile t - 1
    after = (end - row0 - 1) // TILE  # tiles after t in its segment
    lim = tl.minimum(end, row0 + TILE * (after % 4 + 1))
    return slot, row0, lim, (prev_end != end) | (after % 4 == 3)


@triton.jit
def _tall_chain(x_ptr, a_rows, r0, r1, r2, r3, m0, m1, m2, m3, live, k_begin, k_end, K, c0, c1, c2, c3,
                BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """The 16-row dot chain of `_shrink_dot` over [k_begin, k_end) for four row tiles sharing each A block."""
    for k in range(k_begin, k_end, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        k_mask = kk < k_end
        at = tl.trans(tl.load(a_rows + kk[None, :], mask=live[:, None] & k_mask[None, :], other=0.0))
        c0 = tl.dot(tl.load(x_ptr + r0[:, None] * K + kk[None, :], mask=m0[:, None] & k_mask[None, :], other=0.0),
                    at, c0, input_precision=DOT_PREC)
        c1 = tl.dot(tl.load(x_ptr + r1[:, None] * K + kk[None, :], mask=m1[:, None] & k_mask[None, :], other=0.0),
                    at, c1, input_precision=DOT_PREC)
        c2 = tl.dot(tl.load(x_ptr + r2[:, None] * K + kk[None, :], mask=m2[:, None] & k_mask[None, :], other=0.0),
                    at, c2, input_precision=DOT_PREC)
        c3 = tl.dot(tl.load(x_ptr + r3[:, None] * K + kk[None, :], mask=m3[:, None] & k_mask[None, :], other=0.0),
                    at, c3, input_precision=DOT_PREC)
    return c0, c1, c2, c3


@triton.jit
def _store_v(out_ptr, rows, row_mask, cols, col_mask, live, acc, NR):
    acc = tl.where(live[None, :], acc, 0.0)
    tl.store(out_ptr + rows[:, None] * NR + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _shrink_one(x_ptr, a_ptr, out_ptr, lora_ranks, perm_ptr, slot, row0, lim, w, K, R, NR, k_chunk,
                HAS_PERM: tl.constexpr, SPLIT: tl.constexpr, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """A tall shrink item with one dot of 4 * BLOCK_M rows per K step."""
    rank, slot64 = _rank(slot, lora_ranks)
    rows, row_mask = _rows(perm_ptr, row0, lim, 4 * BLOCK_M, HAS_PERM)
    cols = (w % N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NR
    live = col_mask & ((cols % R) < rank)
    acc = tl.zeros((4 * BLOCK_M, BLOCK_N), dtype=tl.float32)
    if rank > 0:
        acc = _shrink_dot(x_ptr, a_ptr, rows, row_mask, slot64, cols, live, 0, tl.minimum(k_chunk, K), K, NR,
                          BLOCK_K, DOT_PREC, False)
        for s in range(1, SPLIT):  # later chunks added in split order, as _sum_splits adds the partials
            k_begin = s * k_chunk
            acc += _shrink_dot(x_ptr, a_ptr, rows, row_mask, slot64, cols, live, k_begin,
                               tl.minimum(k_begin + k_chunk, K), K, NR, BLOCK_K, DOT_PREC, False)
    _store_v(out_ptr, rows, row_mask, cols, col_mask, live, acc, NR)


@triton.jit
def _shrink_four(x_ptr, a_ptr, out_ptr, lora_ranks, perm_ptr, slot, row0, lim, w, K, R, NR, k_chunk,
                 HAS_PERM: tl.constexpr, SPLIT: tl.constexpr, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """A tall shrink item with four dots of BLOCK_M rows per K step, sharing each A block."""
    rank, slot64 = _rank(slot, lora_ranks)
    r0, m0 = _rows(perm_ptr, row0, lim, BLOCK_M, HAS_PERM)
    r1, m1 = _rows(perm_ptr, row0 + BLOCK_M, lim, BLOCK_M, HAS_PERM)
    r2, m2 = _rows(perm_ptr, row0 + 2 * BLOCK_M, lim, BLOCK_M, HAS_PERM)
    r3, m3 = _rows(perm_ptr, row0 + 3 * BLOCK_M, lim, BLOCK_M, HAS_PERM)
    cols = (w % N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NR
    live = col_mask & ((cols % R) < rank)
    s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s1, s2, s3 = s0, s0, s0
    if rank > 0:
        a_rows = a_ptr + (slot64 * NR + cols[:, None]) * K
        z = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        s0, s1, s2, s3 = _tall_chain(x_ptr, a_rows, r0, r1, r2, r3, m0, m1, m2, m3, live, 0,
                                     tl.minimum(k_chunk, K), K, z, z, z, z, BLOCK_K, DOT_PREC)
        for s in range(1, SPLIT):  # later chunks added in split order, as _sum_splits adds the partials
            k_begin = s * k_chunk
            c0, c1, c2, c3 = _tall_chain(x_ptr, a_rows, r0, r1, r2, r3, m0, m1, m2, m3, live, k_begin,
                                         tl.minimum(k_begin + k_chunk, K), K, z, z, z, z, BLOCK_K, DOT_PREC)
            s0, s1, s2, s3 = s0 + c0, s1 + c1, s2 + c2, s3 + c3
    _store_v(out_ptr, r0, m0, cols, col_mask, live, s0, NR)
    _store_v(out_ptr, r1, m1, cols, col_mask, live, s1, NR)
    _store_v(out_ptr, r2, m2, cols, col_mask, live, s2, NR)
    _store_v(out_ptr, r3, m3, cols, col_mask, live, s3, NR)


@triton.jit(do_not_specialize=["MT"])
def _tall_shrink_kernel(x_ptr, a_ptr, out_ptr, work, lora_ranks, perm_ptr, MT, K, R, NR, k_chunk,
                        HAS_PERM: tl.constexpr, SPLIT: tl.constexpr, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
                        ONE_DOT: tl.constexpr):
    """Item (tile, column tile): v[row, c] = sum over the SPLIT chunks, in split order, of each chunk's chain, for
    the rows of the tall tile that the tile leads; 0 for columns j >= rank and for slot -1 / rank-0 rows.
    ONE_DOT: one dot of 4 * BLOCK_M rows per K step instead of four of BLOCK_M (on sm90 wgmma instead of
    mma.sync: the same bits per row on the H200, scripts/triton_dot_bits.py; not in the interpreter)."""
    if PDL:
        _gdc.gdc_launch_dependents()
        _gdc.gdc_wait()
    start, stop = _chunk(tl.load(work) * N_TILES)
    for w in range(start, stop):
        slot, row0, lim, leads = _tall_head(work, w // N_TILES, MT, BLOCK_M)
        if leads:
            if ONE_DOT:
                _shrink_one(x_ptr, a_ptr, out_ptr, lora_ranks, perm_ptr, slot, row0, lim, w, K, R, NR, k_chunk,
                            HAS_PERM, SPLIT, N_TILES, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)
            else:
                _shrink_four(x_ptr, a_ptr, out_ptr, lora_ranks, perm_ptr, slot, row0, lim, w, K, R, NR, k_chunk,
                             HAS_PERM, SPLIT, N_TILES, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC)


@triton.jit
def _tall_col(bt, vt, out_ptr, rows, row_mask, n, n_mask, scale, OUT, DOT_PREC: tl.constexpr):
    """One row tile of a four-dot column tile: its base rows, then _expand_col (the one place that writes out)."""
    base = tl.load(out_ptr + rows[:, None] * OUT + n[None, :], mask=row_mask[:, None] & n_mask[None, :], other=0.0)
    _expand_col(vt, bt, base, out_ptr, rows, row_mask, n, n_mask, scale, OUT, DOT_PREC)


@triton.jit
def _expand_four(v_ptr, b_ptr, out_ptr, scalings, perm_ptr, slot64, rank, row0, lim, c0, c1, R, NR, OUT, off1, off2,
                 off3, t1, t2, t3, HAS_PERM: tl.constexpr, N_TILES: tl.constexpr, SLICES: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr):
    """A tall expand item with four dots of BLOCK_M rows per column tile, sharing each B block."""
    r0, m0 = _rows(perm_ptr, row0, lim, BLOCK_M, HAS_PERM)
    r1, m1 = _rows(perm_ptr, row0 + BLOCK_M, lim, BLOCK_M, HAS_PERM)
    r2, m2 = _rows(perm_ptr, row0 + 2 * BLOCK_M, lim, BLOCK_M, HAS_PERM)
    r3, m3 = _rows(perm_ptr, row0 + 3 * BLOCK_M, lim, BLOCK_M, HAS_PERM)
    scale = tl.load(scalings + slot64)
    j = tl.arange(0, BLOCK_R)
    j_mask = j < rank
    b_slot = b_ptr + slot64 * OUT * R
    dt = b_ptr.dtype.element_ty
    for i in tl.static_range(SLICES):
        ts, lo, hi, a, b = _slice_span(i, c0, c1, off1, off2, off3, t1, t2, t3, N_TILES, OUT)
        if a < b:
            v0 = _load_v(v_ptr, r0, m0, i, R, j, j_mask, 0, NR, 1, False).to(dt)
            v1 = _load_v(v_ptr, r1, m1, i, R, j, j_mask, 0, NR, 1, False).to(dt)
            v2 = _load_v(v_ptr, r2, m2, i, R, j, j_mask, 0, NR, 1, False).to(dt)
            v3 = _load_v(v_ptr, r3, m3, i, R, j, j_mask, 0, NR, 1, False).to(dt)
            for ct in range(a, b):
                n = lo + (ct - ts) * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = n < hi
                bt = _load_b(b_slot, n, n_mask, j, j_mask, R)
                _tall_col(bt, v0, out_ptr, r0, m0, n, n_mask, scale, OUT, DOT_PREC)
                _tall_col(bt, v1, out_ptr, r1, m1, n, n_mask, scale, OUT, DOT_PREC)
                _tall_col(bt, v2, out_ptr, r2, m2, n, n_mask, scale, OUT, DOT_PREC)
                _tall_col(bt, v3, out_ptr, r3, m3, n, n_mask, scale, OUT, DOT_PREC)


@triton.jit(do_not_specialize=["MT"])
def _tall_expand_kernel(v_ptr, b_ptr, out_ptr, work, lora_ranks, scalings, perm_ptr,
                        MT, R, NR, OUT, off1, off2, off3, t1, t2, t3,
                        HAS_PERM: tl.constexpr, N_TILES: tl.constexpr, SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
                        ONE_DOT: tl.constexpr):
    """Item (tile, column tile) of a leading tile: out[row, n] += scaling * v[row, i*R:(i+1)*R] B[slot, n, :]ᵀ for
    the rows of its tall tile; v (reduced, SPLIT 1) is loaded once per slice of the program's chunk of the tile.
    ONE_DOT: one dot of 4 * BLOCK_M rows per column tile, the next tile's loads in flight (_expand_tile)."""
    if PDL:
        _gdc.gdc_launch_dependents()
        _gdc.gdc_wait()
    start, stop = _chunk(tl.load(work) * N_TILES)
    t = start // N_TILES
    while t * N_TILES < stop:
        slot, row0, lim, leads = _tall_head(work, t, MT, BLOCK_M)
        rank, slot64 = _rank(slot, lora_ranks)
        c0, c1 = tl.maximum(start - t * N_TILES, 0), tl.minimum(stop - t * N_TILES, N_TILES)
        if leads & (rank > 0):
            if ONE_DOT:
                # The 16-row expand's code on all the tall tile's rows, with the next column tile's loads in flight
                # (the expand is bound by base_out's DRAM traffic); v is reduced (SPLIT 1), nothing to wait for.
                rows, row_mask = _rows(perm_ptr, row0, lim, 4 * BLOCK_M, HAS_PERM)
                _expand_tile(v_ptr, work, t, 0, b_ptr, out_ptr, rows, row_mask, slot64, rank, tl.load(scalings + slot64),
                             c0, c1, R, NR, OUT, 0, off1, off2, off3, t1, t2, t3, 1, N_TILES, SLICES, BLOCK_N, BLOCK_R,
                             DOT_PREC, False, True)
            else:
                _expand_four(v_ptr, b_ptr, out_ptr, scalings, perm_ptr, slot64, rank, row0, lim, c0, c1, R, NR, OUT,
                             off1, off2, off3, t1, t2, t3, HAS_PERM, N_TILES, SLICES, BLOCK_M, BLOCK_N, BLOCK_R,
                             DOT_PREC)
        t += 1
