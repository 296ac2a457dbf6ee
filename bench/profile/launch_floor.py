"""What a layer costs before any LoRA arithmetic: the launch floor beside bench_kernels' streaming reference.

Issues 19 and 21 set their decode targets as ratios to the streaming reference (per module a `copy_` of half the
module's floor bytes, CUDA-graph replay, rotated sets: bench_kernels' `ref`). This probe times, with the same
modules, sets and timer (bench_kernels.time_case: one graph per module, interleaved rounds, median):

    ref            bench_kernels' reference: one copy_ a module
    empty1         one empty Triton kernel a module, no programmatic dependent launch (PDL)
    empty1+pdl     the same with PDL (gdc_launch_dependents, then gdc_wait)
    empty2+pdl     two such launches a module (the shape of a shrink-then-expand design)
    stream1        one Triton kernel a module copying the reference's bytes (loads, then stores)
    stream1+pdl    the same with PDL: the loads before gdc_wait (as weights are read), the stores after it
    stream2+pdl    two launches a module, each copying half of the bytes with PDL
    chain1+pdl     stream1+pdl whose stores wait, after gdc_wait, for a load of a word the previous launch wrote
    chain2+pdl     the same in two launches a module: the least chain of a shrink-then-expand design, where the
                   shrink reads x and the expand v (each the previous kernel's output) only after gdc_wait

and, for comparison, each backend of --backends (bench_kernels' variant, sorted where adapters repeat).
`empty1+pdl / ref` is the least ratio a design of one kernel a module can reach at a batch, `empty2+pdl / ref` the
least for two kernels a module, and `chain2+pdl / ref` the least for two launches that each read their predecessor's
output: a target below them cannot be met by a kernel design of that shape.

    python3 bench/profile/launch_floor.py [--cases "decode 1x1,decode 16x1"] [--backends triton,cuda] [--json F]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as gdc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_kernels as bk  # noqa: E402
import common  # noqa: E402

BLOCK = 2048  # int32 elements (8 KB) a program of the copy kernel
VARIANTS = ("ref", "empty1", "empty1+pdl", "empty2+pdl", "stream1", "stream1+pdl", "stream2+pdl", "chain1+pdl",
            "chain2+pdl")


@triton.jit
def _empty(PDL: tl.constexpr):
    if PDL:
        gdc.gdc_launch_dependents()
        gdc.gdc_wait()


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc.gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    vals = tl.load(src + offs, mask=mask)
    if PDL:
        gdc.gdc_wait()
    tl.store(dst + offs, vals, mask=mask)


@triton.jit
def _chain(src, dst, dep_in, dep_out, n, BLOCK: tl.constexpr):
    gdc.gdc_launch_dependents()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    vals = tl.load(src + offs, mask=mask)
    gdc.gdc_wait()
    d = tl.load(dep_in)  # the previous launch's output: one dependent round trip before the stores
    tl.store(dst + offs, vals + d, mask=mask)
    if tl.program_id(0) == 0:
        tl.store(dep_out, d + 1)


def _launch_copy(src: torch.Tensor, dst: torch.Tensor, pdl: bool) -> None:
    n = src.numel()
    _copy[(triton.cdiv(n, BLOCK),)](src, dst, n, BLOCK=BLOCK, PDL=pdl, launch_pdl=pdl)


def _launch_chain(src: torch.Tensor, dst: torch.Tensor, dep_in: torch.Tensor, dep_out: torch.Tensor) -> None:
    n = src.numel()
    _chain[(triton.cdiv(n, BLOCK),)](src, dst, dep_in, dep_out, n, BLOCK=BLOCK, launch_pdl=True)


def _fns(mod: bk.Module, variant: str):
    """Callables (one per rotated set) of a variant for one module."""
    if variant == "ref":
        return mod.fns("ref")
    kind, _, pdl = variant.partition("+")
    pdl = pdl == "pdl"
    launches = int(kind[-1])
    out = []
    # chain: words each launch reads after gdc_wait and writes for the next one
    deps = [torch.zeros(1, dtype=torch.int32, device=mod.sets[0][4].device) for _ in range(2)]
    for s in mod.sets:
        src, dst = s[4].view(torch.int32), s[5].view(torch.int32)  # the reference's bytes (floor_bytes // 2)
        if kind.startswith("empty"):
            def f(pdl=pdl, launches=launches):
                for _ in range(launches):
                    _empty[(1,)](PDL=pdl, launch_pdl=pdl)
        else:
            half = (src.numel() + launches - 1) // launches
            parts = [(src[i:i + half], dst[i:i + half]) for i in range(0, src.numel(), half)]
            if kind.startswith("chain"):  # the words alternate, so each launch reads what the one before wrote
                def f(parts=parts):
                    for j, (a, b) in enumerate(parts):
                        _launch_chain(a, b, deps[j % 2], deps[(j + 1) % 2])
            else:
                def f(parts=parts, pdl=pdl):
                    for a, b in parts:
                        _launch_copy(a, b, pdl)
        out.append(f)
    return out


def run(cases: list[str], backends: list[str], rounds: int, reps: int, json_path) -> None:
    print(f"# {common.device_name()}, bf16 modules, graph replay, {rounds} interleaved rounds "
          f"(bench_kernels' timer); layer µs, median (x the reference)")
    print(f"{'case':>26} " + " ".join(f"{v:>15}" for v in [*VARIANTS, *backends]))
    rows = []
    for case in bk.all_cases(False):
        if not (any(c in case.name for c in cases) if cases else case.kind == "decode"):
            continue
        mods, infos = bk.build_case(case)
        order = "sorted" if "sorted" in infos else "unsorted"
        names = [*VARIANTS, *(f"{b} {order}" for b in backends)]
        times = bk.time_case(mods, names, rounds, reps, lambda m, v: _fns(m, v) if v in VARIANTS else m.fns(v))
        ref = statistics.median(times["ref"])
        cells = []
        for v in names:
            med = statistics.median(times[v])
            cells.append(f"{med:6.1f} ({med / ref:4.2f}x)")
            rows.append({"bench": "launch_floor", "case": case.name, "variant": v, "layer_us": med,
                         "min_us": min(times[v]), "max_us": max(times[v]), "x_ref": med / ref})
        print(f"{case.name:>26} " + " ".join(f"{c:>15}" for c in cells))
        del mods
        torch.cuda.empty_cache()
    common.write_jsonl(json_path, rows)


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--cases", default="", help="comma list of substrings of case names (default: every decode case)")
    p.add_argument("--backends", default="triton", help="comma list of lora_kernels backends timed beside")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    run([c.strip() for c in args.cases.split(",") if c.strip()], [b for b in args.backends.split(",") if b],
        args.rounds, 10 if args.quick else args.reps, args.json)


if __name__ == "__main__":
    main()
