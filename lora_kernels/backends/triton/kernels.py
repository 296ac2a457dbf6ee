"""Triton SGMV kernels (DESIGN.md §5), v3: fixed-size grids over the builder's work list.

Work list (batch_info.py): `work[0]` = number of tiles; tile t covers segmented rows
[row0[t], end[t]) (at most TILE_M = BLOCK_M rows of one segment) with adapter slot[t], where
slot = work[1 + t], row0 = work[1 + MT + t], end = work[1 + 2 MT + t] (MT = the list's capacity).
A kernel's items are (tile, inner index) pairs numbered tile-major; its P programs (a fixed multiple of
the SM count) each take one contiguous chunk of ceil(items / P) of them, so a program reads a tile's
metadata once and then streams consecutive column tiles or K splits of it. A CUDA graph captured
once replays for any batch; the cost follows the real tiles.

Batch invariance: every reduction runs in an order fixed by the shapes alone. Each row goes through
the same BLOCK_M-row `tl.dot`s whatever the batch; the shrink splits K into SPLIT chunks (SPLIT from
in_dim only), each one dot chain over BLOCK_K steps; the partials are added in split order by
`_sum_splits` (in the expand or in the reduction kernel). A row's bits therefore do not depend on the
other rows of its tile, the grid, sorting or capture.

PDL (sm90+): kernels call `gdc_launch_dependents` first; the shrink reads its first adapter block (no
earlier kernel writes adapters) before `gdc_wait`; x, the partials and out are read after it.
"""

import triton
import triton.language as tl
from triton.language.extra import cuda as _gdc


@triton.jit
def _tile(work, t, MT):
    """(slot, first segmented row, end row) of tile t."""
    return tl.load(work + 1 + t), tl.load(work + 1 + MT + t), tl.load(work + 1 + 2 * MT + t)


@triton.jit
def _rows(perm_ptr, row0, end, BLOCK_M: tl.constexpr, HAS_PERM: tl.constexpr):
    """Physical rows of the tile starting at segmented row row0, and their mask."""
    m = row0 + tl.arange(0, BLOCK_M)
    mask = m < end
    if HAS_PERM:
        m = tl.load(perm_ptr + m, mask=mask, other=0)
    return m.to(tl.int64), mask


@triton.jit
def _rank(slot, lora_ranks):
    """Rank of `slot` (0 for slot -1) and the slot clamped to a valid index."""
    active = slot >= 0
    rank = tl.load(lora_ranks + tl.where(active, slot, 0))
    return tl.where(active, rank, 0), tl.where(active, slot, 0).to(tl.int64)


@triton.jit
def _chunk(items):
    """This program's contiguous range [start, stop) of `items` work items."""
    per = tl.cdiv(items, tl.num_programs(0))
    start = tl.program_id(0) * per
    return start, tl.minimum(start + per, items)


