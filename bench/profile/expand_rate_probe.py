"""The prefill expand's streaming rate and fixed cost a launch, per pool rank: out += expand(v) alone for 8192 rows
in 8 segments of 1024 (distinct slots), bf16 v, over modules of 4096 to 28672 output columns, CUDA-graph replay with
two rotating out / v sets (each out larger than L2), beside a D2D copy of out's bytes and an in-place elementwise
pass over out (one launch each, timed the same way). Prints µs per expand, out's read + write GB/s, and a
least-squares fit µs = fixed + bytes / rate per rank. Why: the shrink stride probe (shrink_stride_probe.py) found
the prefill shrink at the copy's rate plus ~4.4 µs a launch; ncu figures put the r64 wgmma expand near 3.0 TB/s and
the r16 flat expand near 3.9 TB/s.

    python bench/profile/expand_rate_probe.py [--ranks 16,64] [--env LK_X=1]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import lora_kernels as lk  # noqa: E402
from lora_kernels.batch_info import LoRABatchInfo  # noqa: E402

WIDTHS = {"o": (4096,), "qkv": (4096, 1024, 1024), "gate_up": (14336, 14336), "wide": (28672,)}


def probe(rank: int, widths: tuple, rows: int = 8192, seg: int = 1024) -> dict:
    g = torch.Generator(device="cuda").manual_seed(rank + len(widths))
    slots, total, S = rows // seg, sum(widths), len(widths)
    offs = [0]
    for w in widths:
        offs.append(offs[-1] + w)
    b = (torch.randn(slots, total, rank, device="cuda", generator=g) * rank ** -0.5).to(torch.bfloat16)
    vs = [torch.randn(rows, S * rank, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    outs = [torch.randn(rows, total, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    ranks = torch.full((slots,), rank, dtype=torch.int32, device="cuda")
    info = LoRABatchInfo.from_segments([seg] * slots, list(range(slots)), ranks, torch.ones(slots, device="cuda"))
    fns = [lambda i=i: lk.sgmv_expand(vs[i], b, info, offs, outs[i], backend="cuda") for i in range(2)]
    us = common.time_graph_us(fns, inner=20, reps=30)
    src, dst = outs[0].clone(), outs[1]
    copy_us = common.time_graph_us(lambda: dst.copy_(src), inner=20, reps=30)
    # out read and written in place by torch's elementwise kernel: the in-place stream the expand makes, no LoRA
    inplace_us = common.time_graph_us([lambda i=i: outs[i].mul_(1.0) for i in range(2)], inner=20, reps=30)
    nbytes = 2 * rows * total * 2  # out read and written
    return {"rank": rank, "out_cols": total, "rmw_mb": round(nbytes / 1e6, 1), "us": round(us, 2),
            "rmw_gbs": round(nbytes / us / 1e3, 0), "copy_us": round(copy_us, 2), "inplace_us": round(inplace_us, 2)}


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares us = fixed + MB / rate (TB/s) over rows of one rank."""
    xs = [r["rmw_mb"] for r in rows]
    ys = [r["us"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)
    return my - slope * mx, (1 / slope if slope > 0 else float("inf"))  # MB per µs = TB/s


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--env", default="", help="K=V[,K2=V2] set while capturing (launch-time switches)")
    args = p.parse_args()
    common.set_env(args.env)
    copy = common.copy_bandwidth_gbs()
    rows = [{**probe(int(r), w), "module": m, "env": args.env} for r in args.ranks.split(",")
            for m, w in WIDTHS.items()]
    common.print_table(rows, ["rank", "module", "out_cols", "us", "rmw_gbs", "copy_us", "inplace_us", "env"])
    print(f"# copy bandwidth {copy:.0f} GB/s (read + write)")
    for r in args.ranks.split(","):
        fixed, rate = fit([x for x in rows if x["rank"] == int(r)])
        print(f"# rank {r}: us = {fixed:.1f} fixed + bytes at {rate:.2f} TB/s")
    common.write_jsonl(args.json, [{"bench": "expand_rate", **common.meta(), **r, "copy_gbs": round(copy, 0)}
                                   for r in rows])


if __name__ == "__main__":
    main()
