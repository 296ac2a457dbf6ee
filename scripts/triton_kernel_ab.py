"""A/B of the Triton SGMV kernels: this tree's kernels.py against other versions of the file, same plans.

    git show <rev>:lora_kernels/backends/triton/kernels.py > /tmp/old_kernels.py
    python3 scripts/triton_kernel_ab.py /tmp/old_kernels.py[,/tmp/other.py...] [case substrings, comma list]

For each bench_kernels case (default: the decode cases r16 bs1 / 16 / 64), every kernel set (another file's
_shrink_kernel, _reduce_kernel and _expand_kernel put in the backend's place, signatures must match) first
computes the first module's output from the same base (bit-compared with this tree's), then the layer's graphs
are captured once per set and replayed in interleaved rounds (bench_kernels' method; the replays add into the
bases in place, so no output is taken after them). Prints layer µs per variant.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import bench_kernels as bk  # noqa: E402
import common  # noqa: E402
from lora_kernels.backends import triton as tb  # noqa: E402
from lora_kernels.backends.triton import plan  # noqa: E402

NAMES = ("_shrink_kernel", "_reduce_kernel", "_expand_kernel")


def _use(kernels: dict) -> None:
    for n, k in kernels.items():
        setattr(tb, n, k)
    plan.clear_cache()


def main(others: str, cases: str = "r16 decode 1x1 distinct,r16 decode 16x1 uniform,r16 decode 64x1 uniform"):
    sets = {"this tree": {n: getattr(tb, n) for n in NAMES}}
    for other in others.split(","):
        spec = importlib.util.spec_from_file_location(f"ab_{Path(other).stem}", other)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sets[Path(other).name] = {n: getattr(mod, n) for n in NAMES}
    want = [c for c in cases.split(",") if c]
    print(f"# {common.device_name()}, layer µs, graph replay, rotated buffers, 5 interleaved rounds")
    for case in bk.all_cases(False):
        if not any(w in case.name for w in want):
            continue
        mods, infos = bk.build_case(case)
        order = "sorted" if "sorted" in infos else "unsorted"
        m0 = next(iter(mods.values()))
        x, out, a, b = m0.sets[0][:4]
        base = out.clone()
        outs = {}
        for label, ks in sets.items():  # every output before any graph: the replays change the bases
            _use(ks)
            o = base.clone()
            bk.apply("triton", x, o, a, b, m0.infos[order], m0.offsets)
            outs[label] = o
        graphs = {}
        for label, ks in sets.items():
            _use(ks)
            graphs[label] = [common.GraphTimer(m.fns(f"triton {order}"), inner=len(m.sets)) for m in mods.values()]
        first = outs["this tree"]
        times = {label: [] for label in sets}
        for _ in range(5):
            for label in sets:
                times[label].append(sum(g.time_us(reps=30) for g in graphs[label]))
        print(f"{case.name} ({order}): " + " | ".join(
            f"{label} {statistics.median(ts):.1f} [{min(ts):.1f}-{max(ts):.1f}]"
            + ("" if label == "this tree" else f" {'bit-equal' if torch.equal(outs[label], first) else 'DIFFERENT'}")
            for label, ts in times.items()))
        _use(sets["this tree"])
        del mods, graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(*sys.argv[1:])
