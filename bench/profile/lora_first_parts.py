"""Where `lora_linear` mode "first" spends its time at prefill (8 x 1024 rows, sorted, r16 and r64, bf16): per module
of the Llama-3-8B layer, graph replay over 2 rotated copies, 5 interleaved rounds (median µs): the plain GEMM (mm),
the GEMM adding onto out (addmm, beta 1), the tall-path delta written into out, the tall apply_lora (read + write of
out), and a copy / a fill of out for scale. GPU only.

    python3 bench/profile/lora_first_parts.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_layer as bl  # noqa: E402
import common  # noqa: E402

import lora_kernels as lk  # noqa: E402
from lora_kernels.backends.triton import BACKEND  # noqa: E402

KINDS = ("mm", "addmm", "delta", "apply", "copy", "fill")


def _fn(kind: str, mod, off, info):
    x, w, a, b, out = mod
    spare = torch.empty_like(out)
    return {"mm": lambda: torch.mm(x, w.t(), out=out),
            "addmm": lambda: torch.addmm(out, x, w.t(), out=out),
            "delta": lambda: BACKEND.lora_delta(x, out, a, b, info, off),
            "apply": lambda: lk.apply_lora(x, out, a, b, info, off),
            "copy": lambda: spare.copy_(out),
            "fill": lambda: spare.fill_(1.0)}[kind]


def main() -> None:
    dev = torch.device("cuda")
    for rank in (16, 64):
        rng = np.random.default_rng([rank, 8, 7])
        counts, slots = bl.batch("prefill", 8, rng)
        T = sum(counts)
        ranks = torch.full((bl.NUM_SLOTS,), rank, dtype=torch.int32, device=dev)
        scalings = torch.tensor(rng.uniform(0.5, 2.0, bl.NUM_SLOTS), dtype=torch.float32, device=dev)
        info = lk.BatchInfoBuilder(T, 8, ranks, scalings, cuda_graph=True).build(counts, slots, sort_by_adapter=True)
        gen = torch.Generator(device=dev).manual_seed(rank)
        copies = [bl.LayerCopy(rank, T, dev, torch.bfloat16, 1, gen) for _ in range(2)]
        offs = bl.offsets(1)
        total = dict.fromkeys(KINDS, 0.0)
        for m in bl.MODULES:
            timers = {k: common.GraphTimer([_fn(k, c.mods[m], offs[m], info) for c in copies], inner=4) for k in KINDS}
            times = {k: [] for k in KINDS}
            for _ in range(5):
                for k in KINDS:
                    times[k].append(timers[k].time_us(reps=10))
            med = {k: statistics.median(v) for k, v in times.items()}
            for k, v in med.items():
                total[k] += v
            print(f"r{rank} {m:8s} " + "  ".join(f"{k} {v:8.1f}" for k, v in med.items()), flush=True)
        print(f"r{rank} layer    " + "  ".join(f"{k} {v:8.1f}" for k, v in total.items()), flush=True)
        print(f"r{rank} first = addmm + delta - mm: {total['addmm'] + total['delta'] - total['mm']:.1f} us added; "
              f"serial adds apply {total['apply']:.1f}", flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
