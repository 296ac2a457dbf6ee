"""Launch plans for the Triton SGMV kernels: a small block-size table per shape regime, no autotuning.

A plan depends only on host ints that are fixed for a CUDA graph (row and segment capacity,
max_seg_len, dims, dtype), never on the batch's data, and is cached, so a call costs one dict lookup
plus the launches. Regimes:

    decode   max_seg_len == 1 (graph-mode pure decode, or eager all-single-row): one row per program,
             GEMV on the CUDA cores, shrink split over K so that batch 1 still fills the GPU.
    mixed    short segments: 16-row tiles on the tensor cores, split-K sized by capacity.
    prefill  many rows (x.shape[0] >= PREFILL_ROWS) and long segments: 64-row tiles, no split.

The table values come from the sweep in bench/bench_kernels.py --tune on the device (see
bench/RESULTS.md); `TABLE` may be replaced for experiments, followed by `clear_cache()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ShrinkCfg:
    block_m: int
    block_n: int  # columns of the flat S*R axis per program (capped at next_pow2(S*R))
    block_k: int
    target_programs: int  # split-K is chosen so that work items x column tiles x splits reach this
    max_split: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpandCfg:
    block_m: int
    block_n: int
    block_r: int  # rank chunk (capped at next_pow2(R))
    target_programs: int  # column tiles are shared out so that work items x groups reach about this
    num_warps: int
    num_stages: int


TABLE = {
    "decode": (ShrinkCfg(1, 16, 256, 1024, 64, 4, 2), ExpandCfg(1, 128, 64, 4096, 4, 1)),
    "mixed": (ShrinkCfg(16, 32, 256, 2048, 16, 4, 3), ExpandCfg(16, 128, 64, 2048, 4, 2)),
    "prefill": (ShrinkCfg(64, 64, 64, 0, 1, 4, 4), ExpandCfg(64, 128, 64, 2048, 4, 3)),
}
PREFILL_ROWS = 2048
PREFILL_SEG_LEN = 64
# Register budget of the partial-sum loads: block_m * next_pow2(split) * columns <= this.
SPLIT_TILE_ELEMS = 8192
MAX_GRID_Y = 65535

_cache: dict = {}


def clear_cache() -> None:
    _cache.clear()


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def regime(rows: int, max_seg_len: int) -> str:
    if max_seg_len <= 1:
        return "decode"
    if rows >= PREFILL_ROWS and max_seg_len > PREFILL_SEG_LEN:
        return "prefill"
    return "mixed"


@dataclass(frozen=True)
class Items:
    """Axis 1 of every grid: W work items (row tiles of segments), see kernels._locate."""
    count: int
    flat: bool
    seg_block: int


def _items(rows: int, cap: int, max_seg_len: int, block_m: int) -> Items:
    per_seg = _cdiv(max(max_seg_len, 1), block_m)
    if per_seg == 1:
        count = cap
    else:
        count = max(1, min(cap * per_seg, _cdiv(rows, block_m) + cap, rows))
    if count > MAX_GRID_Y:
        raise ValueError(f"too many work items ({count}) for the Triton grid: rows={rows}, segment capacity={cap}, "
                         f"max_seg_len={max_seg_len}")
    return Items(count, per_seg == 1, _pow2(cap))


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class ShrinkPlan:
    grid: tuple
    split: int
    k_chunk: int
    kw: dict  # constexprs + launch options of _shrink_kernel (PARTIAL added by the caller)
    reduce_grid: tuple
    reduce_kw: dict
    runs: dict = field(default_factory=dict)  # compiled launchers (launch.py)


def shrink_plan(rows: int, in_dim: int, num_slices: int, max_rank: int, dtype: torch.dtype, cap: int,
                max_seg_len: int, has_perm: bool) -> ShrinkPlan:
    key = ("s", rows, in_dim, num_slices, max_rank, dtype, cap, max_seg_len, has_perm)
    plan = _cache.get(key)
    if plan is not None:
        return plan
    reg = regime(rows, max_seg_len)
    cfg, ecfg = TABLE[reg]
    nr = num_slices * max_rank
    bm = cfg.block_m
    bn = min(cfg.block_n, max(_pow2(nr), 16 if bm >= 16 else 1))
    bk = cfg.block_k if bm < 16 else max(16, min(cfg.block_k, _pow2(in_dim)))
    items = _items(rows, cap, max_seg_len, bm)
    n_tiles = _cdiv(nr, bn)
    k_steps = _cdiv(in_dim, bk)
    split = 1
    if cfg.target_programs:
        split = _cdiv(cfg.target_programs, items.count * n_tiles)
        # the consumers load all partials of a tile at once: keep that within the register budget
        cols = max(_pow2(min(max_rank, ecfg.block_r)), 1)
        budget = max(1, SPLIT_TILE_ELEMS // (max(bm, ecfg.block_m) * cols))
        split = max(1, min(split, cfg.max_split, k_steps, 1 << (budget.bit_length() - 1)))
    k_chunk = _cdiv(k_steps, split) * bk
    split = _cdiv(in_dim, k_chunk) if in_dim else 1
    kw = dict(HAS_PERM=has_perm, FLAT=items.flat, SEG_BLOCK=items.seg_block, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
              DOT_PREC=_dot_prec(dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    block_split = _pow2(split)
    rbn = min(_pow2(nr), max(1, SPLIT_TILE_ELEMS // (bm * block_split)))
    reduce_kw = dict(HAS_PERM=has_perm, FLAT=items.flat, SEG_BLOCK=items.seg_block, BLOCK_M=bm, BLOCK_N=rbn,
                     BLOCK_SPLIT=block_split, num_warps=4)
    plan = ShrinkPlan((n_tiles, items.count, split), split, k_chunk, kw, (_cdiv(nr, rbn), items.count), reduce_kw)
    _cache[key] = plan
    return plan


@dataclass(frozen=True)
class ExpandPlan:
    grid: tuple
    offsets: tuple  # off1, off2, off3, t1, t2, t3, n_tiles (kernel scalars)
    kw: dict
    runs: dict = field(default_factory=dict)  # compiled launchers (launch.py)


def expand_plan(rows: int, slice_offsets: tuple, max_rank: int, dtype: torch.dtype, cap: int, max_seg_len: int,
                has_perm: bool, n_split: int) -> ExpandPlan:
    key = ("e", rows, slice_offsets, max_rank, dtype, cap, max_seg_len, has_perm, n_split)
    plan = _cache.get(key)
    if plan is not None:
        return plan
    cfg = TABLE[regime(rows, max_seg_len)][1]
    bm = cfg.block_m
    br = min(cfg.block_r, max(_pow2(max_rank), 16 if bm >= 16 else 1))
    out_total = slice_offsets[-1]
    widths = [b - a for a, b in zip(slice_offsets, slice_offsets[1:])]
    bn = min(cfg.block_n, max(_pow2(max(widths)), 16))
    tiles = [_cdiv(w, bn) for w in widths]
    starts = [sum(tiles[: i + 1]) for i in range(len(tiles))]  # t1, t2, ... (cumulative)
    total = starts[-1]
    offs = list(slice_offsets[1:-1]) + [out_total] * (4 - len(widths))
    ts = starts[:-1] + [total] * (4 - len(widths))
    items = _items(rows, cap, max_seg_len, bm)
    groups = max(1, min(total, _cdiv(cfg.target_programs, items.count)))
    kw = dict(HAS_PERM=has_perm, FLAT=items.flat, SEG_BLOCK=items.seg_block, BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br,
              BLOCK_SPLIT=_pow2(n_split), DOT_PREC=_dot_prec(dtype), num_warps=cfg.num_warps,
              num_stages=cfg.num_stages)
    plan = ExpandPlan((groups, items.count), tuple(offs[:3] + ts[:3]) + (total,), kw)
    _cache[key] = plan
    return plan
