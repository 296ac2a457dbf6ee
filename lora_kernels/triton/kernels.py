"""Triton SGMV kernels (DESIGN.md §5): segmented shrink (with split-K), its reduction, and multi-slice expand.

Grids are fixed by capacity only, never by the batch's data: axis 1 enumerates "work items", each one
row tile of one segment (see `_locate`), and every program reads its segment's bounds, slot and rank
on the device and returns early when it has nothing to do. A CUDA graph captured once therefore
replays correctly for any batch of the same capacity.

Shrink with split-K writes fp32 partial sums ws[split, T, S*R] (physical rows) that the consumer
(the expand kernel, or `_shrink_reduce_kernel`) adds in a fixed order: deterministic, no atomics, so
graph replay equals eager bit for bit.
"""

import triton
import triton.language as tl


@triton.jit
def _locate(w, seg_indptr, cap, BLOCK_M: tl.constexpr, FLAT: tl.constexpr, SEG_BLOCK: tl.constexpr):
    """Work item w -> (segment, first segmented row of its tile, segment end).

    FLAT: every segment fits one tile (max_seg_len <= BLOCK_M), item w is segment w.
    Otherwise items enumerate the tiles of all segments in order: a prefix sum over the per-segment
    tile counts (computed here from seg_indptr, cap <= SEG_BLOCK) maps w to its segment. Items past the
    last tile get segment >= cap.
    """
    if FLAT:
        seg = w
        start = tl.load(seg_indptr + seg)
        end = tl.load(seg_indptr + seg + 1)
        row0 = start
    else:
        offs = tl.arange(0, SEG_BLOCK)
        valid = offs < cap
        lo = tl.load(seg_indptr + offs, mask=valid, other=0)
        hi = tl.load(seg_indptr + offs + 1, mask=valid, other=0)
        cnt = (hi - lo + BLOCK_M - 1) // BLOCK_M
        cum = tl.cumsum(cnt, 0)
        seg = tl.sum((cum <= w).to(tl.int32), 0)
        sel = offs == seg
        tile = w - tl.sum(tl.where(sel, cum - cnt, 0), 0)
        end = tl.sum(tl.where(sel, hi, 0), 0)
        row0 = tl.sum(tl.where(sel, lo, 0), 0) + tile * BLOCK_M
    return seg, row0, end


@triton.jit
def _rows(perm_ptr, row0, end, BLOCK_M: tl.constexpr, HAS_PERM: tl.constexpr):
    """Physical rows of the tile starting at segmented row row0, and their mask."""
    m = row0 + tl.arange(0, BLOCK_M)
    mask = m < end
    if HAS_PERM:
        m = tl.load(perm_ptr + m, mask=mask, other=0)
    return m.to(tl.int64), mask


@triton.jit
def _slot_rank(seg, cap, weight_indices, lora_ranks):
    """Slot of segment seg (clamped to 0 when unused) and its rank (0 for slot -1 / past capacity)."""
    inside = seg < cap
    slot = tl.load(weight_indices + seg, mask=inside, other=-1)
    active = slot >= 0
    rank = tl.load(lora_ranks + slot, mask=active, other=0)
    return tl.where(active, slot, 0).to(tl.int64), rank


@triton.jit(do_not_specialize=["cap"])
def _shrink_kernel(x_ptr, a_ptr, out_ptr, seg_indptr, weight_indices, lora_ranks, perm_ptr,
                   cap, K, R, NR, num_rows, k_chunk,
                   HAS_PERM: tl.constexpr, PARTIAL: tl.constexpr, FLAT: tl.constexpr, SEG_BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """out[(k,) row, c] = sum over this K chunk of x[row, k] * A[slot, c, k] for the columns c of this tile.

    Columns are the flat S*R axis (c = i*R + j); only j < rank are read. PARTIAL: out is the split-K
    workspace [split, T, NR] and only live columns of LoRA rows are written. Otherwise out is v itself
    (split 1) and the tile's whole row span is written (0 for j >= rank, slot -1 and rank 0).
    """
    pid_n = tl.program_id(0)
    seg, row0, end = _locate(tl.program_id(1), seg_indptr, cap, BLOCK_M, FLAT, SEG_BLOCK)
    if seg >= cap:
        return
    if row0 >= end:
        return
    slot, rank = _slot_rank(seg, cap, weight_indices, lora_ranks)
    rows, row_mask = _rows(perm_ptr, row0, end, BLOCK_M, HAS_PERM)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NR
    live = col_mask & ((cols % R) < rank)
    pid_k = tl.program_id(2)
    out_ptrs = out_ptr + (pid_k * num_rows + rows[:, None]) * NR + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if tl.sum(live.to(tl.int32), 0) == 0:  # slot -1, rank 0, or a tile past the rank
        if not PARTIAL:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), tl.float32).to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    k_begin = pid_k * k_chunk
    k_end = tl.minimum(k_begin + k_chunk, K)
    x_rows = x_ptr + rows[:, None] * K
    a_rows = a_ptr + (slot * NR + cols[:, None]) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        k_mask = kk < k_end
        xt = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_rows + kk[None, :], mask=live[:, None] & k_mask[None, :], other=0.0)
        if BLOCK_M >= 16:
            acc = tl.dot(xt, tl.trans(at), acc, input_precision=DOT_PREC)
        else:  # decode: one row, a GEMV on the CUDA cores over a 2-D [BLOCK_N, BLOCK_K] tile
            acc += tl.sum(at.to(tl.float32) * xt.to(tl.float32), axis=1)[None, :]
    if PARTIAL:
        tl.store(out_ptrs, acc, mask=row_mask[:, None] & live[None, :])
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _sum_splits(ws_ptr, rows, row_mask, cols, col_mask, n_split, split_stride, row_stride,
                BLOCK_SPLIT: tl.constexpr):
    """sum_s ws[s, rows, cols] as fp32 [BLOCK_M, BLOCK_C]; the partials are loaded in one go (one
    memory latency, not n_split of them) and added in split order (deterministic)."""
    base = ws_ptr + rows[:, None] * row_stride + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    if BLOCK_SPLIT == 1:
        return tl.load(base, mask=mask, other=0.0).to(tl.float32)
    s = tl.arange(0, BLOCK_SPLIT)
    ptrs = base[:, None, :] + s[None, :, None].to(tl.int64) * split_stride
    vals = tl.load(ptrs, mask=mask[:, None, :] & (s < n_split)[None, :, None], other=0.0)
    return tl.sum(vals.to(tl.float32), axis=1)


