"""Random SGMV problems and an independent float64 per-row ground truth, shared by the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lora_kernels import LoRABatchInfo

POPULARITY = ("distinct", "uniform", "zipf:1.5", "identical", "skewed")
# Relative-error bound ‖out − ref‖ / ‖ref‖ per dtype (tf32 is off in the tests).
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def popularity_slots(dist: str, n: int, num_slots: int, rng: np.random.Generator) -> list[int]:
    """Slots for n requests under an adapter-popularity distribution (DESIGN.md §7)."""
    if dist == "distinct":
        return list(rng.permutation(max(n, num_slots))[:n] % num_slots)
    if dist == "uniform":
        return list(rng.integers(0, num_slots, n))
    if dist.startswith("zipf:"):
        a = float(dist.split(":")[1])
        p = 1.0 / np.arange(1, num_slots + 1) ** a
        return list(rng.choice(num_slots, n, p=p / p.sum()))
    if dist == "identical":
        return [int(rng.integers(num_slots))] * n
    if dist == "skewed":  # one hot adapter takes ~90% of the requests
        hot = int(rng.integers(num_slots))
        return [hot if rng.random() < 0.9 else int(rng.integers(num_slots)) for _ in range(n)]
    raise ValueError(f"unknown popularity {dist!r}")


@dataclass
class Case:
    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    base: torch.Tensor
    info: LoRABatchInfo
    slice_offsets: tuple[int, ...]
    seg_lens: list[int]
    slots: list[int]
    perm: list[int]  # physical row of each segmented row
    ranks: list[int]
    scalings: list[float]

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1

    @property
    def max_rank(self) -> int:
        return self.lora_b.shape[2]


def make_info(seg_lens, slots, perm, lora_ranks, scalings, device, cap_segments=None, max_seg_len=None):
    """A LoRABatchInfo built directly (not by the builder), optionally padded to a capacity."""
    perm_t = None if perm is None else torch.from_numpy(np.ascontiguousarray(perm, dtype=np.int32)).to(device)
    return LoRABatchInfo.from_segments(seg_lens, slots, lora_ranks, scalings, perm_t, cap_segments=cap_segments,
                                       max_seg_len=max_seg_len)


def make_case(rng: np.random.Generator, *, num_slots=6, max_rank=16, ranks=None, slice_widths=(48,), in_dim=64,
              seg_lens=(3, 1, 5), slots=None, dtype=torch.float32, device="cpu", permute=False, extra_rows=0,
              no_lora_frac=0.2) -> Case:
    """A fresh random problem; seg_lens/slots per segment, some segments -1 (no LoRA)."""
    seg_lens = list(seg_lens)
    n_seg = len(seg_lens)
    if ranks is None:
        ranks = [int(r) for r in rng.integers(1, max_rank + 1, num_slots)]
    if slots is None:
        slots = [int(s) for s in rng.integers(0, num_slots, n_seg)]
        slots = [-1 if rng.random() < no_lora_frac else s for s in slots]
    num_slices = len(slice_widths)
    offsets = tuple(int(v) for v in np.concatenate([[0], np.cumsum(slice_widths)]))
    tokens = sum(seg_lens)
    rows = tokens + extra_rows
    perm = [int(p) for p in rng.permutation(rows)[:tokens]] if permute else list(range(tokens))
    g = torch.Generator().manual_seed(int(rng.integers(2**31)))

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)

    x = randn(rows, in_dim)
    lora_a = randn(num_slots, num_slices * max_rank, in_dim, scale=in_dim ** -0.5)
    lora_b = randn(num_slots, offsets[-1], max_rank, scale=max_rank ** -0.5)
    base = randn(rows, offsets[-1])
    scalings = [float(s) for s in rng.uniform(0.25, 2.0, num_slots)]
    lora_ranks = torch.tensor(ranks, dtype=torch.int32, device=device)
    scal = torch.tensor(scalings, dtype=torch.float32, device=device)
    info = make_info(seg_lens, slots, perm if permute else None, lora_ranks, scal, device)
    return Case(x, lora_a, lora_b, base, info, offsets, seg_lens, [int(s) for s in slots], perm, ranks, scalings)


LLAMA_MODULES = {"qkv": (4096, (4096, 1024, 1024)), "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}
LLAMA_BATCHES = {"decode1": [1], "decode64": [1] * 64, "prefill": [300, 1200, 600, 100]}


def llama_case(batch: str, shape: str, rank: int, device="cuda") -> Case:
    """A Llama-3-8B module shape in bf16 in one regime (LLAMA_BATCHES), mixed ranks over 8 slots."""
    in_dim, widths = LLAMA_MODULES[shape]
    rng = np.random.default_rng([rank, len(shape), len(batch)])
    seg_lens = LLAMA_BATCHES[batch]
    slots = [int(s) for s in popularity_slots("uniform", len(seg_lens), 8, rng)]
    return make_case(rng, num_slots=8, max_rank=rank, ranks=[rank, rank // 2, 1, rank, 7, rank, 3, rank],
                     slice_widths=widths, in_dim=in_dim, seg_lens=seg_lens, slots=slots, dtype=torch.bfloat16,
                     device=device, permute=batch == "prefill", no_lora_frac=0.1)


def _segment_rows(case: Case):
    start = 0
    for length, slot in zip(case.seg_lens, case.slots):
        for i in range(start, start + length):
            yield case.perm[i], slot
        start += length


def rowloop_shrink(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 v [rows, S*R] (NaN outside segments) and the mask of covered rows."""
    x = case.x.double().cpu()
    a = case.lora_a.double().cpu()
    R, S = case.max_rank, case.num_slices
    v = torch.full((x.shape[0], S * R), float("nan"), dtype=torch.float64)
    covered = torch.zeros(x.shape[0], dtype=torch.bool)
    for t, slot in _segment_rows(case):
        covered[t] = True
        v[t] = 0
        if slot < 0:
            continue
        for i in range(S):
            for j in range(case.ranks[slot]):
                v[t, i * R + j] = torch.dot(x[t], a[slot, i * R + j])
    return v, covered


