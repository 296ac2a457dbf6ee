"""Tensor-parallel LoRA (adapters/tp.py, docs/tensor_parallel.md): shard rules, the sharded PEFT read,
store, pool and loader, the layout's algebra in one process, and the multi-process checks under torchrun
(gloo on the CPU in CI; NCCL on 2 GPUs)."""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import lora_kernels as lk
import tp_worker
from adapter_checks import check_slot
from lora_kernels.adapters import (AdapterLoader, AdapterWeights, GpuAdapterPool, HostAdapterStore, ModelSpec,
                                   load_peft_adapter, pack_adapter)
from lora_kernels.adapters.tp import (ShardSpec, adapter_bytes, full_spec, group_shards, shard_adapter,
                                      shard_packed, shard_spec, split_spec, tp_of)

LLAMA = ModelSpec.preset("llama3-8b")
TINY = tp_worker.TINY_SPECS["gqa"]
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- shard rules

def test_llama_tp2_shapes_and_bytes():
    s = shard_spec(LLAMA, 1, 2)
    assert isinstance(s, ShardSpec) and full_spec(s) == LLAMA and tp_of(s) == (1, 2)
    g = {x.name: x for x in s.groups}
    assert (g["qkv_proj"].in_dim, g["qkv_proj"].slice_widths) == (4096, (2048, 512, 512))
    assert (g["o_proj"].in_dim, g["o_proj"].slice_widths) == (2048, (4096,))
    assert (g["gate_up_proj"].in_dim, g["gate_up_proj"].slice_widths) == (4096, (7168, 7168))
    assert (g["down_proj"].in_dim, g["down_proj"].slice_widths) == (7168, (4096,))
    assert g["qkv_proj"].slice_offsets == (0, 2048, 2560, 3072)  # each rank's own slice offsets
    ratio = adapter_bytes(s, 16) / adapter_bytes(LLAMA, 16)
    assert 0.66 < ratio <= 0.70, ratio  # half of A and B replicated: 67.5%
    # a rank's spec differs from every other rank's and from the full model's
    assert s != shard_spec(LLAMA, 0, 2) and s != LLAMA and shard_spec(LLAMA, 1, 2) == s
    assert shard_spec(LLAMA, 0, 1) is LLAMA and split_spec(LLAMA) == (LLAMA, None)
    assert split_spec(s) == (LLAMA, s) and split_spec(LLAMA, 1, 2) == (LLAMA, s)
    assert s.with_layers(2) == shard_spec(LLAMA.with_layers(2), 1, 2)


@pytest.mark.parametrize("heads,kv,inter,tp,name", [
    (6, 2, 48, 4, "num_heads=6"), (8, 2, 50, 4, "intermediate=50"), (6, 3, 48, 2, "num_kv_heads=3"),
    (16, 4, 48, 8, None)])
def test_shard_spec_refuses_non_divisible_by_name(heads, kv, inter, tp, name):
    spec = ModelSpec(layers=1, hidden=32, intermediate=inter, num_heads=heads, num_kv_heads=kv, head_dim=8)
    if name is None:  # 4 KV heads over 8 ranks: replicated, each held by 2 ranks
        s = shard_spec(spec, 5, tp)
        assert (s.num_heads, s.num_kv_heads, s.kv_replicas) == (2, 1, 2)
        return
    with pytest.raises(ValueError, match=name):
        shard_spec(spec, 0, tp)


def test_bad_tp_arguments():
    with pytest.raises(ValueError, match="tp_rank=2, tp_size=2"):
        shard_spec(LLAMA, 2, 2)
    with pytest.raises(TypeError, match="tp_size must be an int"):
        shard_spec(LLAMA, 0, 2.0)
    with pytest.raises(ValueError, match="already the shard tp_rank=0, tp_size=2"):
        shard_spec(shard_spec(LLAMA, 0, 2), 1, 2)
    with pytest.raises(TypeError, match="unsharded ModelSpec"):
        ShardSpec(1, 32, 24, 2, 1, 8, tp_rank=0, tp_size=2, full=shard_spec(TINY, 0, 2))


