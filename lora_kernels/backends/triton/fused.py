"""One launch per module for decode-sized batches: the split-K shrink and the expand in one persistent kernel.

Phase 1 of every program computes its chunk of shrink items (tile, column tile, split) exactly as
`_shrink_kernel` does with PARTIAL (same blocks, same dot chain) into the fp32 workspace, then counts the
item on its tile's arrival counter (release). Phase 2 computes its chunk of expand items (tile, column tile)
exactly as `_expand_kernel` does with SPLIT partials, after waiting (acquire) until the tile's counter
holds all S_TILES * SPLIT items. So a row's bits equal those of the two-launch path, and the choice between
the paths (by the number of rows) keeps batch invariance.

Waiting is safe because every program finishes its phase-1 items before it waits, and
the grid is at most one program per SM, so that all programs become resident once earlier kernels have left
the SMs (a PDL dependent launches only after all of this grid's programs have started). Two fused launches
running at once on two streams could each hold SMs the other waits for: the backend keeps separate counters
per stream, but an engine should not run LoRA applies concurrently on two streams with this path on.

The counters ([arrivals MT | consumed MT], int32) return to zero inside the kernel: each program adds the
column tiles it consumed to the tile's second counter, and the one that completes it zeroes both. With
PDL, the next kernel touches them only after `gdc_wait`, i.e. after this grid has completed.
"""

import triton
import triton.language as tl
from triton.language.extra import cuda as _gdc

from lora_kernels.backends.triton.kernels import (_chunk, _expand_head, _expand_tile, _rank, _rows, _shrink_dot,
                                                  _tile)


@triton.jit
def _shrink_item(x_ptr, a_ptr, ws_ptr, rows, row_mask, slot64, rank, ks, ct, K, R, NR, num_rows, k_chunk,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    """One shrink item (as _shrink_kernel, PARTIAL): ws[ks, row, c] for the live columns of column tile ct."""
    cols = ct * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (cols < NR) & ((cols % R) < rank)
    k_begin = ks * k_chunk
    acc = _shrink_dot(x_ptr, a_ptr, rows, row_mask, slot64, cols, live, k_begin, tl.minimum(k_begin + k_chunk, K),
                      K, NR, BLOCK_K, DOT_PREC, PDL)
    tl.store(ws_ptr + (ks * num_rows + rows[:, None]) * NR + cols[None, :], acc,
             mask=row_mask[:, None] & live[None, :])


@triton.jit(do_not_specialize=["MT", "num_rows"])
def _fused_kernel(x_ptr, a_ptr, b_ptr, out_ptr, ws_ptr, sync_ptr, work, lora_ranks, scalings, perm_ptr,
                  MT, K, R, NR, OUT, num_rows, k_chunk, off1, off2, off3, t1, t2, t3,
                  HAS_PERM: tl.constexpr, SPLIT: tl.constexpr, S_TILES: tl.constexpr, E_TILES: tl.constexpr,
                  SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NS: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_NE: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr,
                  PREFETCH: tl.constexpr):
    if PDL:
        _gdc.gdc_launch_dependents()
    tiles = tl.load(work)
    start, stop = _chunk(tiles * (S_TILES * SPLIT))
    for w in range(start, stop):  # phase 1: shrink items, numbered as in _shrink_kernel
        t = w // (S_TILES * SPLIT)
        slot, row0, end = _tile(work, t, MT)
        rank, slot64 = _rank(slot, lora_ranks)
        if rank > 0:
            rows, row_mask = _rows(perm_ptr, row0, end, BLOCK_M, HAS_PERM)
            _shrink_item(x_ptr, a_ptr, ws_ptr, rows, row_mask, slot64, rank, w % SPLIT, (w // SPLIT) % S_TILES,
                         K, R, NR, num_rows, k_chunk, BLOCK_NS, BLOCK_K, DOT_PREC, PDL)
            tl.atomic_add(sync_ptr + t, 1, sem="release")
    if PDL:
        _gdc.gdc_wait()  # base_out is the previous kernel's output (a no-op when phase 1 has waited)
    start, stop = _chunk(tiles * E_TILES)
    t = start // E_TILES
    while t * E_TILES < stop:  # phase 2: expand items
        rank, slot64, rows, row_mask, scale, c0, c1 = _expand_head(work, t, MT, start, stop, lora_ranks, scalings,
                                                                   perm_ptr, E_TILES, BLOCK_M, HAS_PERM)
        if rank > 0:
            _expand_tile(ws_ptr, sync_ptr, t, S_TILES * SPLIT, b_ptr, out_ptr, rows, row_mask, slot64, rank, scale,
                         c0, c1, R, NR, OUT, num_rows, off1, off2, off3, t1, t2, t3, SPLIT, E_TILES, SLICES, BLOCK_NE,
                         BLOCK_R, DOT_PREC, True, PREFETCH)
            if tl.atomic_add(sync_ptr + MT + t, c1 - c0, sem="acq_rel") + (c1 - c0) == E_TILES:
                tl.atomic_xchg(sync_ptr + t, 0)  # the tile's last consumer: ready for the next launch
                tl.atomic_xchg(sync_ptr + MT + t, 0)
        t += 1
