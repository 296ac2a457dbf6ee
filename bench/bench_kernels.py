"""SGMV kernels on Llama-3-8B LoRA shapes (Llama-3.2-1B ones with --shapes 1b), in CUDA-graph replay, against the
bytes floor, the streaming reference (a memcpy of the same bytes) and two baselines.

Modules (bf16): qkv 4096 -> 4096/1024/1024, o 4096 -> 4096, gate_up 4096 -> 2x14336, down 14336 -> 4096.
Cases: ranks 16 and 64; decode batches 1/16/64/256 with adapters distinct / uniform over 32 slots /
identical; prefill 8 x 1024 tokens (8 distinct adapters); a chunked-prefill step (one 1024-row chunk beside 63
decode rows, adapters uniform over 32 slots). Batch metadata comes from the graph-mode
BatchInfoBuilder as a serving engine would use it; where adapters repeat, sorted and unsorted both run.

Per case: µs per module and per layer (sum of the four), graph replay, buffers rotated so that L2 does not
hold what the next call reads. Beside each: the bytes floor (x read + out read and write + the distinct
adapters' weights, over the copy bandwidth measured in this run) and the streaming reference: per module
one D2D `copy_` of half the module's floor bytes (it reads N and writes N), captured and timed the same
way. Every variant of a case (reference, backends sorted/unsorted, baselines) is timed in 5 interleaved
rounds: median and range. Baselines: a per-segment torch loop and gather + bmm. Also: eager host µs per
apply_lora call, and a bit-equality check of the same rows across sorted / unsorted batches.
`--tune` sweeps the Triton block table and, with `--write-tables`, writes lora_kernels/backends/tables.py.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import lora_kernels as lk  # noqa: E402

# (in_dim, slice widths) per module group, by model shape; --shapes picks one (8b: the issues' tables, and the
# only shapes --write-tables accepts, the tables being global; 1b: the 2048-wide modules bench_hf's 1B runs).
SHAPES = {"8b": {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                 "down": (14336, (4096,))},
          "1b": {"qkv": (2048, (2048, 512, 512)), "o": (2048, (2048,)), "gate_up": (2048, (8192, 8192)),
                 "down": (8192, (2048,))}}
MODULES = dict(SHAPES["8b"])  # the run's shapes (main sets them from --shapes)
DTYPE = torch.bfloat16
DEVICE = "cuda"
ROTATE_BYTES = 256 << 20  # data touched per rotation: several times the 50 MB L2
MAX_COPIES = 8
ROUNDS = 5  # interleaved timing rounds per case
BMM_MAX_BYTES = 8 << 30  # gather + bmm materializes per-row weights: skipped beyond this (prefill)


@dataclass(frozen=True)
class Case:
    rank: int
    kind: str  # decode | prefill | mixed (one 1024-row prefill chunk beside batch - 1 decode rows)
    batch: int
    pop: str  # distinct | uniform | identical
    num_slots: int

    @property
    def name(self) -> str:
        if self.kind == "mixed":
            return f"r{self.rank} mixed 1024+{self.batch - 1}x1 {self.pop}"
        return f"r{self.rank} {self.kind} {self.batch}x{1024 if self.kind == 'prefill' else 1} {self.pop}"


def all_cases(quick: bool) -> list[Case]:
    cases = []
    for rank in (16, 64):
        for batch in ((1, 64, 256) if quick else (1, 16, 64, 256)):
            for pop in (("distinct", "uniform") if quick else ("distinct", "uniform", "identical")):
                cases.append(Case(rank, "decode", batch, pop, batch if pop == "distinct" else 32))
        cases.append(Case(rank, "prefill", 8, "distinct", 8))
        if not quick:  # a chunked-prefill step: one 1024-row chunk beside 63 decode rows
            cases.append(Case(rank, "mixed", 64, "uniform", 32))
    return cases


def batch_lists(case: Case, rng) -> tuple[list[int], list[int]]:
    """(token counts, slots) per request."""
    counts = [1024 if case.kind == "prefill" else 1] * case.batch
    if case.kind == "mixed":
        counts[0] = 1024
    if case.pop == "distinct":
        slots = [int(s) for s in rng.permutation(case.num_slots)[: case.batch]]
    elif case.pop == "uniform":
        slots = [int(s) for s in rng.integers(0, case.num_slots, case.batch)]
    else:
        slots = [int(rng.integers(case.num_slots))] * case.batch
    return counts, slots


class Module:
    """One module group's buffers for a case, in `copies` rotated sets (x, out, lora_a, lora_b)."""

    def __init__(self, name: str, case: Case, infos: dict, counts, slots):
        self.name = name
        in_dim, widths = MODULES[name]
        self.offsets = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
        self.num_slices = len(widths)
        R, S, out_total = case.rank, len(widths), self.offsets[-1]
        T = max(i.num_tokens for i in infos.values())  # graph-mode decode infos cover their padding rows
        tokens = sum(counts)
        distinct = len(set(s for s in slots if s >= 0))
        self.weight_bytes = distinct * (S * R * in_dim + out_total * R) * 2
        self.floor_bytes = (tokens * in_dim + 2 * tokens * out_total) * 2 + self.weight_bytes
        pool_bytes = case.num_slots * (S * R * in_dim + out_total * R) * 2 + (T * in_dim + T * out_total) * 2
        copies = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(self.floor_bytes, 1)),
                            (8 << 30) // max(pool_bytes, 1)))
        self.sets = []
        for _ in range(copies):
            x = torch.randn(T, in_dim, device=DEVICE, dtype=DTYPE)
            out = torch.randn(T, out_total, device=DEVICE, dtype=DTYPE)
            a = torch.randn(case.num_slots, S * R, in_dim, device=DEVICE, dtype=DTYPE).mul_(in_dim ** -0.5)
            b = torch.randn(case.num_slots, out_total, R, device=DEVICE, dtype=DTYPE).mul_(R ** -0.5)
            src = torch.empty(self.floor_bytes // 2, dtype=torch.uint8, device=DEVICE)
            self.sets.append((x, out, a, b, src, torch.empty_like(src)))
        self.infos = infos
        self._baselines(case, counts, slots, next(iter(infos.values())).scalings.tolist())

    def _baselines(self, case, counts, slots, scal):
        """Host-side segment lists for the torch loop (one per adapter); per-row slots for gather + bmm."""
        R = case.rank
        row_slot = np.repeat(np.asarray(slots), counts)
        self.loop_segments = []
        for slot in sorted(set(int(s) for s in slots if s >= 0)):
            idx = torch.from_numpy(np.nonzero(row_slot == slot)[0]).to(DEVICE)
            self.loop_segments.append((idx, slot, scal[slot]))
        T = len(row_slot)
        self.row_slot = torch.from_numpy(np.maximum(row_slot, 0)).to(DEVICE)
        self.row_scale = torch.tensor([scal[s] if s >= 0 else 0.0 for s in row_slot], device=DEVICE)
        self.bmm_bytes = T * (self.sets[0][2].shape[1] * self.sets[0][2].shape[2] + self.sets[0][3].shape[1] * R) * 2

    def fns(self, variant: str):
        """Callables (one per rotated set) for a variant: ref, loop, bmm, or '<backend> <sorted|unsorted>'."""
        if variant == "ref":
            return [lambda s=s: s[5].copy_(s[4]) for s in self.sets]
        if variant in ("loop", "bmm"):
            f = self._loop if variant == "loop" else self._bmm
            return [lambda s=s: f(*s[:4]) for s in self.sets]
        backend, order = variant.split()
        info = self.infos[order]
        return [lambda s=s: apply(backend, s[0], s[1], s[2], s[3], info, self.offsets) for s in self.sets]

    def _loop(self, x, out, a, b):
        R, offs = b.shape[2], self.offsets
        for rows, slot, scale in self.loop_segments:
            v = x.index_select(0, rows) @ a[slot].T
            delta = torch.cat([v[:, i * R:(i + 1) * R] @ b[slot, offs[i]:offs[i + 1]].T
                               for i in range(self.num_slices)], dim=1)
            out.index_add_(0, rows, delta, alpha=scale)

    def _bmm(self, x, out, a, b):
        R, offs, T = b.shape[2], self.offsets, self.row_slot.shape[0]
        v = torch.bmm(a[self.row_slot], x[:T].unsqueeze(2))  # [T, S*R, 1]
        bg = b[self.row_slot]  # [T, out_total, R]
        delta = torch.cat([torch.bmm(bg[:, offs[i]:offs[i + 1]], v[:, i * R:(i + 1) * R])
                           for i in range(self.num_slices)], dim=1).squeeze(2)
        out[:T].add_((delta.float() * self.row_scale[:, None]).to(out.dtype))


PATH_VARIANTS = ("triton-fused", "triton-tall")  # Triton, one path forced on for every batch size
CUDA_FUSED = "cuda-fused"  # the cuda backend with its opt-in one-launch decode path on (LORA_KERNELS_CUDA_FUSED=1)
APPLY_BACKENDS = ("triton", *PATH_VARIANTS, "cuda", CUDA_FUSED)  # those with an eager host time and an invariance check


def path_on(variant: str, fn):
    """fn() with the Triton table switched to `variant`'s path (triton-fused: the one-launch path; triton-tall: the
    tall-tile path) for every batch size; the choice is made per call, so a graph captured through this keeps it."""
    plan = plan_module()
    table = plan.TABLE
    if variant == "triton-fused":
        plan.TABLE = {**table, "fused": {**plan.FUSED_DEFAULT, **table.get("fused", {}), "max_rows": 1 << 30}}
    else:
        plan.TABLE = {**table, "fused": {**plan.FUSED_DEFAULT, **table.get("fused", {}), "max_rows": 0},
                      "tall": {**plan.tall_config(), "min_rows": 1, "min_rank": 0}}
    try:
        return fn()
    finally:
        plan.TABLE = table


def build_case(case: Case, seed: int = 0, orders=("unsorted", "sorted")):
    """The case's modules with graph-mode infos for each order (sorted only where adapters repeat)."""
    rng = np.random.default_rng(seed)
    counts, slots = batch_lists(case, rng)
    ranks = torch.full((case.num_slots,), case.rank, dtype=torch.int32, device=DEVICE)
    scalings = torch.tensor(rng.uniform(0.5, 2.0, case.num_slots), dtype=torch.float32, device=DEVICE)
    if case.pop == "distinct":
        orders = ("unsorted",)
    infos = {}
    for order in orders:
        builder = lk.BatchInfoBuilder(sum(counts), len(counts), ranks, scalings, cuda_graph=True)
        infos[order] = builder.build(counts, slots, sort_by_adapter=order == "sorted")
    return {m: Module(m, case, infos, counts, slots) for m in MODULES}, infos


def variants(case: Case, mods, backends) -> list[str]:
    out = ["ref"]
    for b in backends:
        if b in ("loop", "bmm"):
            if b == "loop" or all(m.bmm_bytes <= BMM_MAX_BYTES for m in mods.values()):
                out.append(b)
        else:
            out += [f"{b} {o}" for o in next(iter(mods.values())).infos]
    return out


def time_case(mods, names, rounds: int, reps: int, fns=None) -> dict:
    """{variant: [layer µs per round]}: every variant's graphs captured once, then replayed in interleaved rounds.
    fns(mod, variant) gives a module's callables (default: Module.fns)."""
    fns = fns or (lambda mod, v: mod.fns(v))
    graphs = {v: {m: common.GraphTimer(fns(mod, v), inner=len(mod.sets)) for m, mod in mods.items()} for v in names}
    out = {v: [] for v in names}
    for _ in range(rounds):
        for v in names:
            r = reps if v not in ("loop", "bmm") else max(3, reps // 10)
            out[v].append(sum(g.time_us(reps=r) for g in graphs[v].values()))
    return out


def run_bench(args):
    bw = common.copy_bandwidth_gbs()
    print(f"# {common.device_name()}, copy bandwidth {bw:.0f} GB/s (read + write), bf16, graph replay, "
          f"{ROUNDS} interleaved rounds")
    backends = [b for b in args.backends.split(",") if b]
    if not lk.HAS_CUDA_EXT and CUDA_FUSED in backends:
        backends.remove(CUDA_FUSED)
    if "cuda" in backends and not lk.HAS_CUDA_EXT:
        print("# cuda backend skipped: extension not built")
        backends.remove("cuda")
    reps = 10 if args.quick else 30
    rows, jrows, host_rows, inv_rows = [], [], [], []
    only = [c.strip() for c in args.cases.split(",") if c.strip()]
    for case in all_cases(args.quick):
        if only and not any(c in case.name for c in only):
            continue
        mods, infos = build_case(case)
        names = variants(case, mods, backends)
        for mod in mods.values():
            check_variants(mod, names)
        times = time_case(mods, names, ROUNDS, reps)
        floor = sum(m.floor_bytes for m in mods.values()) / bw / 1e3
        ref = statistics.median(times["ref"])
        best = {}
        for v, ts in times.items():
            med = statistics.median(ts)
            row = {"case": case.name, "variant": v, "layer_us": med, "min_us": min(ts), "max_us": max(ts),
                   "floor_us": floor, "x_ref": med / ref, "x_floor": med / floor}
            rows.append(row)
            jrows.append({"bench": "sgmv_apply", **row, "rank": case.rank, "kind": case.kind, "batch": case.batch,
                          "pop": case.pop, "copy_gbs": bw, "rounds": ts})
            if " " in v:
                best.setdefault(v.split()[0], []).append(med)
        if case.kind == "decode" and case.batch == 1 and case.pop == "distinct":
            host_rows += host_overhead(case, mods, [b for b in backends if b in APPLY_BACKENDS])
        if "sorted" in infos:
            inv_rows += invariance(case, mods, [b for b in backends if b in APPLY_BACKENDS])
        del mods
        torch.cuda.empty_cache()
    print()
    common.print_table(rows, ["case", "variant", "layer_us", "min_us", "max_us", "floor_us", "x_ref", "x_floor"])
    if host_rows:
        print("\n# eager: host µs per apply_lora call (launch path with validation, no sync) and GPU µs per layer "
              "without a graph")
        common.print_table(host_rows, ["case", "backend", "host_us_per_call", "eager_layer_us"])
        jrows += [{"bench": "sgmv_eager", **r} for r in host_rows]
    if inv_rows:
        print("\n# batch invariance: the same rows, sorted against unsorted batch (bit-equal?)")
        common.print_table(inv_rows, ["case", "backend", "module", "bit_equal"])
        jrows += [{"bench": "sgmv_invariance", **r} for r in inv_rows]
    common.write_jsonl(args.json, [{**r, "shapes": args.shapes} for r in jrows])


def check_variants(mod: Module, names) -> None:
    """Every variant (baselines included) must compute the same LoRA delta before it is timed; a Triton
    result off by more than bf16 tolerance is fatal, another variant's is dropped with a note."""
    x, out, a, b = mod.sets[0][:4]
    deltas = {}
    for v in [n for n in names if n != "ref"]:
        o = out.clone()
        f = {"loop": mod._loop, "bmm": mod._bmm}.get(v)
        if f is not None:
            f(x, o, a, b)
        else:
            backend, order = v.split()
            apply(backend, x, o, a, b, mod.infos[order], mod.offsets)
        deltas[v] = o.float() - out.float()
    ref = deltas.get("loop", next(iter(deltas.values())))
    for v, d in deltas.items():
        err = float((d - ref).norm() / ref.norm().clamp_min(1e-30))
        if not err <= 2e-2:
            msg = f"{mod.name}: {v} differs from the torch loop (rel. err. of the LoRA delta {err:.2e})"
            if v.startswith("triton"):
                raise RuntimeError(msg)
            print(f"# {msg}: dropped")
            names.remove(v)


def invariance(case, mods, backends) -> list[dict]:
    """Bit-equality of every row between the sorted and the unsorted batch (the same rows, other order)."""
    out = []
    for b in backends:
        for m, mod in mods.items():
            x, base, a, bw = mod.sets[0][:4]
            res = {}
            for order, info in mod.infos.items():
                o = base.clone()
                apply(b, x, o, a, bw, info, mod.offsets)
                res[order] = o
            row = {"case": case.name, "backend": b, "module": m,
                   "bit_equal": bool(torch.equal(res["sorted"], res["unsorted"]))}
            if b in PATH_VARIANTS or b == CUDA_FUSED:  # and the same bits as the default path
                o = base.clone()
                apply("cuda" if b == CUDA_FUSED else "triton", x, o, a, bw, mod.infos["sorted"], mod.offsets)
                row["bit_equal"] = row["bit_equal"] and bool(torch.equal(o, res["sorted"]))
            out.append(row)
    return out


def apply(backend: str, x, out, a, b, info, offsets) -> None:
    """apply_lora through `backend`, where a PATH_VARIANTS name is Triton with that path on."""
    if backend in PATH_VARIANTS:
        path_on(backend, lambda: lk.apply_lora(x, out, a, b, info, offsets, backend="triton"))
    elif backend == CUDA_FUSED:  # the choice is made per call: a graph captured through this keeps one launch
        before = os.environ.get("LORA_KERNELS_CUDA_FUSED")
        os.environ["LORA_KERNELS_CUDA_FUSED"] = "1"
        try:
            lk.apply_lora(x, out, a, b, info, offsets, backend="cuda")
        finally:  # the caller's setting back, so that the plain "cuda" variant keeps its own path
            if before is None:
                del os.environ["LORA_KERNELS_CUDA_FUSED"]
            else:
                os.environ["LORA_KERNELS_CUDA_FUSED"] = before
    else:
        lk.apply_lora(x, out, a, b, info, offsets, backend=backend)


def host_overhead(case, mods, backends):
    """Eager host µs per apply_lora call (the GPU idle at each call) and GPU µs per eager layer; a PATH_VARIANTS name
    is timed with its path switched on around the whole measurement (not per call, which would add the switch to the
    host time)."""
    out = []
    for b in backends:
        fns = [mods[m].fns(f"{'triton' if b in PATH_VARIANTS else b} unsorted")[0] for m in MODULES]

        def layer():
            for f in fns:
                f()

        def measure():
            # The GPU drains between calls (untimed): an eager r64 call's kernels outlast its host work, so 300 calls
            # in a row presumably filled the launch queue and timed the GPU (r64 45.3 µs against r16 24.8 on the
            # H100, 2026-11-26, with no sync between calls).
            host = common.time_host_us(fns[0], warmup=20, reps=300, settle=torch.cuda.synchronize)
            return {"host_us_per_call": host["median_us"],
                    "eager_layer_us": common.time_cuda_us(layer, warmup=5, reps=30)}
        out.append({"case": case.name, "backend": b, **(path_on(b, measure) if b in PATH_VARIANTS else measure())})
    return out


# ---- --tune: sweep the Triton block table ----

def tune_candidates(keys: str = "") -> list[dict]:
    """Variations of the current table, one knob at a time (the first is the table itself); keys: a comma list
    of table entries to vary (default: all)."""
    plan = plan_module()
    base = {k: dict(v) for k, v in {"fused": plan.FUSED_DEFAULT, **plan.TABLE}.items()}
    base["tall"] = plan.tall_config()  # the keys this code knows (an older table's tall form had others)
    knobs = [("fused", {"max_rows": 64}), ("fused", {"max_rows": 256}), ("fused", {"max_rows": 1024}),
             ("tall", {"min_rows": 1024, "min_rank": 0}), ("tall", {"min_rows": 1024, "min_rank": 32}),
             ("tall", {"min_rows": 256}), ("tall", {"shrink_stages": 3}),
             ("tall", {"shrink_smem": 131072}), ("tall", {"expand_group": 4}), ("tall", {"expand_warps_wide": 4}),
             ("tall", {"expand_maxnreg_wide": 84}), ("tall", {"expand_maxnreg_wide": 96}), ("tall", {"expand_maxnreg": 64}),
             ("tall", {"shrink_warps": 8}), ("tall", {"shrink_n": 32}), ("tall", {"shrink_group": 2}),
             ("tall", {"expand_warps_wide": 8}), ("tall", {"expand_n": 256}),  # the shrink holds ~210 registers
             # The tall path's tiles come from an A/B of standalone kernels (session 6, H200, 8 x 1024 rows): 64-row
             # shrink tiles, 4 stages; expand 32 x 128 at r16, 64 x 128 with 8 warps at r64.
             ("shrink", {"ctas_per_sm": 2}), ("shrink", {"ctas_per_sm": 8}), ("shrink", {"k_chunk_min": 256}),
             ("shrink", {"k_chunk_min": 1024}), ("shrink", {"num_stages": 4}), ("shrink", {"block_k": 64}),
             ("shrink", {"max_split": 16, "k_chunk_min": 256}),  # shorter K chains for small batches
             ("shrink", {"max_split": 32, "k_chunk_min": 128}),  # one 128-wide K step per chain at K 4096
             ("shrink", {"max_split": 16}),  # only down (K 14336: 16 chains of 7 steps, not 8 of 14) changes
             ("shrink", {"block_n": 32}), ("shrink", {"block_n": 16}),  # more programs for small batches (qkv S*R 48)
             ("expand", {"ctas_per_sm": 4}), ("expand", {"ctas_per_sm": 16}), ("expand", {"block_n": 64}),
             ("expand", {"block_n": 256}), ("expand", {"num_stages": 1}), ("expand", {"num_stages": 3}),
             ("expand", {"num_warps": 8}),  # num_stages 1: the column loop unpipelined (1-3 tiles at decode)
             ("expand", {"prefetch": True}),  # the next column tile's loads in flight by hand
             ("reduce", {"min_rows": 256})]
    out = [base]
    only = [k for k in keys.split(",") if k]
    for kernel, change in knobs:
        if (not only or kernel in only) and any(base[kernel].get(k) != v for k, v in change.items()):
            out.append({**base, kernel: {**base[kernel], **change}})
    return out


TUNE_CASES = [Case(16, "decode", 1, "distinct", 1), Case(16, "decode", 64, "uniform", 32),
              Case(64, "decode", 256, "uniform", 32), Case(16, "prefill", 8, "distinct", 8),
              Case(64, "prefill", 8, "distinct", 8)]
PATH_KEYS = ("fused", "tall")  # table entries that choose among paths computing the same bits


def tune_outputs(built) -> list[torch.Tensor]:
    """Each tune case's first module, one apply on its first buffer set, as the current table computes it. The
    base rows are a copy taken at the first call: timing replays add to the sets' outputs in place, and a
    bit-for-bit comparison needs the same base."""
    outs = []
    for mods, infos in built:
        mod = next(iter(mods.values()))
        x, out, a, b = mod.sets[0][:4]
        out = mod.__dict__.setdefault("tune_base", out.clone())
        o = out.clone()
        lk.apply_lora(x, o, a, b, next(iter(infos.values())), mod.offsets, backend="triton")
        outs.append((o, o.float() - out.float()))
    return outs


def tune_close(got, truth, cand: dict, base: dict) -> bool:
    """A candidate's (output, LoRA delta) against the current table's: bit-equal where only the path entries
    changed (every path must give the same bits), else the deltas within bf16 tolerance (other blocks may split
    K differently)."""
    if all(cand[k] == base[k] for k in cand if k not in PATH_KEYS):
        return bool(torch.equal(got[0], truth[0]))
    return float((got[1] - truth[1]).norm() / truth[1].norm().clamp_min(1e-30)) <= 2e-2


def tune_one(plan, built, cand: dict, base: dict, truth):
    """(cand, layer µs per tune case), or None where the candidate fails or computes wrong results."""
    plan.TABLE = cand
    plan.clear_cache()
    try:
        if not all(tune_close(g, t, cand, base) for g, t in zip(tune_outputs(built), truth)):
            print(f"# candidate gives wrong results, left out: {json.dumps(cand)}")
            return None
        ts = []
        for (mods, infos), c in zip(built, TUNE_CASES):
            order = next(iter(infos))
            ts.append(sum(common.GraphTimer(m.fns(f"triton {order}"), inner=len(m.sets)).time_us(reps=20)
                          for m in mods.values()))
    except Exception as e:  # a candidate that does not compile or launch is reported and left out
        print(f"# candidate failed ({type(e).__name__}: {str(e)[:200]}): {json.dumps(cand)}")
        return None
    return cand, ts


def tune_combined(results) -> dict | None:
    """The base table with, for each entry, the change of the candidate that beat the base by the most total
    time (one entry changed per candidate); None when fewer than two entries improved."""
    base, base_t = results[0][0], sum(results[0][1])
    best = {}
    for cand, ts in results[1:]:
        key = next(k for k in cand if cand[k] != base[k])
        if sum(ts) < base_t and sum(ts) < best.get(key, (None, base_t))[1]:
            best[key] = (cand[key], sum(ts))
    return {**base, **{k: v for k, (v, _) in best.items()}} if len(best) >= 2 else None


def plan_module():
    from lora_kernels.backends.triton import plan

    return plan


def run_tune(args):
    """Greedy: each candidate is timed on the tune cases (sorted infos where adapters repeat); the score is
    the mean ratio to the best per case; the best table is printed, and written with --write-tables."""
    plan = plan_module()
    built = [build_case(c, orders=("sorted",)) for c in TUNE_CASES]
    cands = tune_candidates(args.tune_keys)
    truth = tune_outputs(built)  # the first candidate is the current table
    results = [r for r in (tune_one(plan, built, cand, cands[0], truth) for cand in cands) if r]
    combined = tune_combined(results)
    if combined is not None:
        results += [r for r in [tune_one(plan, built, combined, cands[0], truth)] if r]
    mins = [min(r[1][i] for r in results) for i in range(len(TUNE_CASES))]
    rows = []
    for cand, ts in results:
        score = sum(t / mn for t, mn in zip(ts, mins)) / len(ts)
        rows.append({"score": score, **{c.name: t for c, t in zip(TUNE_CASES, ts)}, "table": json.dumps(cand)})
    common.print_table(rows, ["score", *[c.name for c in TUNE_CASES], "table"])
    best = min(zip(rows, results), key=lambda r: r[0]["score"])[1][0]
    print(f"# best: {json.dumps(best)}")
    common.write_jsonl(args.json, [{"bench": "sgmv_tune", "shapes": args.shapes, **r} for r in rows])
    plan.TABLE = best
    plan.clear_cache()
    auto = tune_auto(args)
    if args.write_tables:
        from lora_kernels.backends import tables_io

        command = tables_io.COMMAND + (f" --tune-keys {args.tune_keys}" if args.tune_keys else "")
        tables_io.write(best, auto, common.device_name(), common.meta()["date"], command=command)
        print(f"# wrote {tables_io.PATH}")


AUTO_CASES = [Case(16, "decode", 1, "distinct", 1), Case(16, "decode", 16, "uniform", 32),
              Case(16, "decode", 64, "uniform", 32), Case(64, "decode", 256, "uniform", 32),
              Case(16, "decode", 64, "identical", 32), Case(64, "decode", 256, "identical", 32),
              Case(16, "prefill", 8, "distinct", 8), Case(64, "prefill", 8, "distinct", 8),
              # a chunked-prefill step ("chunked"): a 1024-row chunk beside 63 decode rows, a sparse work list
              Case(16, "mixed", 64, "uniform", 32), Case(64, "mixed", 64, "uniform", 32)]


def tune_auto(args) -> dict:
    """The `auto` table: each case's infos are classified by auto.regime; per regime, the backend with the
    lowest geometric-mean layer time over its infos wins (Triton where the extension is missing)."""
    from lora_kernels.backends import auto, tables_io

    names = ["triton"] + (["cuda"] if lk.HAS_CUDA_EXT else [])
    logs = {r: {b: [] for b in names} for r in tables_io.REGIMES}
    rows = []
    for case in AUTO_CASES:
        mods, infos = build_case(case)
        for order, info in infos.items():
            reg = auto.regime(info)
            for b in names:
                t = sum(common.GraphTimer(m.fns(f"{b} {order}"), inner=len(m.sets)).time_us(reps=20)
                        for m in mods.values())
                logs[reg][b].append(math.log(t))
                rows.append({"case": case.name, "order": order, "regime": reg, "backend": b, "layer_us": t})
        del mods
        torch.cuda.empty_cache()
    common.print_table(rows, ["case", "order", "regime", "backend", "layer_us"])
    table = {}
    for reg, per in logs.items():
        scored = {b: sum(v) / len(v) for b, v in per.items() if v}
        table[reg] = min(scored, key=scored.get) if scored else "triton"
    print(f"# auto: {json.dumps(table)}")
    common.write_jsonl(args.json, [{"bench": "sgmv_auto", "shapes": args.shapes, **r} for r in rows])
    return table


def main():
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton,cuda,loop,bmm",
                   help="comma list of triton,cuda,loop,bmm; triton-fused / triton-tall: Triton with the one-launch "
                   "decode / the tall-tile path on; cuda-fused: cuda with its opt-in one-launch decode path on")
    p.add_argument("--cases", default="", help="comma list of substrings of case names to run (default: all)")
    p.add_argument("--tune", action="store_true", help="sweep the Triton block table instead of benchmarking")
    p.add_argument("--write-tables", action="store_true", help="with --tune: write lora_kernels/backends/tables.py")
    p.add_argument("--tune-keys", default="", help="with --tune: comma list of table entries to vary (default: all "
                   "of fused, tall, shrink, reduce, expand)")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="8b", help="the modules' model shape (default 8b)")
    args = p.parse_args()
    if args.write_tables and args.shapes != "8b":
        p.error("--write-tables takes --shapes 8b only: the tables are global, measured on the 8B modules")
    MODULES.clear()
    MODULES.update(SHAPES[args.shapes])
    print(f"# shapes: {args.shapes} {MODULES}")
    torch.backends.cuda.matmul.allow_tf32 = False
    (run_tune if args.tune else run_bench)(args)


if __name__ == "__main__":
    main()
