"""The HF prefill MLP's one-pass kernels at bench_hf's prefill shapes: tile candidates of silu_mul_lora against the
pass without LoRA (silu_mul_kernel) and a memcpy of the same bytes (issue 14's prefill target).

One gate_up output of 32 requests x 128 tokens (bf16), 32 adapters, one per request, rank 16, at the Llama-3.2-1B
and Llama-3-8B widths. Each candidate (GROUP work-list tiles per program, BLOCK_N, warps) is first checked bit for
bit against the current table's output, then timed by CUDA-graph replay over two buffer sets (each larger than the
L2), interleaved over --rounds rounds: median and range of the rounds' medians, µs.

    python bench/profile/hf_mlp_tiles.py [--rounds 5] [--json out.jsonl]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import lora_kernels as lk  # noqa: E402
from lora_kernels.integrations import _hf_mlp  # noqa: E402

WIDTHS = {"1b": 8192, "8b": 14336}  # intermediate size I (gate_up is 2I wide)
CANDIDATES = [(1, 128, 4), (2, 64, 4), (2, 128, 4), (2, 128, 8), (4, 64, 4), (4, 64, 8), (4, 128, 8)]
REQUESTS, TOKENS, RANK, SLOTS = 32, 128, 16, 32


def _sets(inter: int, n: int):
    rows = REQUESTS * TOKENS
    return [(torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16),
             torch.randn(rows, 2 * RANK, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]


def _problem(inter: int):
    ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device="cuda")
    builder = lk.BatchInfoBuilder(REQUESTS * TOKENS, REQUESTS, ranks, torch.full((SLOTS,), 0.5, device="cuda"))
    info = builder.build([TOKENS] * REQUESTS, list(range(REQUESTS)))
    lora_b = torch.randn(SLOTS, 2 * inter, RANK, device="cuda", dtype=torch.bfloat16).mul_(RANK ** -0.5)
    return info, lora_b


def _with_tiles(tiles, fn):
    saved = _hf_mlp.LORA_TILES
    _hf_mlp.LORA_TILES = tiles
    try:
        return fn()
    finally:
        _hf_mlp.LORA_TILES = saved


def run(shape: str, rounds: int) -> list[dict]:
    inter = WIDTHS[shape]
    info, lora_b = _problem(inter)
    sets = _sets(inter, 2)
    ref = _hf_mlp.silu_mul_lora_kernel(sets[0][0], sets[0][1], lora_b, info)
    fns = {"silu_mul (no LoRA)": [lambda gu=gu: _hf_mlp.silu_mul_kernel(gu) for gu, _ in sets]}
    for tiles in CANDIDATES:
        got = _with_tiles(tiles, lambda: _hf_mlp.silu_mul_lora_kernel(sets[0][0], sets[0][1], lora_b, info))
        if not torch.equal(got, ref):
            print(f"# {shape} {tiles}: bits differ from the current tiles {_hf_mlp.LORA_TILES}, left out")
            continue
        fns[f"silu_mul_lora {tiles}"] = [
            (lambda gu=gu, v=v, t=tiles: _with_tiles(t, lambda: _hf_mlp.silu_mul_lora_kernel(gu, v, lora_b, info)))
            for gu, v in sets]
    nbytes = REQUESTS * TOKENS * 3 * inter * 2  # read gate|up, write their product
    srcs = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in sets]
    dsts = [torch.empty_like(s) for s in srcs]
    fns["memcpy of the same bytes"] = [lambda s=s, d=d: d.copy_(s) for s, d in zip(srcs, dsts)]
    timers = {k: common.GraphTimer(v, inner=len(v) * 4) for k, v in fns.items()}
    per = {k: [] for k in timers}
    for _ in range(rounds):
        for k, t in timers.items():
            per[k].append(t.time_us(reps=20))
    bw = common.copy_bandwidth_gbs()
    floor = nbytes / (bw * 1e3)
    print(f"\n## {shape}: I = {inter}, {REQUESTS}x{TOKENS} rows, r{RANK}, {SLOTS} adapters; floor {floor:.1f} µs "
          f"({nbytes / 1e6:.0f} MB at {bw:.0f} GB/s copy bandwidth)")
    rows = []
    for k, ts in per.items():
        med = statistics.median(ts)
        rows.append({"shape": shape, "variant": k, "us": round(med, 1), "min": round(min(ts), 1),
                     "max": round(max(ts), 1), "x_floor": round(med / floor, 2)})
    common.print_table(rows, ["shape", "variant", "us", "min", "max", "x_floor"])
    return rows


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    rows = []
    for shape in WIDTHS:
        rows += run(shape, 2 if args.quick else args.rounds)
    common.write_jsonl(args.json, [{"bench": "hf_mlp_tiles", **r} for r in rows])


if __name__ == "__main__":
    main()