@triton.jit
def _sum_splits(ws_ptr, rows, row_mask, cols, col_mask, split_stride, row_stride, SPLIT: tl.constexpr,
                PAST_L1: tl.constexpr):
    """sum_s ws[s, rows, cols] in fp32, added strictly in split order (the batch-invariant reduction).
    PAST_L1: read with .cg (past L1), for partials that other SMs wrote during this kernel. (A flag, not a
    cache-modifier string: Triton 3.6 does not pass a string constexpr's default to a called jit function.)"""
    ptrs = ws_ptr + rows[:, None] * row_stride + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if PAST_L1:
        acc = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ptrs + s * split_stride, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        acc = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ptrs + s * split_stride, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _shrink_dot(x_ptr, a_ptr, rows, row_mask, slot64, cols, live, k_begin, k_end, K, NR,
                BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    """fp32 x[rows, k_begin:k_end] @ A[slot, cols, k_begin:k_end]ᵀ as one dot chain over BLOCK_K steps (the order
    every shrink path uses). The first A block is read before `gdc_wait`: no earlier kernel writes adapters."""
    a_rows = a_ptr + (slot64 * NR + cols[:, None]) * K
    x_rows = x_ptr + rows[:, None] * K
    kk = k_begin + tl.arange(0, BLOCK_K)
    k_mask = kk < k_end
    at = tl.load(a_rows + kk[None, :], mask=live[:, None] & k_mask[None, :], other=0.0)
    if PDL:
        _gdc.gdc_wait()
    xt = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    acc = tl.dot(xt, tl.trans(at), input_precision=DOT_PREC)
    for k in range(k_begin + BLOCK_K, k_end, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        k_mask = kk < k_end
        at = tl.load(a_rows + kk[None, :], mask=live[:, None] & k_mask[None, :], other=0.0)
        xt = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)
    return acc


@triton.jit(do_not_specialize=["MT", "num_rows"])
def _shrink_kernel(x_ptr, a_ptr, out_ptr, work, lora_ranks, perm_ptr,
                   MT, K, R, NR, num_rows, k_chunk,
                   HAS_PERM: tl.constexpr, PARTIAL: tl.constexpr, SPLIT: tl.constexpr, N_TILES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                   PDL: tl.constexpr):
    """Item (tile, column tile, split s): out[(s,) row, c] = sum over K chunk s of x[row, k] * A[slot, c, k].

    Columns are the flat S*R axis (c = i*R + j); only j < rank are read. PARTIAL: out is the workspace
    [SPLIT, T, NR] and only live columns of LoRA rows are written. Otherwise (SPLIT == 1) out is v and
    the tile's whole row span is written (0 for j >= rank, slot -1 and rank 0).
    """
    if PDL:
        _gdc.gdc_launch_dependents()
    start, stop = _chunk(tl.load(work) * (N_TILES * SPLIT))
    for w in range(start, stop):
        slot, row0, end = _tile(work, w // (N_TILES * SPLIT), MT)
        rank, slot64 = _rank(slot, lora_ranks)
        need = rank > 0
        if not PARTIAL:  # v itself: zeros are written for rank-0 tiles too
            need = rank >= 0
        if need:
            ks = w % SPLIT
            rows, row_mask = _rows(perm_ptr, row0, end, BLOCK_M, HAS_PERM)
            cols = ((w // SPLIT) % N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < NR
            live = col_mask & ((cols % R) < rank)
            k_begin = ks * k_chunk
            acc = _shrink_dot(x_ptr, a_ptr, rows, row_mask, slot64, cols, live, k_begin,
                              tl.minimum(k_begin + k_chunk, K), K, NR, BLOCK_K, DOT_PREC, PDL)
            out_ptrs = out_ptr + (ks * num_rows + rows[:, None]) * NR + cols[None, :]
            if PARTIAL:
                tl.store(out_ptrs, acc, mask=row_mask[:, None] & live[None, :])
            else:
                acc = tl.where(live[None, :], acc, 0.0)
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["MT", "num_rows"])
def _reduce_kernel(ws_ptr, out_ptr, work, lora_ranks, perm_ptr, MT, R, NR, num_rows,
                   HAS_PERM: tl.constexpr, SPLIT: tl.constexpr, N_TILES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """v[row, c] = sum_s ws[s, row, c] for live columns, 0 for the rest of every covered row."""
    if PDL:
        _gdc.gdc_launch_dependents()
        _gdc.gdc_wait()
    start, stop = _chunk(tl.load(work) * N_TILES)
    for w in range(start, stop):
        slot, row0, end = _tile(work, w // N_TILES, MT)
        rank, slot64 = _rank(slot, lora_ranks)
        rows, row_mask = _rows(perm_ptr, row0, end, BLOCK_M, HAS_PERM)
        cols = (w % N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < NR
        live = col_mask & ((cols % R) < rank)
        acc = _sum_splits(ws_ptr, rows, row_mask, cols, live, num_rows * NR, NR, SPLIT, False)
        tl.store(out_ptr + rows[:, None] * NR + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _pick(i: tl.constexpr, a0, a1, a2, a3):
    if i == 0:
        return a0
    elif i == 1:
        return a1
    elif i == 2:
        return a2
    else:
        return a3


@triton.jit
def _expand_head(work, t, MT, start, stop, lora_ranks, scalings, perm_ptr, N_TILES: tl.constexpr,
                 BLOCK_M: tl.constexpr, HAS_PERM: tl.constexpr):
    """Tile t of an expand chunk [start, stop): rank, slot, rows, scaling and its column tiles [c0, c1); a
    tile with no item in the chunk (t * N_TILES >= stop: a program with no items) reads nothing and gets rank
    0 (the kernels read the first tile's head before gdc_wait, before they know)."""
    live = t * N_TILES < stop
    slot = tl.load(work + 1 + t, mask=live, other=-1)
    row0 = tl.load(work + 1 + MT + t, mask=live, other=0)
    end = tl.load(work + 1 + 2 * MT + t, mask=live, other=0)
    rank, slot64 = _rank(slot, lora_ranks)
    rows, row_mask = _rows(perm_ptr, row0, end, BLOCK_M, HAS_PERM)
    scale = tl.load(scalings + slot64)
    return (rank, slot64, rows, row_mask, scale, tl.maximum(start - t * N_TILES, 0),
            tl.minimum(stop - t * N_TILES, N_TILES))


@triton.jit
def _slice_span(i: tl.constexpr, c0, c1, off1, off2, off3, t1, t2, t3, N_TILES: tl.constexpr, OUT):
    """Slice i's first column tile ts, its columns [lo, hi), and the part [a, b) of column tiles [c0, c1) in it
    (the plan pads t_k / off_k of absent slices with the ends)."""
    ts = _pick(i, 0, t1, t2, t3)
    te = _pick(i, t1, t2, t3, N_TILES)
    lo = _pick(i, 0, off1, off2, off3)
    hi = _pick(i, off1, off2, off3, OUT)
    return ts, lo, hi, tl.maximum(c0, ts), tl.minimum(c1, te)


@triton.jit
def _load_v(v_ptr, rows, row_mask, i, R, j, j_mask, split_stride, NR, SPLIT: tl.constexpr, PAST_L1: tl.constexpr):
    """Slice i of v for rows (the sum of SPLIT partials), columns j < rank (j_mask), 0 beyond. Read up to R (a
    bound that keeps the loads vectorized: rank is data, R a 16-divisible argument) and selected after the sum:
    the partials beyond rank are never written, so their garbage is dropped by the select, never added."""
    vt = _sum_splits(v_ptr, rows, row_mask, i * R + j, j < R, split_stride, NR, SPLIT, PAST_L1)
    return tl.where(j_mask[None, :], vt, 0.0)


@triton.jit
def _load_b(b_slot, n, n_mask, j, j_mask, R):
    """A column tile's B block, columns j < rank (0 beyond): loaded up to R, so vectorized, then selected."""
    bt = tl.load(b_slot + n[:, None] * R + j[None, :], mask=n_mask[:, None] & (j < R)[None, :], other=0.0)
    return tl.where(j_mask[None, :], bt, 0.0)


@triton.jit
def _load_col(b_slot, out_ptr, rows, row_mask, n, n_mask, j, j_mask, R, OUT):
    """A column tile's B block and its base_out rows."""
    base = tl.load(out_ptr + rows[:, None] * OUT + n[None, :], mask=row_mask[:, None] & n_mask[None, :], other=0.0)
    return _load_b(b_slot, n, n_mask, j, j_mask, R), base


@triton.jit
def _expand_col(vt, bt, base, out_ptr, rows, row_mask, n, n_mask, scale, OUT, DOT_PREC: tl.constexpr):
    """One column tile: out[rows, n] = base + scale * vt B[n, :]ᵀ (bt, base loaded by _load_col)."""
    acc = tl.dot(vt, tl.trans(bt), input_precision=DOT_PREC)
    tl.store(out_ptr + rows[:, None] * OUT + n[None, :],
             (base.to(tl.float32) + scale * acc).to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _expand_tile(v_ptr, sync_ptr, t, need, b_ptr, out_ptr, rows, row_mask, slot64, rank, scale, c0, c1, R, NR, OUT,
                 num_rows, off1, off2, off3, t1, t2, t3, SPLIT: tl.constexpr, N_TILES: tl.constexpr,
                 SLICES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr,
                 WAIT: tl.constexpr, PREFETCH: tl.constexpr):
    """Column tiles [c0, c1) of tile t: out[row, n] += scale * sum_{j<rank} v[row, i*R + j] * B[slot, n, j], v the
    sum of SPLIT partials, loaded once per slice, then a loop over the slice's column tiles: uniform, or with
    PREFETCH the next column tile's B block and base rows loaded before this one is computed (two tiles in flight
    per program, by hand: the table's num_stages 1 keeps Triton from staging them through shared memory). (A
    peeled first tile that loaded B before v measured 20% slower at decode on the H200: more registers.) WAIT (the
    fused kernel): v's partials are written by other programs of this launch; wait until sync_ptr[t] counts
    `need` arrivals and read v past L1. Every expand computes a column tile with `_load_v`, `_load_b` and
    `_expand_col` (the tall one too, on its taller rows). The caller has passed gdc_wait."""
    j = tl.arange(0, BLOCK_R)
    j_mask = j < rank
    b_slot = b_ptr + slot64 * OUT * R
    for i in tl.static_range(SLICES):
        ts, lo, hi, a, b = _slice_span(i, c0, c1, off1, off2, off3, t1, t2, t3, N_TILES, OUT)
        if a < b:
            v_rows = row_mask
            if WAIT:  # at once after the first slice
                # Polled with plain (volatile) loads, then one acquire: a read-modify-write per poll from every
                # waiting program would contend with the arrivals on the counter's L2 line. v's loads take the
                # acquire's result in their mask (always true): Triton 3.6 drops an atomic whose result is unused,
                # and the dependence keeps the loads after it.
                while tl.load(sync_ptr + t, volatile=True) < need:
                    pass
                v_rows = row_mask & (tl.atomic_add(sync_ptr + t, 0, sem="acquire") >= need)
            vt = _load_v(v_ptr, rows, v_rows, i, R, j, j_mask, num_rows * NR, NR, SPLIT, WAIT)
            vt = vt.to(b_ptr.dtype.element_ty)
            if PREFETCH:
                n = lo + (a - ts) * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = n < hi
                bt, base = _load_col(b_slot, out_ptr, rows, row_mask, n, n_mask, j, j_mask, R, OUT)
                for ct in range(a, b):
                    nn = n + BLOCK_N
                    nn_mask = (nn < hi) & (ct + 1 < b)
                    nbt, nbase = _load_col(b_slot, out_ptr, rows, row_mask, nn, nn_mask, j, j_mask, R, OUT)
                    _expand_col(vt, bt, base, out_ptr, rows, row_mask, n, n_mask, scale, OUT, DOT_PREC)
                    n, n_mask, bt, base = nn, nn_mask, nbt, nbase
            else:
                for ct in range(a, b):
                    n = lo + (ct - ts) * BLOCK_N + tl.arange(0, BLOCK_N)
                    n_mask = n < hi
                    bt, base = _load_col(b_slot, out_ptr, rows, row_mask, n, n_mask, j, j_mask, R, OUT)
                    _expand_col(vt, bt, base, out_ptr, rows, row_mask, n, n_mask, scale, OUT, DOT_PREC)


@triton.jit(do_not_specialize=["MT", "num_rows"])
def _expand_kernel(v_ptr, b_ptr, out_ptr, work, lora_ranks, scalings, perm_ptr,
                   MT, R, NR, OUT, num_rows, off1, off2, off3, t1, t2, t3,
                   HAS_PERM: tl.constexpr, SPLIT: tl.constexpr, N_TILES: tl.constexpr, SLICES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr,
                   PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """Item (tile, column tile): out[row, n] += scaling * sum_{j<rank} v[row, i*R + j] * B[slot, n, j].

    Column tiles of all slices are numbered 0..N_TILES (slice i owns tiles [t_i, t_{i+1}) and columns
    [off_i, off_{i+1})). v (the sum of SPLIT partials; SPLIT = 1: v itself) is loaded once per slice of
    a tile, then the program streams that slice's column tiles of its chunk. Rows of slot -1 / rank-0
    tiles are not touched.
    """
    if PDL:
        _gdc.gdc_launch_dependents()
    start, stop = _chunk(tl.load(work) * N_TILES)
    t = start // N_TILES
    # The first tile's head is read before gdc_wait: the builder's lists, ranks and scalings are written before
    # the forward, never by a kernel of it, so at decode (one item per program) only v and out wait.
    rank, slot64, rows, row_mask, scale, c0, c1 = _expand_head(work, t, MT, start, stop, lora_ranks, scalings,
                                                               perm_ptr, N_TILES, BLOCK_M, HAS_PERM)
    if PDL:
        _gdc.gdc_wait()
    while t * N_TILES < stop:
        if rank > 0:
            _expand_tile(v_ptr, work, t, 0, b_ptr, out_ptr, rows, row_mask, slot64, rank, scale, c0, c1, R, NR, OUT,
                         num_rows, off1, off2, off3, t1, t2, t3, SPLIT, N_TILES, SLICES, BLOCK_N, BLOCK_R, DOT_PREC,
                         False, PREFETCH)
        t += 1
        rank, slot64, rows, row_mask, scale, c0, c1 = _expand_head(work, t, MT, start, stop, lora_ranks, scalings,
                                                                   perm_ptr, N_TILES, BLOCK_M, HAS_PERM)
