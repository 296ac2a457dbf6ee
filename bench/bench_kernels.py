"""SGMV kernels on Llama-3-8B LoRA shapes, in CUDA-graph replay, against the HBM floor and two baselines.

Modules (bf16): qkv 4096 -> 4096/1024/1024, o 4096 -> 4096, gate_up 4096 -> 2x14336, down 14336 -> 4096.
Cases: ranks 16 and 64; decode batches 1/16/64/256 with adapters distinct / uniform over 32 slots /
identical; prefill 8 x 1024 tokens (8 distinct adapters). Batch metadata comes from the graph-mode
BatchInfoBuilder as a serving engine would use it (sort_by_adapter where adapters repeat).

Per case and backend: µs per module and per layer (sum of the four), graph replay, buffers rotated so
that L2 does not hold what the next call reads; the HBM floor (x read + out read and write + the
distinct adapters' weights, over the copy bandwidth measured in this run) and % of it; speedups over a
per-segment torch loop and over gather + bmm. Backends: triton, cuda (the extension, if built),
loop, bmm. `--tune` sweeps the Triton block table (lora_kernels/triton/plan.py) per regime instead.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import lora_kernels as lk  # noqa: E402

MODULES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
           "down": (14336, (4096,))}
DTYPE = torch.bfloat16
DEVICE = "cuda"
ROTATE_BYTES = 256 << 20  # data touched per rotation: several times the 50 MB L2
MAX_COPIES = 8
BMM_MAX_BYTES = 8 << 30  # gather + bmm materializes per-row weights: skipped beyond this (prefill)


@dataclass(frozen=True)
class Case:
    rank: int
    kind: str  # decode | prefill
    batch: int
    pop: str  # distinct | uniform | identical
    num_slots: int

    @property
    def name(self) -> str:
        return f"r{self.rank} {self.kind} {self.batch}x{1024 if self.kind == 'prefill' else 1} {self.pop}"


def all_cases(quick: bool) -> list[Case]:
    cases = []
    for rank in (16, 64):
        for batch in ((1, 64, 256) if quick else (1, 16, 64, 256)):
            for pop in (("distinct", "uniform") if quick else ("distinct", "uniform", "identical")):
                cases.append(Case(rank, "decode", batch, pop, batch if pop == "distinct" else 32))
        cases.append(Case(rank, "prefill", 8, "distinct", 8))
    return cases


def batch_lists(case: Case, rng) -> tuple[list[int], list[int], bool]:
    """(token counts, slots, sort_by_adapter) per request."""
    counts = [1024 if case.kind == "prefill" else 1] * case.batch
    if case.pop == "distinct":
        slots = [int(s) for s in rng.permutation(case.num_slots)[: case.batch]]
    elif case.pop == "uniform":
        slots = [int(s) for s in rng.integers(0, case.num_slots, case.batch)]
    else:
        slots = [int(rng.integers(case.num_slots))] * case.batch
    return counts, slots, case.pop != "distinct"


class Module:
    """One module group's buffers for a case, in `copies` rotated sets (x, out, lora_a, lora_b)."""

    def __init__(self, name: str, case: Case, info, counts, slots, sort):
        self.name = name
        in_dim, widths = MODULES[name]
        self.offsets = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
        self.num_slices = len(widths)
        R, S, out_total, T = case.rank, len(widths), self.offsets[-1], sum(counts)
        distinct = len(set(s for s in slots if s >= 0))
        self.weight_bytes = distinct * (S * R * in_dim + out_total * R) * 2
        self.floor_bytes = (T * in_dim + 2 * T * out_total) * 2 + self.weight_bytes
        pool_bytes = case.num_slots * (S * R * in_dim + out_total * R) * 2 + (T * in_dim + T * out_total) * 2
        copies = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(self.floor_bytes, 1)),
                            (8 << 30) // max(pool_bytes, 1)))
        self.sets = []
        for _ in range(copies):
            x = torch.randn(T, in_dim, device=DEVICE, dtype=DTYPE)
            out = torch.randn(T, out_total, device=DEVICE, dtype=DTYPE)
            a = torch.randn(case.num_slots, S * R, in_dim, device=DEVICE, dtype=DTYPE).mul_(in_dim ** -0.5)
            b = torch.randn(case.num_slots, out_total, R, device=DEVICE, dtype=DTYPE).mul_(R ** -0.5)
            self.sets.append((x, out, a, b))
        self.info = info
        self._baselines(case, counts, slots, sort)

    def _baselines(self, case, counts, slots, sort):
        """Host-side segment lists for the torch loop; per-row slots for gather + bmm."""
        R = case.rank
        scal = self.info.scalings.tolist()
        row_slot = np.repeat(np.asarray(slots), counts)
        self.loop_segments = []
        if sort:  # one segment per adapter, rows gathered and scattered by index
            for slot in sorted(set(int(s) for s in slots if s >= 0)):
                idx = torch.from_numpy(np.nonzero(row_slot == slot)[0]).to(DEVICE)
                self.loop_segments.append((idx, slot, scal[slot]))
        else:
            start = 0
            for n, slot in zip(counts, slots):
                if slot >= 0:
                    self.loop_segments.append((slice(start, start + n), slot, scal[slot]))
                start += n
        T = len(row_slot)
        self.row_slot = torch.from_numpy(np.maximum(row_slot, 0)).to(DEVICE)
        self.row_scale = torch.tensor([scal[s] if s >= 0 else 0.0 for s in row_slot], device=DEVICE)
        x, out, a, b = self.sets[0]
        self.bmm_bytes = T * (a.shape[1] * a.shape[2] + b.shape[1] * R) * 2

    def fns(self, backend: str):
        f = {"triton": self._sgmv("triton"), "cuda": self._sgmv("cuda"), "loop": self._loop, "bmm": self._bmm}[backend]
        return [lambda s=s: f(*s) for s in self.sets]

    def _sgmv(self, backend):
        def run(x, out, a, b):
            lk.apply_lora(x, out, a, b, self.info, self.offsets, backend=backend)
        return run

    def _loop(self, x, out, a, b):
        R, offs = b.shape[2], self.offsets
        for rows, slot, scale in self.loop_segments:
            xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
            v = xs @ a[slot].T
            delta = torch.cat([v[:, i * R:(i + 1) * R] @ b[slot, offs[i]:offs[i + 1]].T
                               for i in range(self.num_slices)], dim=1)
            if isinstance(rows, slice):
                out[rows].add_(delta, alpha=scale)
            else:
                out.index_add_(0, rows, delta, alpha=scale)

    def _bmm(self, x, out, a, b):
        R, offs = b.shape[2], self.offsets
        v = torch.bmm(a[self.row_slot], x.unsqueeze(2))  # [T, S*R, 1]
        bg = b[self.row_slot]  # [T, out_total, R]
        delta = torch.cat([torch.bmm(bg[:, offs[i]:offs[i + 1]], v[:, i * R:(i + 1) * R])
                           for i in range(self.num_slices)], dim=1).squeeze(2)
        out.add_((delta.float() * self.row_scale[:, None]).to(out.dtype))


