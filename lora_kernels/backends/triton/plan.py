"""Launch plans of the Triton SGMV kernels, from shapes only (the batch-invariance rule), cached.

Block sizes and split-K follow from (in_dim, S*R, out widths, dtype) and the generated block table
(`lora_kernels/backends/tables.py`, written by `bench/bench_kernels.py --tune`), never from the batch.
Host ints that vary with the batch or the graph capacity size only the persistent grid (a fixed
multiple of the SM count, capped by the work list's capacity), never a reduction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from lora_kernels.backends import tables
from lora_kernels.batch_info import TILE_M

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
TABLE = dict(tables.TRITON_BLOCKS)  # may be replaced for experiments, followed by clear_cache()
# The one-launch decode path (fused.py) until a --tune run measures it into the table: off (max_rows 0).
FUSED_DEFAULT = {"max_rows": 0, "ctas_per_sm": 1}
# The tall-tile path for long segments (tall.py) until a --tune run measures it into the table: off (min_rows 0).
# Groups of work-list tiles per dot (shrink_group * 16 rows, expand_group * 16; pools of rank >= wide_rank use the
# _wide expand entries), column tiles, warps; the shrink's pipeline stages drop until its shared memory fits
# shrink_smem; one program per item (group, column tile); expand_maxnreg (0: Triton's choice) caps the expand's
# registers per thread (its runs are unrolled GROUP times: 101 registers at r64 against 80 for one run, which costs
# a third of the resident programs). Measured on the H200 (exp A/B, Llama-3-8B modules, 8 x 1024 rows): 64-row
# shrink tiles with 4 stages, 32-row expand tiles at r16 and 64-row ones at r64 (tables.py: the tune's warps).
# min_rank: the path only for pools of this rank or more.
TALL_DEFAULT = {"min_rows": 0, "min_rank": 0, "shrink_group": 4, "shrink_n": 64, "shrink_warps": 4, "shrink_stages": 4,
                "shrink_smem": 98304, "expand_group": 2, "expand_n": 128, "expand_warps": 4, "wide_rank": 32,
                "expand_group_wide": 4, "expand_warps_wide": 8, "expand_maxnreg": 0, "expand_maxnreg_wide": 0,
                "max_rank": 64, "dense_tiles": 16, "min_items": 64}
# dense_tiles: the path also needs a dense work list, at most one tile in dense_tiles beyond those the rows fill (0:
# no such bound), and min_items shrink items (shrink_group tiles x shrink_n columns of v over the filled tiles). A tall
# item spans several tiles and runs its tiles' adapters one after another, so a chunked-prefill step, whose decode
# rows are one tile each, serializes adapters in a few programs, and a short chunk leaves SMs idle; the split path
# computes the same bits. H100, layer µs (bench_kernels), tall -> split: a 1024 / 2048 / 4096-row chunk + 63 decode
# rows (uniform over 32 slots, sorted): r16 466 / 556 / 694 -> 168 / 281 / 483, r64 716 / 791 / 973 -> 308 / 481 /
# 780; dense 1024-row segments (a later call): 1x1024 r16 181 -> 133, r64 246 -> 205; 2x1024 r16 260 -> 231 (32
# items), r64 327 -> 362 (32-96 items); 4x1024 r16 396 -> 436 (64 items), r64 500 -> 687; 8x1024 r16 708 -> 855.
# With min_items at r64 2x1024 (qkv and gate_up tall, o and down split): 296 against 326 all tall (a third call).
# max_rank: pools of a higher rank take the split path. The tall expand holds a whole BLOCK_R-wide v and B block per
# run: at rank 256 in fp32 it spilled 44 KB of stack per thread and took Triton + ptxas ~190 s to compile (sm90),
# which stalled the GPU test grid; at rank 64 it compiles in seconds.
_cache: dict = {}
_sms: dict = {}


def clear_cache() -> None:
    _cache.clear()
    _paths[0] = None


_CACHE_MAX = 4096  # plans and launch recipes: an engine has a few shapes, eager prefill many row counts


def cached(key, make):
    """_cache[key], made by make() on a miss; the cache is emptied (and refilled on demand) when full."""
    value = _cache.get(key)
    if value is None:
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
        value = _cache[key] = make()
    return value


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """SM count of `device` (4 under the interpreter, so that persistent loops run several items)."""
    if INTERPRET or device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sms:
        _sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sms[idx]


def _dev_key(device: torch.device) -> tuple:
    """cuda and cuda:<current> name one device: one plan (and one cache of compiled launchers) for both."""
    if device.type == "cuda" and device.index is None and not INTERPRET:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: sm90+, not under the interpreter, LORA_KERNELS_PDL != 0."""
    if INTERPRET or device.type != "cuda" or os.environ.get("LORA_KERNELS_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _dot_prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class ShrinkPlan:
    split: int
    k_chunk: int
    n_tiles: int  # column tiles of the S*R axis
    kw: dict  # constexprs + launch options (PARTIAL added by the caller)
    reduce_kw: dict
    reduce_tiles: int
    ctas: int  # persistent programs per SM
    runs: dict = field(default_factory=dict)  # compiled launchers (launch.py)


def shrink_plan(in_dim: int, num_slices: int, max_rank: int, dtype: torch.dtype, has_perm: bool,
                device: torch.device) -> ShrinkPlan:
    return cached(("s", in_dim, num_slices, max_rank, dtype, has_perm, _dev_key(device)),
                  lambda: _make_shrink_plan(in_dim, num_slices, max_rank, dtype, has_perm, device))


def _make_shrink_plan(in_dim, num_slices, max_rank, dtype, has_perm, device) -> ShrinkPlan:
    c = TABLE["shrink"]
    nr = num_slices * max_rank
    bn = max(16, min(_pow2(nr), c["block_n"]))
    bk = max(16, min(c["block_k"] if bn <= 128 else c["block_k_wide"], _pow2(in_dim)))
    split = max(1, min(c["max_split"], _cdiv(in_dim, c["k_chunk_min"])))
    k_chunk = _cdiv(_cdiv(in_dim, split), bk) * bk
    split = _cdiv(in_dim, k_chunk)
    pdl = use_pdl(device)
    kw = dict(HAS_PERM=has_perm, SPLIT=split, N_TILES=_cdiv(nr, bn), BLOCK_M=TILE_M, BLOCK_N=bn, BLOCK_K=bk,
              DOT_PREC=_dot_prec(dtype), PDL=pdl, num_warps=c["num_warps"], num_stages=c["num_stages"])
    r = TABLE["reduce"]
    rbn = max(16, min(_pow2(nr), r["block_n"]))
    reduce_kw = dict(HAS_PERM=has_perm, SPLIT=split, N_TILES=_cdiv(nr, rbn), BLOCK_M=TILE_M, BLOCK_N=rbn, PDL=pdl,
                     num_warps=r["num_warps"])
    if pdl:
        kw["launch_pdl"] = reduce_kw["launch_pdl"] = True
    return ShrinkPlan(split, k_chunk, _cdiv(nr, bn), kw, reduce_kw, _cdiv(nr, rbn), c["ctas_per_sm"])


@dataclass(frozen=True)
class ExpandPlan:
    n_tiles: int
    scalars: tuple  # off1, off2, off3, t1, t2, t3 (kernel scalars)
    kw: dict
    ctas: int
    runs: dict = field(default_factory=dict)


def expand_plan(slice_offsets: tuple, max_rank: int, dtype: torch.dtype, has_perm: bool, n_split: int,
                device: torch.device) -> ExpandPlan:
    return cached(("e", slice_offsets, max_rank, dtype, has_perm, n_split, _dev_key(device)),
                  lambda: _make_expand_plan(slice_offsets, max_rank, dtype, has_perm, n_split, device))


def _make_expand_plan(slice_offsets, max_rank, dtype, has_perm, n_split, device) -> ExpandPlan:
    c = TABLE["expand"]
    widths = [b - a for a, b in zip(slice_offsets, slice_offsets[1:])]
    br = max(16, _pow2(max_rank))  # the whole rank in one dot: v is loaded once per slice of a tile
    bn = max(16, min(c["block_n"], _pow2(max(widths)), c["tile_elems"] // br))
    total, scalars = slice_tiles(slice_offsets, bn)
    # prefetch: the next column tile's loads in flight by hand (kernels._expand_tile); absent from older tables.
    kw = dict(HAS_PERM=has_perm, SPLIT=n_split, N_TILES=total, SLICES=len(widths), BLOCK_M=TILE_M, BLOCK_N=bn,
              BLOCK_R=br, DOT_PREC=_dot_prec(dtype), PDL=use_pdl(device), PREFETCH=bool(c.get("prefetch", False)),
              num_warps=c["num_warps"], num_stages=c["num_stages"])
    if kw["PDL"]:
        kw["launch_pdl"] = True
    return ExpandPlan(total, scalars, kw, c["ctas_per_sm"])


def slice_tiles(slice_offsets: tuple, bn: int) -> tuple:
    """(column tiles of all slices, (off1, off2, off3, t1, t2, t3)) for tiles of bn columns that never straddle a
    slice: slice i owns tiles [t_i, t_{i+1}) and columns [off_i, off_{i+1}) (absent slices padded with the ends)."""
    widths = [b - a for a, b in zip(slice_offsets, slice_offsets[1:])]
    tiles = [_cdiv(w, bn) for w in widths]
    starts = [sum(tiles[: i + 1]) for i in range(len(tiles))]  # t1, t2, ... (cumulative)
    total = starts[-1]
    offs = list(slice_offsets[1:-1]) + [slice_offsets[-1]] * (4 - len(widths))
    ts = starts[:-1] + [total] * (4 - len(widths))
    return total, tuple(offs[:3] + ts[:3])


@dataclass(frozen=True)
class FusedPlan:
    kw: dict  # the shrink's and the expand's blocks, so that both phases compute what the two launches do
    items: int  # items per tile, the larger phase: S_TILES * SPLIT or E_TILES
    runs: dict = field(default_factory=dict)


def fused_plan(sp: ShrinkPlan, ep: ExpandPlan) -> FusedPlan:
    s, e = sp.kw, ep.kw
    kw = dict(HAS_PERM=s["HAS_PERM"], SPLIT=sp.split, S_TILES=sp.n_tiles, E_TILES=ep.n_tiles, SLICES=e["SLICES"],
              BLOCK_M=TILE_M, BLOCK_NS=s["BLOCK_N"], BLOCK_K=s["BLOCK_K"], BLOCK_NE=e["BLOCK_N"], BLOCK_R=e["BLOCK_R"],
              DOT_PREC=s["DOT_PREC"], PDL=s["PDL"], PREFETCH=e["PREFETCH"], num_warps=e["num_warps"],
              num_stages=s["num_stages"])
    if kw["PDL"]:
        kw["launch_pdl"] = True
    # Keyed by its constexprs (one compiled-launcher cache per kernel variant), not by the plans' identities.
    return cached(("f", *sorted(kw.items())), lambda: FusedPlan(kw, max(sp.n_tiles * sp.split, ep.n_tiles)))


@dataclass(frozen=True)
class TallPlan:
    shrink_kw: dict  # the split-K shrink's BLOCK_K, k_chunk and split (the same chains), the tall table's tiles
    expand_kw: dict
    runs: dict = field(default_factory=dict)


def tall_plan(sp: ShrinkPlan, slice_offsets: tuple, max_rank: int, dtype: torch.dtype) -> tuple:
    """(TallPlan, the expand's slice scalars) of the tall-tile kernels: every reduction as in sp and the expand
    plans (bits), the tiles from the tall table."""
    c = tall_config()
    s = sp.kw
    nr = (len(slice_offsets) - 1) * max_rank
    bn = max(16, min(_pow2(nr), c["shrink_n"]))
    stages, rows = c["shrink_stages"], c["shrink_group"] * TILE_M
    while stages > 2 and (rows + bn) * s["BLOCK_K"] * dtype.itemsize * stages > c["shrink_smem"]:
        stages -= 1
    common = dict(HAS_PERM=s["HAS_PERM"], BLOCK_M=TILE_M, DOT_PREC=s["DOT_PREC"], PDL=s["PDL"])
    skw = dict(common, SPLIT=sp.split, GROUP=c["shrink_group"], N_COLS=_cdiv(nr, bn), BLOCK_N=bn,
               BLOCK_K=s["BLOCK_K"], num_warps=c["shrink_warps"], num_stages=stages)
    wide = "_wide" if max_rank >= c["wide_rank"] else ""
    widths = [b - a for a, b in zip(slice_offsets, slice_offsets[1:])]
    ebn = max(16, min(c["expand_n"], _pow2(max(widths))))
    n_cols, scalars = slice_tiles(slice_offsets, ebn)
    ekw = dict(common, GROUP=c["expand_group" + wide], N_COLS=n_cols, BLOCK_N=ebn, BLOCK_R=max(16, _pow2(max_rank)),
               num_warps=c["expand_warps" + wide], num_stages=1)
    cap = c["expand_maxnreg" + wide]
    # The cap is tuned for the table's tile: a taller group's fp32 accumulator alone can need more registers per
    # thread than it allows, and ptxas then fails (H200 suite of 74fcf68: groups of 8 tiles under a cap of 64). Only
    # a cap of at least twice the accumulator's registers is applied.
    acc_regs = ekw["GROUP"] * TILE_M * ebn // (32 * ekw["num_warps"])
    if cap and cap >= 2 * acc_regs and not INTERPRET:
        ekw["maxnreg"] = cap
    if s["PDL"]:
        skw["launch_pdl"] = ekw["launch_pdl"] = True
    tp = cached(("t", *sorted(skw.items()), *sorted(ekw.items())), lambda: TallPlan(skw, ekw))
    return tp, scalars


def tall_config() -> dict:
    """The tall entry: the table's values for the keys this code knows, defaults for the rest."""
    table = TABLE.get("tall", {})
    return {k: table.get(k, v) for k, v in TALL_DEFAULT.items()}


_paths: list = [None, {}]  # [the TABLE object the memo was made for, {(rows, rank, width, max_tiles): path}]


def apply_path(rows: int, rank: int, width: int, max_tiles: int) -> tuple:
    """apply_lora's launches for x of `rows` rows, a pool of rank `rank`, v of `width` (S*R) columns and a work list
    of `max_tiles` tiles (its capacity): ("fused", ...) (one launch),
    ("tall", ...) (tall tiles) or ("split",) (the split-K shrink then the expand), with the table entry that
    shapes them (so that a cached launch recipe follows a table change). Every path computes the same bits;
    the table picks the fastest. Memoized per table object (TABLE is replaced, never edited, to change it)."""
    if _paths[0] is not TABLE:
        _paths[0], _paths[1] = TABLE, {}
    key = (rows, rank, width, max_tiles)
    path = _paths[1].get(key)
    if path is None:
        if len(_paths[1]) >= _CACHE_MAX:
            _paths[1].clear()
        path = _paths[1][key] = _choose_path(*key)
    return path


def _choose_path(rows: int, rank: int, width: int, max_tiles: int) -> tuple:
    if rows <= fused_rows():
        return ("fused", *sorted({**FUSED_DEFAULT, **TABLE.get("fused", {})}.items()))
    tall = tall_config()
    filled = _cdiv(rows, TILE_M)
    dense = tall["dense_tiles"] == 0 or (max_tiles - filled) * tall["dense_tiles"] <= filled
    items = _cdiv(filled, tall["shrink_group"]) * _cdiv(width, tall["shrink_n"])
    if (rows >= tall["min_rows"] > 0 and tall["min_rank"] <= rank <= tall["max_rank"] and dense
            and items >= tall["min_items"]):
        return ("tall", *sorted(tall.items()))
    return ("split",)


def fused_rows() -> int:
    """apply_lora takes the one-launch path up to this many rows of x (0: never). Never when the shrink and
    the expand use different warp counts: one launch has one, and the fused path must compute the bits of
    the two launches (the GPU tests check them with the table's warps)."""
    if TABLE["shrink"]["num_warps"] != TABLE["expand"]["num_warps"]:
        return 0
    return TABLE.get("fused", FUSED_DEFAULT)["max_rows"]


def fused_grid(max_tiles: int, items: int, device: torch.device) -> tuple:
    """At most one program per SM (phase 2 waits for phase 1 of other programs: all must become resident);
    one program under the interpreter, which runs programs one after another."""
    per_sm = TABLE.get("fused", FUSED_DEFAULT)["ctas_per_sm"]
    return (1,) if INTERPRET else (max(1, min(max_tiles * items, num_sms(device) * min(per_sm, 1))),)


def grid(items_upper: int, ctas_per_sm: int, device: torch.device) -> tuple:
    """Persistent grid: enough programs to fill the GPU, never more than the work list can need."""
    return (max(1, min(items_upper, num_sms(device) * ctas_per_sm)),)


def reduce_first(rows: int) -> bool:
    """apply_lora reduces the split-K partials once (a third launch) instead of in every expand column tile
    from this many rows of x on: the same sums either way, so the choice changes no bit."""
    return rows >= TABLE["reduce"]["min_rows"]
