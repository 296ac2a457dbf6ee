"""Tensor-parallel LoRA check, one process per rank (launch with torchrun; docs/tensor_parallel.md).

    torchrun --nproc-per-node 2 tests/tp_worker.py --case tiny  --out r.json   # gloo, CPU, torch backend
    torchrun --nproc-per-node 2 tests/tp_worker.py --case llama --out r.json   # NCCL, 2 GPUs, bf16, CUDA graphs

tiny: a 2-layer decoder (GQA attention + SwiGLU MLP, LoRA on q,k,v,o,gate,up,down) for two head layouts
(KV heads sharded; KV heads fewer than ranks, replicated). Rank 0 writes three PEFT folders (ranks,
rank_pattern/alpha_pattern, rsLoRA, a missing slice and missing groups); every rank reads its shard
through HostAdapterStore(tp_rank, tp_size) -> GpuAdapterPool(tp_rank, tp_size) -> AdapterLoader, runs
a mixed batch (rows without LoRA too) with the base layers sharded Megatron-style, and all-reduces the
row-parallel outputs. Its final hidden states must equal the same model run unsharded in one process
(fp32, rel <= 1e-6) and a float64 reference computed straight from the PEFT tensors (rel <= 1e-5).

llama: Llama-3-8B shapes (2 layers), bf16, every LoRA group of each layer captured in one CUDA graph
per batch family (decode 64x1, prefill), at TP=1 and at TP=2; the TP=2 outputs, gathered
(column-parallel) or all-reduced (row-parallel), must equal TP=1 (bf16 rel <= 1e-2) and a float64 reference.

Rank 0 writes the measured errors to --out (JSON); any failed check raises (non-zero exit).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lora_kernels as lk  # noqa: E402
from lora_kernels.adapters import AdapterLoader, GpuAdapterPool, HostAdapterStore, ModelSpec  # noqa: E402
from lora_kernels.adapters.tp import ROW_PARALLEL, group_shards, shard_spec  # noqa: E402

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ALL = tuple(PARENT)
TINY_SPECS = {"gqa": ModelSpec(layers=2, hidden=32, intermediate=48, num_heads=4, num_kv_heads=2, head_dim=8),
              "kv_replicated": ModelSpec(layers=2, hidden=32, intermediate=48, num_heads=4, num_kv_heads=1,
                                         head_dim=8)}
# (rank, alpha, target modules, rank_pattern, alpha_pattern, use_rslora)
TINY_ADAPTERS = {"a0": (4, 8, ALL, {}, {}, False),
                 "a1": (8, 16, ALL, {"o_proj": 2, "down_proj": 6}, {"gate_proj": 4}, True),
                 "a2": (8, 8, ("q_proj", "v_proj"), {}, {}, False)}
TINY_BATCH = ([3, 2, 4, 1, 2], ["a0", None, "a1", "a2", "a0"])  # tokens and adapter per request


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error in the Frobenius norm, in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


# ---------------------------------------------------------------------------------------------- PEFT folders

def module_dims(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_dim, out_dim) in the full model."""
    out = {}
    for g in spec.groups:
        for name, width in zip(g.members, g.slice_widths):
            out[name] = (g.in_dim, width)
    return out


def write_peft(folder: Path, spec: ModelSpec, r: int, alpha: float, targets, rank_pattern, alpha_pattern,
               rslora: bool, seed: int, device: str = "cpu") -> None:
    """A PEFT LoRA folder with random non-zero A and B (fp32) for `targets` of every layer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)
    dims, tensors = module_dims(spec), {}
    for layer in range(spec.layers):
        for m in targets:
            rm = rank_pattern.get(m, r)
            key = f"base_model.model.model.layers.{layer}.{PARENT[m]}.{m}"
            in_dim, out_dim = dims[m]
            a = torch.randn(rm, in_dim, generator=gen, device=device) * in_dim ** -0.5
            b = torch.randn(out_dim, rm, generator=gen, device=device) * (0.2 * rm ** -0.5)
            tensors[f"{key}.lora_A.weight"] = a.cpu().contiguous()
            tensors[f"{key}.lora_B.weight"] = b.cpu().contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
           "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "use_rslora": rslora, "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))


def read_peft64(folder: Path, spec: ModelSpec, device="cpu") -> dict[tuple[int, str], tuple]:
    """(layer, module) -> (A, B, scaling) in float64, straight from the files (independent of lora_kernels)."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    out = {}
    for layer in range(spec.layers):
        for m in cfg["target_modules"]:
            key = f"base_model.model.model.layers.{layer}.{PARENT[m]}.{m}"
            rm, am = cfg["rank_pattern"].get(m, cfg["r"]), cfg["alpha_pattern"].get(m, cfg["lora_alpha"])
            s = am / math.sqrt(rm) if cfg["use_rslora"] else am / rm
            out[(layer, m)] = (tensors[f"{key}.lora_A.weight"].to(device, torch.float64),
                               tensors[f"{key}.lora_B.weight"].to(device, torch.float64), s)
    return out