def build_case(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    counts, slots, sort = batch_lists(case, rng)
    ranks = torch.full((case.num_slots,), case.rank, dtype=torch.int32, device=DEVICE)
    scalings = torch.tensor(rng.uniform(0.5, 2.0, case.num_slots), dtype=torch.float32, device=DEVICE)
    builder = lk.BatchInfoBuilder(sum(counts), len(counts), ranks, scalings, cuda_graph=True)
    info = builder.build(counts, slots, sort_by_adapter=sort)
    return {m: Module(m, case, info, counts, slots, sort) for m in MODULES}, info


def time_module(mod: Module, backend: str, reps: int) -> float:
    return common.time_graph_us(mod.fns(backend), inner=len(mod.sets), warmup=2, reps=reps)


def run_bench(args):
    bw = common.copy_bandwidth_gbs()
    print(f"# {common.device_name()}, copy bandwidth {bw:.0f} GB/s (read + write), bf16, graph replay")
    backends = [b for b in args.backends.split(",") if b]
    if "cuda" in backends and not lk.HAS_CUDA_EXT:
        print("# cuda backend skipped: extension not built")
        backends.remove("cuda")
    reps = 10 if args.quick else 30
    rows, jrows, host_rows = [], [], []
    for case in all_cases(args.quick):
        mods, info = build_case(case)
        for mod in mods.values():
            check_backends(mod, backends)
        floor = {m: mods[m].floor_bytes / bw / 1e3 for m in MODULES}
        weight_mb = sum(m.weight_bytes for m in mods.values()) / 1e6
        times = {}
        for b in backends:
            t = {}
            for m, mod in mods.items():
                if b == "bmm" and mod.bmm_bytes > BMM_MAX_BYTES:
                    break
                t[m] = time_module(mod, b, 3 if b in ("loop", "bmm") else reps)
            if len(t) == len(MODULES):
                times[b] = t
        layer_floor = sum(floor.values())
        for b, t in times.items():
            layer = sum(t.values())
            row = {"case": case.name, "seg_len": info.max_seg_len, "weights_MB": weight_mb, "backend": b,
                   **{m: t[m] for m in MODULES}, "layer_us": layer, "floor_us": layer_floor,
                   "pct_floor": 100 * layer_floor / layer}
            for base in ("loop", "bmm"):
                if base in times and b in ("triton", "cuda"):
                    row[f"x_{base}"] = sum(times[base].values()) / layer
            if b != "triton" and "triton" in times:
                row["vs_triton"] = layer / sum(times["triton"].values())
            rows.append(row)
            jrows.append({"bench": "sgmv_apply", **row, "rank": case.rank, "kind": case.kind, "batch": case.batch,
                          "pop": case.pop, "copy_gbs": bw})
        if case.kind == "decode" and case.batch == 1 and case.pop == "distinct":
            host_rows += host_overhead(case, mods, [b for b in backends if b in ("triton", "cuda")])
        del mods
        torch.cuda.empty_cache()
    print()
    common.print_table(rows, ["case", "seg_len", "weights_MB", "backend", *MODULES, "layer_us", "floor_us",
                              "pct_floor", "x_loop", "x_bmm", "vs_triton"])
    if host_rows:
        print("\n# eager: host µs per apply_lora call (launch path, no sync) and GPU µs per layer without a graph")
        common.print_table(host_rows, ["case", "backend", "host_us_per_call", "eager_layer_us"])
        jrows += [{"bench": "sgmv_eager", **r} for r in host_rows]
    common.write_jsonl(args.json, jrows)


def check_backends(mod: Module, backends) -> None:
    """Every backend (baselines included) must compute the same result before it is timed; one that
    does not is dropped from `backends` with a note (the Triton backend's failure is fatal)."""
    x, out, a, b = mod.sets[0]
    results = {}
    for name in backends:
        if name == "bmm" and mod.bmm_bytes > BMM_MAX_BYTES:
            continue
        o = out.clone()
        {"triton": mod._sgmv("triton"), "cuda": mod._sgmv("cuda"), "loop": mod._loop, "bmm": mod._bmm}[name](x, o, a, b)
        results[name] = (o.float() - out.float())
    ref = results.get("loop", next(iter(results.values())))
    for name, delta in results.items():
        err = float((delta - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err <= 2e-2:
            msg = f"{mod.name}: backend {name} differs from the torch loop (rel. err. of the LoRA delta {err:.2e})"
            if name == "triton":
                raise RuntimeError(msg)
            print(f"# {msg}: dropped")
            backends.remove(name)


def host_overhead(case, mods, backends):
    out = []
    for b in backends:
        fns = [mods[m].fns(b)[0] for m in MODULES]
        host = common.time_host_us(fns[0], warmup=20, reps=300)["median_us"]

        def layer():
            for f in fns:
                f()
        out.append({"case": case.name, "backend": b, "host_us_per_call": host,
                    "eager_layer_us": common.time_cuda_us(layer, warmup=5, reps=30)})
    return out


# ---- --tune: sweep the Triton block table per regime ----

def tune_candidates():
    from lora_kernels.triton.plan import ExpandCfg as E, ShrinkCfg as S

    return {
        "decode": ([S(1, 16, 256, 1024, 64, 4, 2), S(1, 32, 256, 1024, 64, 4, 2)],
                   [E(1, 128, 64, 4096, 4, 1), E(1, 64, 64, 4096, 4, 1), E(1, 256, 64, 4096, 8, 1)]),
        "mixed": ([S(16, 32, 256, 2048, 16, 4, 3)], [E(16, 128, 64, 2048, 4, 2), E(16, 64, 64, 2048, 4, 2)]),
        "prefill": ([S(64, 64, 64, 0, 1, 4, 4)], [E(64, 128, 64, 2048, 4, 3), E(64, 64, 64, 2048, 4, 3)]),
    }


TUNE_CASES = {
    "decode": [Case(16, "decode", 1, "distinct", 1), Case(64, "decode", 16, "distinct", 16),
               Case(64, "decode", 256, "distinct", 256)],
    "mixed": [Case(16, "decode", 64, "uniform", 32), Case(64, "decode", 256, "uniform", 32)],
    "prefill": [Case(16, "prefill", 8, "distinct", 8), Case(64, "prefill", 8, "distinct", 8)],
}


def run_tune(args):
    from lora_kernels.triton import plan

    cands = tune_candidates()
    regimes = [r for r in args.regimes.split(",") if r]
    jrows, best = [], {}
    for reg in regimes:
        built = [build_case(c) for c in TUNE_CASES[reg]]
        for case, (mods, info) in zip(TUNE_CASES[reg], built):
            got = plan.regime(mods["qkv"].sets[0][0].shape[0], info.max_seg_len)
            if got != reg:
                print(f"# warning: {case.name} runs in regime {got}, not {reg} (max_seg_len {info.max_seg_len})")
        shrinks, expands = cands[reg]

        def score(cfg):
            plan.TABLE[reg] = cfg
            plan.clear_cache()
            return [sum(time_module(m, "triton", 15) for m in mods.values()) for mods, _ in built]

        def rel(ts, results):
            mins = [min(r[1][i] for r in results) for i in range(len(ts))]
            return sum(t / mn for t, mn in zip(ts, mins)) / len(ts)

        results = [((s, expands[0]), score((s, expands[0]))) for s in shrinks]
        best_s = min(results, key=lambda r: rel(r[1], results))[0][0]
        results += [((best_s, e), score((best_s, e))) for e in expands[1:]]
        table = []
        for cfg, ts in results:
            table.append({"regime": reg, "shrink": _cfg_str(cfg[0]), "expand": _cfg_str(cfg[1]),
                          "rel": rel(ts, results), **{c.name: t for c, t in zip(TUNE_CASES[reg], ts)}})
            jrows.append({"bench": "sgmv_tune", **table[-1]})
        common.print_table(table, ["regime", "shrink", "expand", "rel", *[c.name for c in TUNE_CASES[reg]]])
        best[reg] = min(results, key=lambda r: rel(r[1], results))[0]
        plan.TABLE[reg] = best[reg]
        plan.clear_cache()
        print(f"# best {reg}: {best[reg]}")
        split = []
        for case, (mods, _) in zip(TUNE_CASES[reg], built):
            for m, mod in mods.items():
                row = {"case": case.name, "module": m, **kernel_times(mod)}
                split.append(row)
                jrows.append({"bench": "sgmv_kernels", **row})
        common.print_table(split, ["case", "module", "shrink_us", "expand_us", "apply_us"])
        print()
        del built
        torch.cuda.empty_cache()
    if args.table_out:
        import json

        args.table_out.write_text(json.dumps({r: [list(c[0].__dict__.values()), list(c[1].__dict__.values())]
                                              for r, c in best.items()}))
    common.write_jsonl(args.json, jrows)


def kernel_times(mod: Module) -> dict:
    """Graph-replay µs of shrink alone (into fp32 v; split-K adds its reduction) and expand alone."""
    vs = [torch.empty(x.shape[0], a.shape[1], device=DEVICE) for x, _, a, _ in mod.sets]
    shrink = [lambda s=s, v=v: lk.sgmv_shrink(s[0], s[2], mod.info, mod.num_slices, out=v, backend="triton")
              for s, v in zip(mod.sets, vs)]
    expand = [lambda s=s, v=v: lk.sgmv_expand(v, s[3], mod.info, mod.offsets, s[1], backend="triton")
              for s, v in zip(mod.sets, vs)]
    n = len(mod.sets)
    return {"shrink_us": common.time_graph_us(shrink, inner=n, warmup=2, reps=15),
            "expand_us": common.time_graph_us(expand, inner=n, warmup=2, reps=15),
            "apply_us": time_module(mod, "triton", 15)}


def load_table(path: Path) -> None:
    """Replaces the Triton block table by one written with --tune --table-out."""
    import json

    from lora_kernels.triton import plan

    for reg, (s, e) in json.loads(path.read_text()).items():
        plan.TABLE[reg] = (plan.ShrinkCfg(*s), plan.ExpandCfg(*e))
    plan.clear_cache()
    print(f"# Triton table from {path}: {plan.TABLE}")


def _cfg_str(c) -> str:
    return "/".join(str(v) for v in c.__dict__.values())


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton,cuda,loop,bmm", help="comma list of triton,cuda,loop,bmm")
    p.add_argument("--tune", action="store_true", help="sweep the Triton block table instead of benchmarking")
    p.add_argument("--regimes", default="decode,mixed,prefill", help="regimes to tune (with --tune)")
    p.add_argument("--table-out", type=Path, default=None, help="with --tune: write the best table here (JSON)")
    p.add_argument("--table", type=Path, default=None, help="use this Triton block table (from --table-out)")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.table:
        load_table(args.table)
    (run_tune if args.tune else run_bench)(args)


if __name__ == "__main__":
    main()