@pytest.mark.parametrize("heads,kv,tp", [(32, 8, 2), (32, 8, 8), (8, 2, 4), (8, 1, 8), (4, 2, 1)])
def test_shards_partition_the_full_tensors(heads, kv, tp):
    """Column-parallel rows and row-parallel columns cover the full dims exactly once over the ranks (KV
    rows exactly kv_replicas times), and every rank's query heads attend to the KV heads it holds."""
    spec = ModelSpec(layers=1, hidden=64, intermediate=96, num_heads=heads, num_kv_heads=kv, head_dim=4)
    hd, reps = spec.head_dim, max(1, tp // kv)
    for g in spec.groups:
        rows = torch.zeros(g.out_total, dtype=torch.int64)
        cols = torch.zeros(g.in_dim, dtype=torch.int64)
        for k in range(tp):
            s = shard_spec(spec, k, tp)
            if tp == 1:
                assert s is spec
                rows += 1
                cols += 1
                continue
            gs = group_shards(s)[g.name]
            mine = s.group(g.name)
            assert sum(hi - lo for lo, hi in gs.rows) == mine.out_total
            assert gs.cols[1] - gs.cols[0] == mine.in_dim
            for lo, hi in gs.rows:
                rows[lo:hi] += 1
            cols[gs.cols[0]:gs.cols[1]] += 1
            if g.name == "qkv_proj":  # GQA: query head h uses KV head h // (heads // kv)
                (q_lo, q_hi), (k_lo, k_hi) = gs.rows[0], gs.rows[1]
                need = {h // (heads // kv) for h in range(q_lo // hd, q_hi // hd)}
                held = set(range((k_lo - heads * hd) // hd, (k_hi - heads * hd) // hd))
                assert need == held, (k, need, held)
        if g.name in ("qkv_proj", "gate_up_proj"):
            assert bool((cols == tp).all())
            q = heads * hd
            assert bool((rows[:q] == 1).all()) and bool((rows[q:] == (reps if g.name == "qkv_proj" else 1)).all())
        else:
            assert bool((rows == tp).all()) and bool((cols == 1).all())


def _merge(shards: list[AdapterWeights], full: ModelSpec) -> AdapterWeights:
    """The inverse of shard_adapter over all ranks (checks that replicated parts agree)."""
    w = AdapterWeights(full, shards[0].rank, shards[0].scaling)
    for key in shards[0].lora_a:
        g = full.group(key[1])
        a = torch.full((g.num_slices * w.rank, g.in_dim), float("nan"), dtype=shards[0].lora_a[key].dtype)
        b = torch.full((g.out_total, w.rank), float("nan"), dtype=a.dtype)
        for sh in shards:
            gs = group_shards(sh.spec)[key[1]]
            a[:, gs.cols[0]:gs.cols[1]] = sh.lora_a[key]
            row = 0
            for lo, hi in gs.rows:
                assert b[lo:hi].isnan().all() or torch.equal(b[lo:hi], sh.lora_b[key][row:row + hi - lo])
                b[lo:hi] = sh.lora_b[key][row:row + hi - lo]
                row += hi - lo
        w.lora_a[key], w.lora_b[key] = a, b
    return w


@pytest.mark.parametrize("label,tp", [("gqa", 2), ("kv_replicated", 2), ("gqa", 4)])
def test_shard_adapter_round_trip(label, tp):
    full = tp_worker.TINY_SPECS[label]
    if tp == 4:
        full = ModelSpec(layers=2, hidden=32, intermediate=48, num_heads=4, num_kv_heads=2, head_dim=8)
    w = AdapterWeights.random(full, 5, torch.float32, seed=tp, groups=("qkv_proj", "o_proj", "down_proj"))
    shards = [shard_adapter(w, shard_spec(full, k, tp)) for k in range(tp)]
    for k, sh in enumerate(shards):
        assert sh.spec == shard_spec(full, k, tp) and sh.rank == 5 and sh.scaling == w.scaling
        assert set(sh.lora_a) == set(w.lora_a)
        for key, a in sh.lora_a.items():
            g = sh.spec.group(key[1])
            assert a.shape == (g.num_slices * 5, g.in_dim) and sh.lora_b[key].shape == (g.out_total, 5)
            assert a.is_contiguous() and sh.lora_b[key].is_contiguous()
    merged = _merge(shards, full)
    for key in w.lora_a:
        assert torch.equal(merged.lora_a[key], w.lora_a[key]) and torch.equal(merged.lora_b[key], w.lora_b[key])
    assert sum(sh.nbytes() for sh in shards) > w.nbytes() > shards[0].nbytes()
    with pytest.raises(ValueError, match="needs the full model"):
        shard_adapter(shards[0], shard_spec(full, 1, tp))


# ------------------------------------------------------------------------------------------------- PEFT, store, pool, loader

@pytest.fixture(scope="module")
def folders():
    root = Path(tempfile.mkdtemp(prefix="test_tp_"))
    out = {}
    for seed, (name, cfg) in enumerate(tp_worker.TINY_ADAPTERS.items()):
        out[name] = root / name
        tp_worker.write_peft(out[name], TINY, *cfg, seed=seed)
    return out


@pytest.mark.parametrize("name", list(tp_worker.TINY_ADAPTERS))
def test_load_peft_shard_equals_shard_of_full(folders, name):
    full = load_peft_adapter(folders[name], TINY)
    for k in range(2):
        s = shard_spec(TINY, k, 2)
        for got in (load_peft_adapter(folders[name], TINY, tp_rank=k, tp_size=2), load_peft_adapter(folders[name], s)):
            want = shard_adapter(full, s)
            assert got.spec == s and got.rank == full.rank and got.scaling == full.scaling
            assert set(got.lora_a) == set(want.lora_a)
            for key in want.lora_a:
                assert torch.equal(got.lora_a[key], want.lora_a[key]) and torch.equal(got.lora_b[key], want.lora_b[key])


def test_load_peft_shard_checks_full_shapes(tmp_path):
    """A folder saved for the per-rank shapes (a mistake) is refused: tensors are checked against the full model."""
    half = shard_spec(TINY, 0, 2)
    plain_half = ModelSpec(layers=2, hidden=half.hidden, intermediate=half.intermediate, num_heads=half.num_heads,
                           num_kv_heads=half.num_kv_heads, head_dim=half.head_dim)
    tp_worker.write_peft(tmp_path / "x", plain_half, 4, 8, tp_worker.ALL, {}, {}, False, seed=1)
    with pytest.raises(ValueError, match="q_proj.lora_B.weight' has shape"):
        load_peft_adapter(tmp_path / "x", TINY, tp_rank=0, tp_size=2)


def test_store_pool_loader_per_rank(folders):
    sizes = {}
    for tp in (1, 2):
        for k in range(tp):
            store = HostAdapterStore(TINY, torch.float32, pin=False, tp_rank=k, tp_size=tp)
            pool = GpuAdapterPool(TINY, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu", tp_rank=k,
                                  tp_size=tp)
            assert store.spec == pool.spec == shard_spec(TINY, k, tp)
            loader = AdapterLoader(pool, store)
            for name, f in folders.items():
                store.register_path(name, f)
            slot = loader.load_async("a1")
            check_slot(pool, slot, load_peft_adapter(folders["a1"], TINY, tp_rank=k, tp_size=tp))
            sizes[(k, tp)] = (store.get("a1").payload_bytes, pool.slot_bytes(), loader.stats["bytes"])
    for k in range(2):
        for i in range(3):  # host bytes, device slot bytes, H2D bytes: all shrink
            assert sizes[(k, 2)][i] < sizes[(0, 1)][i]
    mixed_store = HostAdapterStore(TINY, torch.float32, pin=False, tp_rank=0, tp_size=2)
    other_pool = GpuAdapterPool(TINY, 2, 8, torch.float32, "cpu", tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match="tp_rank, tp_size"):
        AdapterLoader(other_pool, mixed_store)


def _write_fused(folder: Path, spec: ModelSpec, r: int = 4) -> None:
    """A PEFT folder with fused qkv_proj and gate_up_proj modules (as Phi-3 names them) plus o_proj, bf16."""
    from safetensors.torch import save_file

    gen, tensors = torch.Generator().manual_seed(9), {}
    for layer in range(spec.layers):
        for name, parent, g in (("qkv_proj", "self_attn", spec.group("qkv_proj")), ("o_proj", "self_attn",
                                spec.group("o_proj")), ("gate_up_proj", "mlp", spec.group("gate_up_proj"))):
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, g.in_dim, generator=gen).bfloat16()
            tensors[f"{key}.lora_B.weight"] = torch.randn(g.out_total, r, generator=gen).bfloat16()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj"]}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_reads_each_rank_exactly_its_shard(tmp_path, dtype):
    """The host store's read of a folder (file dtype or cast; rank/alpha patterns; missing slices and groups;
    fused modules) packs, block for block, what packing the shard of the full read gives."""
    for label, spec in tp_worker.TINY_SPECS.items():
        paths = {"fused": tmp_path / label / "fused"}
        _write_fused(paths["fused"], spec)
        for seed, (name, cfg) in enumerate(tp_worker.TINY_ADAPTERS.items()):
            paths[name] = tmp_path / label / name
            tp_worker.write_peft(paths[name], spec, *cfg, seed=seed)
        for k in range(2):
            s = shard_spec(spec, k, 2)
            store = HostAdapterStore(spec, dtype, pin=False, tp_rank=k, tp_size=2)
            for name, path in paths.items():
                store.register_path(name, path)
                got = store.get(name)
                want = pack_adapter(name, shard_adapter(load_peft_adapter(path, spec, dtype=dtype), s), s, dtype,
                                    pin=False)
                assert got.layout == want.layout and torch.equal(got.header, want.header), name
                for key in want.layout:
                    assert torch.equal(got.a[key], want.a[key]) and torch.equal(got.b[key], want.b[key]), (name, key)


def test_shard_packed_equals_packing_the_shard(folders):
    full = load_peft_adapter(folders["a2"], TINY)  # q, v only: a missing slice and missing groups
    packed = pack_adapter("a2", full, TINY, torch.float32, pin=False)
    for k in range(2):
        s = shard_spec(TINY, k, 2)
        got = shard_packed(packed, s)
        want = pack_adapter("a2", shard_adapter(full, s), s, torch.float32, pin=False)
        assert got.layout == want.layout and got.nbytes == want.nbytes < packed.nbytes  # (padding bytes are unset)
        assert torch.equal(got.header, want.header) and (got.rank, got.scaling) == (want.rank, want.scaling)
        for key in want.layout:
            assert torch.equal(got.a[key], want.a[key]) and torch.equal(got.b[key], want.b[key]), key


# ------------------------------------------------------------------------------------------------- the layout's algebra

@pytest.mark.parametrize("label", list(tp_worker.TINY_SPECS))
def test_layout_sum_of_rank_parts_is_the_full_lora(label):
    """One process, fp32, torch backend: column-parallel shards are the full output's columns and
    row-parallel partial outputs sum to the full output (what the base layer's all-reduce does)."""
    full = tp_worker.TINY_SPECS[label]
    ws = [AdapterWeights.random(full, r, torch.float32, seed=r, std=0.3) for r in (3, 6)]
    counts, slots = [2, 3, 1, 2], [0, -1, 1, 0]
    T = sum(counts)

    def run(spec, k, tp, x, base):
        pool = GpuAdapterPool(spec, 2, 6, torch.float32, "cpu", tp_rank=k, tp_size=tp)
        for slot, w in enumerate(ws):
            _write_slot(pool, slot, shard_adapter(w, pool.spec))
        info = lk.BatchInfoBuilder(T, len(counts), pool.lora_ranks, pool.scalings).build(counts, slots)
        out = {}
        for key, xx in x.items():
            a, b, offs = pool.weights(*key)
            out[key] = lk.apply_lora(xx, base[key].clone(), a, b, info, offs, backend="torch")
        return out

    gen = torch.Generator().manual_seed(5)
    x = {(0, g.name): torch.randn(T, g.in_dim, generator=gen) for g in full.groups}
    base = {(0, g.name): torch.randn(T, g.out_total, generator=gen) for g in full.groups}
    want = run(full, 0, 1, x, base)
    parts = []
    for k in range(2):
        gs = group_shards(shard_spec(full, k, 2))
        xk = {key: gs[key[1]].take_cols(v) for key, v in x.items()}
        bk = {key: (v / 2 if gs[key[1]].parallel == "row" else gs[key[1]].take_outputs(v)) for key, v in base.items()}
        parts.append(run(full, k, 2, xk, bk))
    for key in want:
        if key[1] in ("o_proj", "down_proj"):
            got = parts[0][key] + parts[1][key]
        else:
            got = tp_worker.place_columns([p[key] for p in parts], full, key[1])
        assert tp_worker.rel(got, want[key]) <= 1e-6, key
        assert tp_worker.rel(want[key], base[key]) > 1e-2  # the adapters do change the outputs


def _write_slot(pool, slot, w):
    R, r = pool.max_rank, w.rank
    pool.lora_ranks[slot], pool.scalings[slot] = r, w.scaling
    for (layer, gname), a in w.lora_a.items():
        g = pool.spec.group(gname)
        for i in range(g.num_slices):
            pool.lora_a[layer][gname][slot, i * R:i * R + r] = a[i * r:(i + 1) * r]
        pool.lora_b[layer][gname][slot, :, :r] = w.lora_b[(layer, gname)]


# ------------------------------------------------------------------------------------------------- multi-process

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], out: Path, timeout: int, nproc: int = 2) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
           "--master-addr=127.0.0.1", f"--master-port={_free_port()}", str(REPO / "tests" / "tp_worker.py"),
           *args, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun timed out after {timeout}s: {(e.stdout or b'')[-3000:]!r} {(e.stderr or b'')[-3000:]!r}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


def test_torchrun_gloo_tiny_model_equals_single_process(tmp_path):
    """2 processes, gloo, torch backend: the sharded 2-layer model's all-reduced outputs equal the
    single-process run (fp32 rel <= 1e-6) and float64 (rel <= 1e-5); per-rank packed bytes shrink."""
    res = _torchrun(["--case", "tiny", "--dir", str(tmp_path / "folders")], tmp_path / "r.json", timeout=240)
    assert res["world"] == 2 and len(res["ranks"]) == 2
    for per_rank in res["ranks"]:
        assert set(per_rank) == set(tp_worker.TINY_SPECS)
        for r in per_rank.values():
            assert r["tp_vs_single"] <= 1e-6 and r["tp_vs_fp64"] <= 1e-5 and r["lora_effect"] > 1e-2
            assert all(v < 0.95 for v in r["bytes_ratio"].values())


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_torchrun_nccl_llama_tp2_equals_tp1(tmp_path):
    """2 GPUs, NCCL, bf16, CUDA graphs: Llama-3-8B-shaped LoRA outputs at TP=2 (gathered / all-reduced)
    equal TP=1 and float64 (bf16 rel <= 1e-2) for a decode and a prefill batch."""
    res = _torchrun(["--case", "llama", "--dir", str(tmp_path / "folders")], tmp_path / "r.json", timeout=600)
    for per_rank in res["ranks"]:
        for family in ("decode", "prefill"):
            assert len(per_rank[family]) == 8
            for e in per_rank[family].values():
                assert max(e.values()) <= 1e-2


@pytest.mark.gpu
def test_llama_tp2_emulated_on_one_gpu(tmp_path):
    """Both ranks' shards in one process on one GPU (bf16, CUDA graphs), combined as the collectives would."""
    res = tp_worker.emulate_llama(tmp_path, 2, "cuda")
    for family in ("decode", "prefill"):
        assert len(res[family]) == 8 and all(max(e.values()) <= 1e-2 for e in res[family].values())