def rowloop_expand(case: Case, v: torch.Tensor, out0: torch.Tensor) -> torch.Tensor:
    """float64 out0 + per-row expand of v (v given, e.g. the fp32 one the kernel consumes)."""
    v = v.double().cpu()
    b = case.lora_b.double().cpu()
    out = out0.double().cpu().clone()
    R, offs = case.max_rank, case.slice_offsets
    for t, slot in _segment_rows(case):
        if slot < 0:
            continue
        r = case.ranks[slot]
        for i in range(case.num_slices):
            lo, hi = offs[i], offs[i + 1]
            out[t, lo:hi] += case.scalings[slot] * (b[slot, lo:hi, :r] @ v[t, i * R : i * R + r])
    return out


def poisoned_weights(g, dtype, in_dim, R, widths, ranks, device="cuda"):
    """(lora_a, lora_b, slice offsets) of len(ranks) slots, fresh from g, NaN past each slot's rank (it must never
    reach an output)."""
    offs = tuple(int(v) for v in np.concatenate([[0], np.cumsum(widths)]))
    n = len(ranks)
    a = (torch.randn(n, len(widths) * R, in_dim, generator=g) * in_dim ** -0.5).to(dtype).to(device)
    b = (torch.randn(n, offs[-1], R, generator=g) * R ** -0.5).to(dtype).to(device)
    for s, r in enumerate(ranks):
        b[s, :, r:] = float("nan")
        for i in range(len(widths)):
            a[s, i * R + r:(i + 1) * R] = float("nan")
    return a, b, offs


