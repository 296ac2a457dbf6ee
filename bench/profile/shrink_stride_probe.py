"""How fast the prefill shrink streams x as a function of x's row stride (in_dim): 8192 rows in 8 segments of 1024
(distinct slots), three slices of rank 16 (v 48 wide, one column tile: one 64-row item a CTA), bf16, CUDA-graph
replay over two rotating sets of x (each larger than L2). Prints µs per shrink and x's bytes over that time beside
the D2D copy bandwidth of the same run. Why: ncu has the in_dim 4096 shrinks at ~61% of DRAM bandwidth and the
in_dim 14336 one at ~77%, whatever the kernel form; this separates the stride from the kernel.

    python bench/profile/shrink_stride_probe.py [--dims 4096,4160,8192,14336] [--env LK_X=1]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import lora_kernels as lk  # noqa: E402
from lora_kernels.batch_info import LoRABatchInfo  # noqa: E402


def probe(k: int, rows: int = 8192, seg: int = 1024, R: int = 16, slices: int = 3) -> dict:
    g = torch.Generator(device="cuda").manual_seed(k)
    xs = [torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2)]
    a = (torch.randn(rows // seg, slices * R, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
    ranks = torch.full((rows // seg,), R, dtype=torch.int32, device="cuda")
    info = LoRABatchInfo.from_segments([seg] * (rows // seg), list(range(rows // seg)), ranks,
                                       torch.ones(rows // seg, device="cuda"), None)
    vs = [torch.empty(rows, slices * R, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    fns = [lambda i=i: lk.sgmv_shrink(xs[i], a, info, slices, out=vs[i], backend="cuda") for i in range(2)]
    us = common.time_graph_us(fns, inner=20, reps=30)
    return {"in_dim": k, "row_stride_kb": k * 2 / 1024, "us": round(us, 2),
            "x_gbs": round(rows * k * 2 / us / 1e3, 0)}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--dims", default="4096,4160,8192,8256,14336")
    p.add_argument("--env", default="", help="K=V[,K2=V2] set while capturing (launch-time switches)")
    args = p.parse_args()
    common.set_env(args.env)
    copy = common.copy_bandwidth_gbs()
    rows = [{**probe(int(d)), "copy_gbs": round(copy, 0), "env": args.env} for d in args.dims.split(",")]
    common.print_table(rows, ["in_dim", "row_stride_kb", "us", "x_gbs", "copy_gbs", "env"])
    common.write_jsonl(args.json, [{"bench": "shrink_stride", **common.meta(), **r} for r in rows])


if __name__ == "__main__":
    main()