@triton.jit(do_not_specialize=["cap", "n_split"])
def _shrink_reduce_kernel(ws_ptr, out_ptr, seg_indptr, weight_indices, lora_ranks, perm_ptr,
                          cap, R, NR, num_rows, n_split,
                          HAS_PERM: tl.constexpr, FLAT: tl.constexpr, SEG_BLOCK: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SPLIT: tl.constexpr):
    """v[row, c] = sum_s ws[s, row, c] for live columns, 0 for the rest of every covered row."""
    pid_n = tl.program_id(0)
    seg, row0, end = _locate(tl.program_id(1), seg_indptr, cap, BLOCK_M, FLAT, SEG_BLOCK)
    if seg >= cap:
        return
    if row0 >= end:
        return
    slot, rank = _slot_rank(seg, cap, weight_indices, lora_ranks)
    rows, row_mask = _rows(perm_ptr, row0, end, BLOCK_M, HAS_PERM)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < NR
    live = col_mask & ((cols % R) < rank)
    acc = _sum_splits(ws_ptr, rows, row_mask, cols, live, n_split, num_rows * NR, NR, BLOCK_SPLIT)
    tl.store(out_ptr + rows[:, None] * NR + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["cap", "n_split", "t1", "t2", "t3", "n_tiles"])
def _expand_kernel(v_ptr, b_ptr, out_ptr, seg_indptr, weight_indices, lora_ranks, scalings, perm_ptr,
                   cap, R, NR, OUT, num_rows, n_split, off1, off2, off3, t1, t2, t3, n_tiles,
                   HAS_PERM: tl.constexpr, FLAT: tl.constexpr, SEG_BLOCK: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr):
    """out[row, n] += scaling * sum_{j<rank} v[row, i*R + j] * B[slot, n, j] for the n of its tiles.

    The column tiles of all slices are numbered 0..n_tiles (slice i owns tiles [t_i, t_{i+1}) and
    columns [off_i, off_{i+1})); program (g, w) handles tiles g, g + G, g + 2G, ... of work item w
    (G = grid axis 0), so that the segment lookup is paid once per program and programs of empty
    items stay few. v is the sum of n_split partials (n_split = 1: v itself). Rows of slot -1 /
    rank-0 segments are not touched.
    """
    seg, row0, end = _locate(tl.program_id(1), seg_indptr, cap, BLOCK_M, FLAT, SEG_BLOCK)
    if seg >= cap:
        return
    if row0 >= end:
        return
    slot, rank = _slot_rank(seg, cap, weight_indices, lora_ranks)
    if rank == 0:
        return
    scale = tl.load(scalings + slot)
    rows, row_mask = _rows(perm_ptr, row0, end, BLOCK_M, HAS_PERM)
    b_slot = b_ptr + slot * OUT * R
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        i = (t >= t1).to(tl.int32) + (t >= t2).to(tl.int32) + (t >= t3).to(tl.int32)
        lo = tl.where(i == 0, 0, tl.where(i == 1, off1, tl.where(i == 2, off2, off3)))
        hi = tl.where(i == 0, off1, tl.where(i == 1, off2, tl.where(i == 2, off3, OUT)))
        t0 = tl.where(i == 0, 0, tl.where(i == 1, t1, tl.where(i == 2, t2, t3)))
        n = lo + (t - t0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        out_ptrs = out_ptr + rows[:, None] * OUT + n[None, :]
        mask = row_mask[:, None] & n_mask[None, :]
        base = tl.load(out_ptrs, mask=mask, other=0.0)  # issued first: its latency overlaps v's and B's
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            j = r0 + tl.arange(0, BLOCK_R)
            j_mask = j < rank
            vt = _sum_splits(v_ptr, rows, row_mask, i * R + j, j_mask, n_split, num_rows * NR, NR, BLOCK_SPLIT)
            bt = tl.load(b_slot + n[:, None] * R + j[None, :], mask=n_mask[:, None] & j_mask[None, :], other=0.0)
            if BLOCK_M >= 16:
                acc = tl.dot(vt.to(bt.dtype), tl.trans(bt), acc, input_precision=DOT_PREC)
            else:  # decode: one row, a GEMV on the CUDA cores, v kept in fp32
                acc += tl.sum(bt.to(tl.float32) * vt, axis=1)[None, :]
        tl.store(out_ptrs, (base.to(tl.float32) + scale * acc).to(out_ptr.dtype.element_ty), mask=mask)