def reference_apply(x, base, a, b, info, offs):
    """float64 reference.py: shrink then expand, the NaN past the ranks zeroed."""
    from lora_kernels import reference

    args = (info.seg_indptr, info.weight_indices, info.lora_ranks)
    v = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64, device=x.device)
    reference.sgmv_shrink(x.double(), a.double().nan_to_num(0), *args, info.permutation, len(offs) - 1, v)
    out = base.double().clone()
    reference.sgmv_expand(v, b.double().nan_to_num(0), *args, info.scalings, info.permutation, offs, out)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double().cpu()
    ref = ref.double().cpu()
    assert not torch.isnan(out).any(), "output has NaN (unwritten poisoned entries?)"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def batch_rows(rng, n, num_slots, target_slots):
    """n decode requests: slots of the rows under test (target_slots) at random places among random others."""
    slots = [int(s) for s in rng.integers(-1, num_slots, n)]
    where = rng.choice(n, len(target_slots), replace=False)
    for w, s in zip(where, target_slots):
        slots[w] = s
    return slots, where


# Prepended to every compile_for_sm90 script: compile90 builds an SGMV kernel's signature (its pointers, then the
# work-list pointers, then its i32 scalars, then the constexprs of kw) and compiles it for sm90.
SM90_COMPILE = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lora_kernels.backends.triton import plan as _plan

LLAMA_MODULES = [(3, 16, 4096, (4096, 1024, 1024)), (2, 64, 4096, (14336, 14336)), (1, 64, 14336, (4096,))]


def llama_plans(has_perm, expand_split=None, modules=LLAMA_MODULES):
    """(S, R, shrink plan, slice offsets, expand plan) of Llama-3-8B modules (S slices, rank R), bf16; the expand
    sums the shrink's split count of partials unless expand_split says otherwise."""
    cpu = torch.device("cpu")
    for S, R, in_dim, widths in modules:
        sp = _plan.shrink_plan(in_dim, S, R, torch.bfloat16, has_perm, cpu)
        offs = (0,) + tuple(int(sum(widths[:i + 1])) for i in range(len(widths)))
        ep = _plan.expand_plan(offs, R, torch.bfloat16, has_perm, sp.split if expand_split is None else expand_split,
                               cpu)
        yield S, R, sp, offs, ep


def compile90(fn, kw, ptrs, ints, scalings=False, div16=()):
    """triton.compile of fn for sm90: pointers `ptrs` ("name:type"), work, lora_ranks, (scalings), perm_ptr, the
    i32 `ints`, then kw's constexprs (num_warps / num_stages / maxnreg as options; launch_pdl dropped). div16: the ints that
    the runtime would specialize as multiples of 16 (with them, and every pointer 16-byte aligned, the code is what
    a GPU launch at the Llama shapes runs; without, Triton must assume scalar accesses)."""
    kw = dict(kw)
    nw, ns = kw.pop("num_warps"), kw.pop("num_stages")
    kw.pop("launch_pdl", None)
    extra = {"maxnreg": kw.pop("maxnreg")} if "maxnreg" in kw else {}
    sig = {name: "*" + t for name, t in (q.split(":") for q in ptrs)}
    sig.update({"work": "*i32", "lora_ranks": "*i32"})
    if scalings:
        sig["scalings"] = "*fp32"
    sig["perm_ptr"] = "*i32"
    sig.update({k: "i32" for k in ints})
    sig.update({k: "constexpr" for k in kw})
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if div16 and (sig[n].startswith("*") or n in div16)}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=kw, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns, **extra})
'''


def compile_for_sm90(script: str) -> list:
    """Runs `script` (which triton.compile's kernels for sm90, `compile90` at hand, and prints a JSON list last) in a
    subprocess without the interpreter, so that Triton compiles to a cubin (ptxas included) on a GPU-less machine;
    returns the list."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SM90_COMPILE + script], env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def launched_sgmv_kernels(fn) -> list[str]:
    """Names of the extension's kernels (names with "sgmv") that fn launches on the GPU, in launch order
    (torch.profiler; it records nothing under compute-sanitizer, whose tests skip checks built on it)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "sgmv" in e.name]
