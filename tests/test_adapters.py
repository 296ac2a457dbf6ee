"""Adapter memory on the CPU: ModelSpec, host store packing/LRU/threads, pool layout, loader semantics,
and the eviction property (never an acquired or loading slot) over random sequences."""

import random
import threading

import pytest
import torch

from adapter_checks import check_slot
from lora_kernels.adapters import (AdapterLoader, AdapterWeights, GpuAdapterPool, HostAdapterStore, ModelSpec,
                                   batched_h2d_copy, pack_adapter)

SPEC = ModelSpec(layers=2, hidden=24, intermediate=20, num_heads=3, num_kv_heads=1, head_dim=8)


def _adapter(rank, seed, groups=None, dtype=torch.float32):
    return AdapterWeights.random(SPEC, rank, dtype, seed=seed, groups=groups, scaling=0.5 + seed)


# ---- ModelSpec ----------------------------------------------------------------------------------------------

def test_spec_llama3_8b_preset():
    spec = ModelSpec.preset("llama3-8b")
    assert spec.group("qkv_proj").slice_widths == (4096, 1024, 1024)
    assert spec.group("gate_up_proj").slice_offsets == (0, 14336, 28672)
    assert spec.group("down_proj").in_dim == 14336
    assert spec.adapter_numel(16) * 2 == 83_886_080  # the ~84 MB bf16 r=16 adapter of the benchmark
    assert ModelSpec.preset("llama3-8b", layers=2).layers == 2


def test_spec_from_hf_config_dict():
    cfg = {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
           "num_key_value_heads": 2}
    spec = ModelSpec.from_hf_config(cfg)
    assert (spec.head_dim, spec.group("qkv_proj").slice_widths) == (16, (64, 32, 32))


def test_spec_errors():
    with pytest.raises(ValueError, match=r"^ModelSpec.hidden must be a positive int, got 0$"):
        ModelSpec(layers=1, hidden=0, intermediate=8, num_heads=2, num_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=r"^ModelSpec.num_heads=3 is not a multiple of num_kv_heads=2$"):
        ModelSpec(layers=1, hidden=8, intermediate=8, num_heads=3, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=r"^HF config lacks \['hidden_size'\]"):
        ModelSpec.from_hf_config({"num_hidden_layers": 1, "intermediate_size": 2, "num_attention_heads": 1})
    with pytest.raises(KeyError, match="unknown ModelSpec preset 'llama9'"):
        ModelSpec.preset("llama9")


# ---- host store ---------------------------------------------------------------------------------------------

def test_pack_layout_round_trip():
    w = _adapter(4, 1, groups=("qkv_proj", "down_proj"))
    p = pack_adapter("x", w, SPEC, torch.float32, pin=False)
    assert p.rank == 4 and p.header[:4].view(torch.int32).item() == 4
    assert list(p.a) == [(0, "qkv_proj"), (0, "down_proj"), (1, "qkv_proj"), (1, "down_proj")]  # pool order
    for key in p.a:
        assert torch.equal(p.a[key].view(torch.float32).view(w.lora_a[key].shape), w.lora_a[key])
        assert torch.equal(p.b[key].view(torch.float32).view(w.lora_b[key].shape), w.lora_b[key])
        assert p.a[key].data_ptr() % 256 == p.buffer.data_ptr() % 256  # blocks aligned within the buffer
    assert p.payload_bytes == 8 + w.nbytes()


def test_store_lru_by_bytes():
    one = pack_adapter("x", _adapter(4, 0), SPEC, torch.float32, pin=False).nbytes
    store = HostAdapterStore(SPEC, torch.float32, capacity_bytes=2 * one, pin=False)
    for i in range(3):
        store.register(f"a{i}", _adapter(4, i))
        if i == 1:
            store.get("a0")  # a0 becomes most recent: a1 is dropped next
    assert store.is_packed("a0") and not store.is_packed("a1") and store.is_packed("a2")
    assert store.resident_bytes == 2 * one
    with pytest.raises(KeyError, match="adapter 'a1' is not in the host store"):
        store.get("a1")
    with pytest.raises(ValueError, match=f"needs {one} bytes of host memory, above the store's capacity_bytes={one - 1}"):
        HostAdapterStore(SPEC, torch.float32, capacity_bytes=one - 1, pin=False).register("big", _adapter(4, 0))