# ---------------------------------------------------------------------------------------------- the model

def base_weights(spec: ModelSpec, seed: int, device="cpu") -> dict[tuple[int, str], torch.Tensor]:
    """Full fp32 base weights [out_total, in_dim] of every module group, the same on every rank."""
    gen = torch.Generator(device).manual_seed(seed)
    return {(layer, g.name): torch.randn(g.out_total, g.in_dim, generator=gen, device=device) * g.in_dim ** -0.5
            for layer in range(spec.layers) for g in spec.groups}


def shard_base(weights: dict, shard: ModelSpec) -> dict:
    """This rank's blocks of the base weights (column-parallel rows, row-parallel columns)."""
    if shard.__class__ is ModelSpec:
        return weights
    gs = group_shards(shard)
    return {key: gs[key[1]].take_weight(w) for key, w in weights.items()}


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def attention(qkv, spec: ModelSpec, counts) -> torch.Tensor:
    """Causal GQA attention within each request's rows, for the (local) heads of `spec`."""
    H, KV, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=1)
    out, start = [], 0
    for n in counts:
        qs = q[start:start + n].reshape(n, H, hd).transpose(0, 1)
        ks = k[start:start + n].reshape(n, KV, hd).transpose(0, 1).repeat_interleave(H // KV, 0)
        vs = v[start:start + n].reshape(n, KV, hd).transpose(0, 1).repeat_interleave(H // KV, 0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1).reshape(n, H * hd))
        start += n
    return torch.cat(out).contiguous()


def model_forward(x, spec: ModelSpec, linear, reduce, counts) -> torch.Tensor:
    """Pre-norm decoder layers; `linear(layer, group, h)` is a (sharded) linear with LoRA, `reduce` the
    row-parallel all-reduce (identity unsharded)."""
    for layer in range(spec.layers):
        att = attention(linear(layer, "qkv_proj", _rms(x)), spec, counts)
        x = x + reduce(linear(layer, "o_proj", att))
        g, u = linear(layer, "gate_up_proj", _rms(x)).chunk(2, dim=1)
        x = x + reduce(linear(layer, "down_proj", (F.silu(g) * u).contiguous()))
    return x


def pool_linear(weights, pool, info, backend):
    def linear(layer, group, h):
        out = h @ weights[(layer, group)].T
        a, b, offs = pool.weights(layer, group)
        lk.apply_lora(h, out, a, b, info, offs, backend=backend)
        return out
    return linear


def lora_delta64(spec: ModelSpec, adapters64: dict, counts, names, layer: int, group: str, h) -> torch.Tensor:
    """Every request's PEFT modules applied directly (A, B, per-module scaling) to its rows of h."""
    g = spec.group(group)
    out = torch.zeros(h.shape[0], g.out_total, dtype=h.dtype, device=h.device)
    offs, start = g.slice_offsets, 0
    for n, name in zip(counts, names):
        rows = slice(start, start + n)
        start += n
        for i, m in enumerate(g.members):
            mod = adapters64.get(name, {}).get((layer, m))
            if mod is not None:
                a, b, s = mod
                out[rows, offs[i]:offs[i + 1]] += s * (h[rows] @ a.T) @ b.T
    return out


def reference_linear(weights64, spec: ModelSpec, adapters64: dict, counts, names):
    """float64 base + the PEFT modules of every request."""
    def linear(layer, group, h):
        return h @ weights64[(layer, group)].T + lora_delta64(spec, adapters64, counts, names, layer, group, h)
    return linear


# ---------------------------------------------------------------------------------------------- tiny (gloo)

def run_tiny_model(spec, folders, tp_rank, tp_size, x, counts, names, reduce, backend="torch"):
    """Final hidden states of the model sharded at (tp_rank, tp_size), adapters read from the PEFT folders
    through the store -> pool -> loader path; also this rank's packed bytes per adapter."""
    store = HostAdapterStore(spec, torch.float32, pin=False, tp_rank=tp_rank, tp_size=tp_size)
    pool = GpuAdapterPool(spec, num_slots=4, max_rank=8, dtype=torch.float32, device="cpu",
                          tp_rank=tp_rank, tp_size=tp_size)
    loader = AdapterLoader(pool, store)
    for name, folder in folders.items():
        store.register_path(name, folder)
    slots = loader.acquire(names)
    builder = lk.BatchInfoBuilder(sum(counts), len(counts), pool.lora_ranks, pool.scalings)
    info = builder.build(counts, slots)
    weights = shard_base(base_weights(spec, seed=7), pool.spec)
    out = model_forward(x, pool.spec, pool_linear(weights, pool, info, backend), reduce, counts)
    loader.release(names)
    return out, {n: store.get(n).payload_bytes for n in folders}


def check_tiny(root: Path, rank: int, world: int) -> dict:
    counts, names = TINY_BATCH
    results = {}
    for label, spec in TINY_SPECS.items():
        folders = {n: root / label / n for n in TINY_ADAPTERS}
        if rank == 0:
            for seed, (n, cfg) in enumerate(TINY_ADAPTERS.items()):
                write_peft(folders[n], spec, *cfg, seed=100 + seed)
        dist.barrier()
        x = torch.randn(sum(counts), spec.hidden, generator=torch.Generator().manual_seed(3))

        def all_reduce(t):
            dist.all_reduce(t)
            return t

        got, shard_bytes = run_tiny_model(spec, folders, rank, world, x, counts, names, all_reduce)
        single, full_bytes = run_tiny_model(spec, folders, 0, 1, x, counts, names, lambda t: t)
        adapters64 = {n: read_peft64(f, spec) for n, f in folders.items()}
        w64 = {k: v.double() for k, v in base_weights(spec, seed=7).items()}
        ref = model_forward(x.double(), spec, reference_linear(w64, spec, adapters64, counts, names), lambda t: t,
                            counts)
        base = model_forward(x.double(), spec, reference_linear(w64, spec, {}, counts, names), lambda t: t, counts)
        r = {"tp_vs_single": rel(got, single), "tp_vs_fp64": rel(got, ref), "single_vs_fp64": rel(single, ref),
             "lora_effect": rel(base, ref),
             "bytes_ratio": {n: shard_bytes[n] / full_bytes[n] for n in folders}}
        assert r["tp_vs_single"] <= 1e-6, (label, rank, r)
        assert r["tp_vs_fp64"] <= 1e-5 and r["single_vs_fp64"] <= 1e-5, (label, rank, r)
        assert r["lora_effect"] > 1e-2, (label, r)  # the adapters change the output: the check can fail
        assert all(v < 1.0 for v in r["bytes_ratio"].values()) or world == 1, (label, r)
        results[label] = r
    return results


# ---------------------------------------------------------------------------------------------- llama (NCCL)

LLAMA_ADAPTERS = {"b0": (16, 32, ALL, {}, {}, False), "b1": (8, 16, ALL, {}, {}, False),
                  "b2": (16, 16, ("q_proj", "v_proj", "down_proj"), {}, {}, True)}


def llama_batches(family: str) -> list[tuple[list[int], list]]:
    """Two batches of one CUDA-graph family: the graph is captured on the first and checked on the second."""
    if family == "decode":
        cycle = ["b0", "b1", None, "b2", "b0", "b2", "b1"]
        return [([1] * 64, [cycle[i % 7] for i in range(64)]), ([1] * 64, [cycle[(3 * i + 1) % 7] for i in range(64)])]
    return [([512, 256, 200, 56], ["b0", "b1", "b2", None]), ([300, 100, 424, 200], ["b2", None, "b0", "b1"])]


class GraphedLoRA:
    """Every LoRA group of every layer for one pool, on static buffers, captured in one CUDA graph."""

    def __init__(self, pool, loader, xs: dict, bases: dict, batches):
        self.pool, self.loader, self.batches = pool, loader, batches
        self.cuda = pool.device.type == "cuda"  # a CPU pool (smoke run of this logic) runs eagerly
        T, S = sum(batches[0][0]), len(batches[0][0])
        self.builder = lk.BatchInfoBuilder(T, S, pool.lora_ranks, pool.scalings, cuda_graph=self.cuda)
        self.xs, self.bases = xs, bases
        self.outs = {k: torch.empty_like(b) for k, b in bases.items()}
        info = self._info(batches[0])
        if not self.cuda:
            return
        torch.cuda.synchronize()  # the first loads are done before anything is captured
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and warm up outside the capture
            self._step(info)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step(info)

    def _info(self, batch):
        counts, names = batch
        slots = self.loader.acquire(names)
        self.loader.release(names)  # the slots stay resident: 4 slots, 3 adapters
        return self.builder.build(counts, slots)

    def _step(self, info):
        for (layer, group), out in self.outs.items():
            out.copy_(self.bases[(layer, group)])
            a, b, offs = self.pool.weights(layer, group)
            lk.apply_lora(self.xs[(layer, group)], out, a, b, info, offs)

    def replay(self, batch) -> dict:
        info = self._info(batch)  # in graph mode: refills the builder's static buffers in place
        for out in self.outs.values():
            out.fill_(float("nan"))
        if self.cuda:
            self.graph.replay()
            torch.cuda.synchronize()
        else:
            self._step(info)
        return {k: v.clone() for k, v in self.outs.items()}


def llama_loaders(spec, folders, tp_rank, tp_size, device):
    store = HostAdapterStore(spec, torch.bfloat16, tp_rank=tp_rank, tp_size=tp_size)
    pool = GpuAdapterPool(spec, num_slots=4, max_rank=16, dtype=torch.bfloat16, device=device,
                          tp_rank=tp_rank, tp_size=tp_size)
    for name, folder in folders.items():
        store.register_path(name, folder)
    return pool, AdapterLoader(pool, store)


def llama_reference(spec, folders, xs, bases, batch, device) -> dict:
    """float64 outputs from the PEFT tensors (A and B rounded to bf16 as the pool holds them)."""
    counts, names = batch
    adapters = {n: {k: (a.bfloat16().double(), b.bfloat16().double(), s)
                    for k, (a, b, s) in read_peft64(f, spec, device).items()} for n, f in folders.items()}
    return {(layer, group): bases[(layer, group)].double()
            + lora_delta64(spec, adapters, counts, names, layer, group, x.double()) for (layer, group), x in xs.items()}


def place_columns(parts: list[torch.Tensor], spec, group: str) -> torch.Tensor:
    """The full [T, out_total] output from every rank's column shard, placed by the shard rules."""
    world = len(parts)
    full = torch.empty(parts[0].shape[0], spec.group(group).out_total, dtype=parts[0].dtype, device=parts[0].device)
    for k, part in enumerate(parts):
        col = 0
        for lo, hi in group_shards(shard_spec(spec, k, world))[group].rows:
            full[:, lo:hi] = part[:, col:col + hi - lo]
            col += hi - lo
    return full


def llama_inputs(spec, family: str, device: str):
    """(batches, x per (layer, group), base output per (layer, group)): full-size, the same on every rank."""
    batches = llama_batches(family)
    T = sum(batches[0][0])
    gen = torch.Generator(device).manual_seed(11)
    xs, bases = {}, {}
    for layer in range(spec.layers):
        for g in spec.groups:
            xs[(layer, g.name)] = torch.randn(T, g.in_dim, generator=gen, device=device).bfloat16()
            bases[(layer, g.name)] = (torch.randn(T, g.out_total, generator=gen, device=device) * 0.05).bfloat16()
    return batches, xs, bases


def llama_rank_outputs(spec, folders, rank: int, world: int, device: str, batches, xs, bases) -> dict:
    """One rank's outputs (its output columns, or its row-parallel partial sums) for batches[1], graph replay."""
    gs = group_shards(shard_spec(spec, rank, world)) if world > 1 else None
    xs2, bases2 = {}, {}
    for key, x in xs.items():
        row = key[1] in ROW_PARALLEL
        xs2[key] = gs[key[1]].take_cols(x) if row and gs else x
        # row-parallel: each rank adds its LoRA part to 1/world of the base output (exact in bf16 at TP=2),
        # the all-reduce then sums base and LoRA parts, as a serving engine's o/down projections do
        bases2[key] = bases[key] / world if row else gs[key[1]].take_outputs(bases[key]) if gs else bases[key]
    pool, loader = llama_loaders(spec, folders, rank, world, device)
    return GraphedLoRA(pool, loader, xs2, bases2, batches).replay(batches[1])


def llama_errors(full: dict, tp1: dict, ref: dict, bases: dict, family: str) -> dict:
    """Errors of the combined TP outputs against TP=1 and of both LoRA deltas against float64; checked."""
    errs = {}
    for key, out in full.items():
        delta_ref = ref[key] - bases[key].double()
        e = {"tp_vs_tp1": rel(out, tp1[key]), "tp_vs_fp64": rel(out.double() - bases[key].double(), delta_ref),
             "tp1_vs_fp64": rel(tp1[key].double() - bases[key].double(), delta_ref)}
        assert torch.isfinite(out).all(), (family, key)
        assert max(e.values()) <= 1e-2, (family, key, e)
        errs[f"{key[0]}.{key[1]}"] = e
    return errs


def llama_setup(root: Path, device: str, write: bool):
    spec = ModelSpec.preset("llama3-8b", layers=2)
    folders = {n: root / "llama" / n for n in LLAMA_ADAPTERS}
    if write:
        for seed, (n, cfg) in enumerate(LLAMA_ADAPTERS.items()):
            write_peft(folders[n], spec, *cfg, seed=200 + seed, device=device)
    return spec, folders


def check_llama(root: Path, rank: int, world: int, device: str = "cuda") -> dict:
    """Each rank computes its shard; column outputs are all-gathered and row-parallel ones all-reduced."""
    spec, folders = llama_setup(root, device, write=rank == 0)
    dist.barrier()
    results = {}
    for family in ("decode", "prefill"):
        batches, xs, bases = llama_inputs(spec, family, device)
        tp1 = llama_rank_outputs(spec, folders, 0, 1, device, batches, xs, bases)
        mine = llama_rank_outputs(spec, folders, rank, world, device, batches, xs, bases)
        full = {}
        for key, out in mine.items():
            if key[1] in ROW_PARALLEL:
                dist.all_reduce(out)
                full[key] = out
            else:
                parts = [torch.empty_like(out) for _ in range(world)]
                dist.all_gather(parts, out)
                full[key] = place_columns(parts, spec, key[1])
        ref = llama_reference(spec, folders, xs, bases, batches[1], device)
        results[family] = llama_errors(full, tp1, ref, bases, family)
    return results


def emulate_llama(root: Path, world: int, device: str = "cuda") -> dict:
    """`check_llama` for every rank in this one process, on one device (no collectives: the partial sums
    are added in fp32 and rounded once, as NCCL's bf16 all-reduce of two ranks does)."""
    spec, folders = llama_setup(root, device, write=True)
    results = {}
    for family in ("decode", "prefill"):
        batches, xs, bases = llama_inputs(spec, family, device)
        tp1 = llama_rank_outputs(spec, folders, 0, 1, device, batches, xs, bases)
        ranks = [llama_rank_outputs(spec, folders, k, world, device, batches, xs, bases) for k in range(world)]
        full = {}
        for key in tp1:
            parts = [r[key] for r in ranks]
            full[key] = (torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)
                         if key[1] in ROW_PARALLEL else place_columns(parts, spec, key[1]))
        ref = llama_reference(spec, folders, xs, bases, batches[1], device)
        results[family] = llama_errors(full, tp1, ref, bases, family)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--case", choices=("tiny", "llama"), default="tiny")
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes the errors here (JSON)")
    p.add_argument("--dir", type=Path, default=None, help="where rank 0 writes the PEFT folders (shared)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="llama case only: cpu runs its logic with gloo, eager, torch backend (a smoke run)")
    args = p.parse_args()
    cuda = args.case == "llama" and args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = [str(args.dir or tempfile.mkdtemp(prefix="tp_worker_"))]
    dist.broadcast_object_list(root, src=0)  # ranks share one filesystem (one host)
    if args.case == "llama":
        results = check_llama(Path(root[0]), rank, world, args.device)
    else:
        results = check_tiny(Path(root[0]), rank, world)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        text = json.dumps({"world": world, "case": args.case, "ranks": gathered}, indent=1)
        print(text)
        if args.out:
            args.out.write_text(text)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