@pytest.mark.parametrize("exclusive", [True, False])
def test_loaded_adapter_is_the_stores_first_to_drop(exclusive):
    """host_exclusive: an adapter loaded into a slot is demoted in the host store, so that a new adapter pushes
    it out rather than one the GPU does not hold (x); with host_exclusive=False the store stays plain LRU."""
    one = pack_adapter("x", _adapter(4, 0), SPEC, torch.float32, pin=False).nbytes
    store = HostAdapterStore(SPEC, torch.float32, capacity_bytes=2 * one, pin=False)
    pool = GpuAdapterPool(SPEC, num_slots=2, max_rank=4, dtype=torch.float32, device="cpu")
    loader = AdapterLoader(pool, store, host_exclusive=exclusive)
    store.register("x", _adapter(4, 1))
    store.register("a", _adapter(4, 2))  # most recently used
    slot = loader.load_async("a")
    assert store.packed_ids() == (["a", "x"] if exclusive else ["x", "a"])
    store.register("c", _adapter(4, 3))
    assert store.is_packed("x") == exclusive and store.is_packed("a") != exclusive and store.is_packed("c")
    check_slot(pool, slot, _adapter(4, 2))  # the slot holds a's weights either way


def test_store_threaded_registration():
    store = HostAdapterStore(SPEC, torch.float32, pin=False)
    ws = {f"a{i}": _adapter(1 + i % 4, i) for i in range(16)}
    errors = []

    def work(names):
        try:
            for n in names:
                store.register(n, ws[n])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    names = list(ws)
    threads = [threading.Thread(target=work, args=(names[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(store) == 16
    assert store.resident_bytes == sum(store.get(n).nbytes for n in names)
    for n in names:
        p = store.get(n)
        assert torch.equal(p.b[(1, "o_proj")].view(torch.float32).view(-1), ws[n].lora_b[(1, "o_proj")].view(-1))


# ---- pool and loader (CPU) ----------------------------------------------------------------------------------

def test_pool_layout():
    pool = GpuAdapterPool(SPEC, num_slots=3, max_rank=8, dtype=torch.float16, device="cpu")
    a, b, offs = pool.weights(1, "qkv_proj")
    assert a.shape == (3, 24, 24) and b.shape == (3, 40, 8) and offs == (0, 24, 32, 40)
    assert pool.lora_a[0]["down_proj"].shape == (3, 8, 20)
    assert pool.lora_ranks.dtype == torch.int32 and pool.scalings.dtype == torch.float32
    with pytest.raises(ValueError, match="max_rank must be in 1..256, got 300"):
        GpuAdapterPool(SPEC, 2, 300, device="cpu")


@pytest.mark.parametrize("rank", [8, 3])
def test_loader_cpu_exact(rank):
    pool = GpuAdapterPool(SPEC, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    for layer in range(SPEC.layers):  # stale data everywhere: loads must not depend on zeroed slots
        for g in SPEC.groups:
            pool.lora_a[layer][g.name].normal_()
            pool.lora_b[layer][g.name].normal_()
    store = HostAdapterStore(SPEC, torch.float32)
    ws = {"full": _adapter(rank, 1), "qkv": _adapter(rank, 2, groups=("qkv_proj",)),
          "mlp": _adapter(rank, 3, groups=("gate_up_proj", "down_proj"))}
    for n, w in ws.items():
        store.register(n, w)
    loader = AdapterLoader(pool, store)
    for n in ["full", "qkv", "mlp", "full"]:
        slot = loader.load_async(n)
        assert loader.is_ready(n)
        check_slot(pool, slot, ws[n])
    assert loader.stats["loads"] == 4 and loader.stats["evictions"] == 2
    assert loader.stats["bytes"] == sum(store.get(n).payload_bytes for n in ["full", "qkv", "mlp", "full"])


def test_staging_grows_with_the_rank_loaded():
    """Ranks below the pool's go through a staging buffer sized for the rank loaded, replaced by a larger one when a
    higher rank comes; every load stays exact before and after (cached copy plans of the old buffer dropped)."""
    from lora_kernels.adapters.layout import staging_numel

    pool = GpuAdapterPool(SPEC, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    store = HostAdapterStore(SPEC, torch.float32)
    ws = {"r2": _adapter(2, 1), "r5": _adapter(5, 2), "r3": _adapter(3, 3)}
    for n, w in ws.items():
        store.register(n, w)
    loader = AdapterLoader(pool, store)
    sizes = []
    for n in ["r2", "r5", "r3", "r2", "r5"]:
        check_slot(pool, loader.load_async(n), ws[n])
        sizes.append(loader._issuer._staging[0].numel())
    assert sizes == [staging_numel(SPEC, 2)] + [staging_numel(SPEC, 5)] * 4


def test_loader_rank_above_pool_and_unknown():
    pool = GpuAdapterPool(SPEC, 1, 4, torch.float32, "cpu")
    store = HostAdapterStore(SPEC, torch.float32)
    store.register("big", _adapter(6, 0))
    loader = AdapterLoader(pool, store)
    with pytest.raises(ValueError, match=r"^adapter 'big' has rank 6, above the pool's max rank 4$"):
        loader.load_async("big")
    with pytest.raises(KeyError, match="adapter 'nope' is not in the host store"):
        loader.acquire(["nope"])
    assert loader.resident() == [] and loader.stats["loads"] == 0


def test_acquire_release_errors_and_rollback():
    pool = GpuAdapterPool(SPEC, 2, 4, torch.float32, "cpu")
    store = HostAdapterStore(SPEC, torch.float32)
    for i in range(3):
        store.register(f"a{i}", _adapter(4, i))
    loader = AdapterLoader(pool, store)
    assert loader.acquire(["a0", None, "a0"]) == [0, -1, 0]
    # a1 and a2 need two slots but only one is free: nothing stays acquired after the failure.
    with pytest.raises(RuntimeError, match=r"^no slot for adapter 'a2': all 2 slots are acquired or still loading$"):
        loader.acquire(["a1", "a2"])
    assert not loader.in_use(loader.slot_of("a1"))
    loader.release(["a0"])
    with pytest.raises(RuntimeError, match=r"^cannot replace adapter 'a0' by 'a2': it is acquired or still loading$"):
        loader.load_async("a2", victim="a0")
    loader.release(["a0", None])
    with pytest.raises(ValueError, match=r"^release of adapter 'a0', which is not acquired"):
        loader.release(["a0"])
    assert loader.load_async("a2", victim="a0") == 0 and loader.slot_of("a0") is None


def test_unload_frees_the_slot():
    pool = GpuAdapterPool(SPEC, 1, 4, torch.float32, "cpu")
    store = HostAdapterStore(SPEC, torch.float32)
    for i in range(2):
        store.register(f"a{i}", _adapter(4, i))
    loader = AdapterLoader(pool, store)
    loader.acquire(["a0"])
    with pytest.raises(RuntimeError, match=r"^cannot unload adapter 'a0': it is acquired or still loading$"):
        loader.unload("a0")
    loader.release(["a0"])
    loader.unload("a0")
    loader.unload("never-loaded")
    assert loader.resident() == [] and loader.load_async("a1") == 0 and loader.stats["evictions"] == 0
    check_slot(pool, 0, _adapter(4, 1))


def test_batched_h2d_copy_cpu_and_errors():
    srcs = [torch.randn(5), torch.randn(2, 3)]
    dsts = [torch.empty(5), torch.empty(6, dtype=torch.float32)]
    batched_h2d_copy(srcs, dsts)
    assert torch.equal(dsts[0], srcs[0]) and torch.equal(dsts[1], srcs[1].view(-1))
    with pytest.raises(ValueError, match=r"^srcs has 2 tensors but dsts has 1$"):
        batched_h2d_copy(srcs, dsts[:1])
    with pytest.raises(ValueError, match=r"^srcs\[1\] has 24 bytes \(\(2, 3\) torch.float32\) but dsts\[1\] has 20 "
                                         r"\(\(5,\) torch.float32\)$"):
        batched_h2d_copy(srcs, [dsts[0], torch.empty(5)])


class _SlowLoader(AdapterLoader):
    """A CPU loader whose loads stay "in flight" until the test completes them (stands in for events)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.inflight: set[int] = set()

    def _issue(self, slot, packed, progress=None):
        assert slot not in self.inflight
        super()._issue(slot, packed, progress)
        self.inflight.add(slot)

    def is_loading(self, slot):
        return slot in self.inflight


@pytest.mark.parametrize("seed", range(20))
def test_eviction_never_picks_acquired_or_loading(seed):
    rng = random.Random(seed)
    num_slots = rng.randint(1, 4)
    pool = GpuAdapterPool(SPEC, num_slots, 4, torch.float32, "cpu")
    store = HostAdapterStore(SPEC, torch.float32)
    ws = {f"a{i}": _adapter(rng.randint(1, 4), i, groups=rng.choice([None, ("o_proj",)])) for i in range(7)}
    for n, w in ws.items():
        store.register(n, w)
    loader = _SlowLoader(pool, store)
    batches: list[list[str]] = []
    for _ in range(150):
        before = dict(loader._slot_of)
        protected = {s for s in range(num_slots) if loader.in_use(s) or loader.is_loading(s)}
        op = rng.random()
        batch = []
        try:
            if op < 0.35:
                batch = rng.sample(list(ws), rng.randint(1, min(3, num_slots)))
                batch += rng.choices(batch, k=rng.randint(0, 2))  # repeats count separately
                loader.acquire(batch)
                batches.append(batch)
            elif op < 0.6 and batches:
                loader.release(batches.pop(rng.randrange(len(batches))))
            elif op < 0.8:
                loader.load_async(rng.choice(list(ws)))
            elif loader.inflight:
                loader.inflight.discard(rng.choice(sorted(loader.inflight)))
        except RuntimeError as e:
            # A fair refusal: every slot is acquired, loading, or held for the batch being acquired.
            assert "acquired or still loading" in str(e)
            assert len(loader._slot_of) == num_slots
            for aid, s in loader._slot_of.items():
                assert loader.in_use(s) or loader.is_loading(s) or aid in batch, (aid, s)
        after = dict(loader._slot_of)
        for aid, s in before.items():
            if s in protected:
                assert after.get(aid) == s, f"slot {s} of {aid} was evicted while acquired/loading"
        # Every acquired slot still holds its adapter bit for bit.
        for batch in batches:
            for aid in batch:
                check_slot(pool, loader.slot_of(aid), ws[aid])
        assert sum(loader._refs) == sum(len(b) for b in batches)
        assert len(set(after.values())) == len(after) <= num_slots


# ---- host tier: adapters as PEFT folders, a byte-bounded host store, the host-stage worker ----------------------

def _folders(tmp_path, ranks):
    """PEFT folders of random adapters (one per rank) and each one's weights read back, fp32."""
    from lora_kernels.adapters import load_peft_adapter
    from lora_kernels.serve_sim.folders import write_adapter

    paths = []
    for i, r in enumerate(ranks):
        write_adapter(tmp_path / f"f{i}", SPEC, r, torch.float32, seed=10 + i)
        paths.append(tmp_path / f"f{i}")
    return paths, [load_peft_adapter(p, SPEC, dtype=torch.float32) for p in paths]


def test_store_of_folders_evicts_lru_and_rereads(tmp_path, monkeypatch):
    """A store bounded to two adapters over three folders: a cold get reads the folder, the least recently used
    one is dropped, `lookup` never reads, and a dropped adapter's next get reads its folder again."""
    from lora_kernels.adapters import reader

    paths, ws = _folders(tmp_path, [4, 4, 4])
    one = pack_adapter("x", ws[0], SPEC, torch.float32, pin=False).nbytes
    store = HostAdapterStore(SPEC, torch.float32, capacity_bytes=2 * one, pin=False)
    for i, p in enumerate(paths):
        store.register_path(f"a{i}", p)
    reads = []
    orig = reader.read_packed
    monkeypatch.setattr(reader, "read_packed", lambda aid, path, *a, **k: reads.append(path) or orig(aid, path, *a, **k))
    assert store.lookup("a0") is None and reads == []  # lookup never reads
    store.get("a0"), store.get("a1")
    assert store.lookup("a0") is not None  # a0 becomes the most recent: a1 is dropped next
    store.get("a2")
    assert store.packed_ids() == ["a0", "a2"] and store.resident_bytes == 2 * one and len(store) == 3
    p1 = store.get("a1")  # dropped: read again, and a0 (now least recent) goes
    assert reads == [paths[0], paths[1], paths[2], paths[1]] and store.packed_ids() == ["a2", "a1"]
    assert torch.equal(p1.b[(1, "o_proj")].view(torch.float32).view(ws[1].lora_b[(1, "o_proj")].shape),
                       ws[1].lora_b[(1, "o_proj")])


def test_stager_reads_on_its_worker_and_joins_hits(tmp_path):
    import threading

    from lora_kernels.adapters import HostStager

    paths, ws = _folders(tmp_path, [4, 8])
    store = HostAdapterStore(SPEC, torch.float32, pin=False)
    for i, p in enumerate(paths):
        store.register_path(f"a{i}", p)
    gate, seen = threading.Event(), []
    orig_get = store.get

    def slow_get(aid):  # holds the worker until the test has submitted the join
        seen.append(threading.current_thread().name)
        gate.wait(5)
        return orig_get(aid)

    store.get = slow_get
    with HostStager(store) as stager:
        cold = stager.submit("a0")
        join = stager.submit("a0")  # in flight: joins the same read
        assert cold.cold and not join.cold and not cold.done()
        gate.set()
        assert cold.result(5) is join.result(5) and cold.result().rank == 4
        assert seen == [seen[0]] and seen[0].startswith("lora-host-stage") and cold.seconds > 0 == join.seconds
        hit = stager.submit("a0")  # in host memory now: done at once, no read
        assert hit.done() and not hit.cold and hit.seconds == 0 and hit.result() is cold.result()
        with pytest.raises(KeyError, match="adapter 'zz' is not in the host store"):
            stager.submit("zz").result(5)  # the worker's error reaches whoever waits
        assert stager.stats["reads"] == 1 and stager.stats["hits"] == 1 and stager.stats["joins"] == 1


def test_staged_adapter_survives_eviction_and_loads_exactly(tmp_path):
    """Prefetch of a disk-only adapter: its host stage packs it, the store then drops it (LRU), and the
    staged buffer still loads into the slot bit for bit through `load_async(packed=...)`."""
    from lora_kernels.adapters import HostStager

    paths, ws = _folders(tmp_path, [8, 3])
    one = max(pack_adapter("x", w, SPEC, torch.float32, pin=False).nbytes for w in ws)
    store = HostAdapterStore(SPEC, torch.float32, capacity_bytes=one, pin=False)
    for i, p in enumerate(paths):
        store.register_path(f"a{i}", p)
    pool = GpuAdapterPool(SPEC, num_slots=2, max_rank=8, dtype=torch.float32, device="cpu")
    for layer in range(SPEC.layers):  # stale data everywhere
        for g in SPEC.groups:
            pool.lora_a[layer][g.name].normal_()
            pool.lora_b[layer][g.name].normal_()
    loader = AdapterLoader(pool, store)
    with HostStager(store) as stager:
        staged = stager.submit("a1").result(5)
        stager.submit("a0").result(5)  # a budget of one adapter: a1 is dropped from the store
        assert store.packed_ids() == ["a0"] and store.stats["packs"] == 2
        with pytest.raises(ValueError, match="packed adapter 'a1' .* given for adapter 'a0'"):
            loader.load_async("a0", packed=staged)
        slot = loader.load_async("a1", packed=staged)
        check_slot(pool, slot, ws[1])
        assert store.stats["packs"] == 2  # the load read nothing
        check_slot(pool, loader.load_async("a0", packed=stager.submit("a0").result(5)), ws[0])


def test_plan_cache_keys_settled_files_by_stat_and_never_serves_a_stale_plan(tmp_path):
    """A folder untouched for a while is recognized by its files' stat (no read); a rewrite of the same size whose
    mtime is set back still changes the ctime, so the plan is re-read and the change is caught."""
    import os
    import time

    from lora_kernels.adapters import peft as peft_mod
    from lora_kernels.adapters.peft import AdapterFormatError, plan_peft_adapter
    from lora_kernels.serve_sim.folders import write_adapter

    spec = ModelSpec(layers=2, hidden=32, intermediate=40, num_heads=4, num_kv_heads=2, head_dim=8)
    write_adapter(tmp_path / "a", spec, 4, torch.bfloat16, seed=1)
    files = [tmp_path / "a" / "adapter_config.json", tmp_path / "a" / "adapter_model.safetensors"]
    old = time.time() - 60
    for f in files:
        os.utime(f, (old, old))
    time.sleep(peft_mod._SETTLED_S + 0.1)  # the ctime (set by utime) settles too
    first = plan_peft_adapter(tmp_path / "a", spec)
    assert peft_mod._stat_key(*files) is not None
    assert plan_peft_adapter(tmp_path / "a", spec) is first
    if peft_mod._read_heads is None:
        pytest.skip("extension not built: the reads are counted through its read_heads")
    reads = []
    orig = peft_mod._read_heads
    peft_mod._read_heads = lambda *a: reads.append(a) or orig(*a)
    try:
        assert plan_peft_adapter(tmp_path / "a", spec) is first and not reads  # served from the stat key
        raw = files[1].read_bytes()
        files[1].write_bytes(raw.replace(b'"F16"', b'"I16"', 1) if b'"F16"' in raw else raw.replace(b'"BF16"', b'"I16 "', 1))
        os.utime(files[1], (old, old))  # the same size and mtime as before: only the ctime moved
        with pytest.raises(AdapterFormatError, match="adapter_model.safetensors"):
            plan_peft_adapter(tmp_path / "a", spec)
        assert reads  # the bytes were read again
    finally:
        peft_mod._read_heads = orig
