"""Faults on the adapter path, on the CPU (GPU variants in test_loader_gpu.py): adapter folders going bad
after admission, a host budget below one adapter, errors on the host-stage worker, and evicting an adapter
that a batch still uses. Each request that can complete does, and nothing leaks (slots, buffers, stages)."""

import gc
import json
import re
import weakref

import pytest
import torch

import lora_kernels as lk
from adapter_checks import check_slot
from lora_kernels.adapters import (AdapterFormatError, AdapterLoader, GpuAdapterPool, HostAdapterStore, HostStager,
                                   ModelSpec, load_peft_adapter)
from lora_kernels.adapters import layout as lay
from lora_kernels.adapters import reader
from lora_kernels.serve_sim.folders import write_adapter

SPEC = ModelSpec(layers=2, hidden=24, intermediate=20, num_heads=3, num_kv_heads=1, head_dim=8)
WEIGHTS = "adapter_model.safetensors"


def _delete(folder):
    (folder / WEIGHTS).unlink()
    return f"{folder / WEIGHTS}: not found"


def _truncate(folder):
    path = folder / WEIGHTS
    path.write_bytes(path.read_bytes()[:-100])
    return f"{path}: tensor '.*' needs bytes \\[\\d+, \\d+\\) of the data but the file holds \\d+: file truncated"


def _inconsistent_rank(folder):
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg.update(r=16, lora_alpha=32)  # the tensors are rank 8
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return (f"{folder / WEIGHTS}: tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' has shape "
            r"\(8, 24\) but the model spec and rank 16 need \(16, 24\)")


def _wrong_shape(folder):
    from safetensors.torch import load_file, save_file

    t = load_file(str(folder / WEIGHTS))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    t[key] = torch.ones(23, 8)
    save_file(t, str(folder / WEIGHTS))
    return f"{folder / WEIGHTS}: tensor '{key}' has shape \\(23, 8\\) but the model spec and rank 8 need \\(24, 8\\)"


def _setup(tmp_path, n=4, slots=2, capacity=None):
    folders = []
    for i in range(n):
        write_adapter(tmp_path / f"f{i}", SPEC, 8, torch.float32, seed=20 + i)
        folders.append(tmp_path / f"f{i}")
    want = [load_peft_adapter(f, SPEC, dtype=torch.float32) for f in folders]
    store = HostAdapterStore(SPEC, torch.float32, capacity_bytes=capacity, pin=False)
    for i, f in enumerate(folders):
        store.register_path(f"a{i}", f)
    pool = GpuAdapterPool(SPEC, slots, 8, torch.float32, "cpu")
    return folders, want, store, pool, AdapterLoader(pool, store)


@pytest.mark.parametrize("damage", [_delete, _truncate, _inconsistent_rank, _wrong_shape])
def test_folder_going_bad_after_admission_fails_only_its_request(tmp_path, monkeypatch, damage):
    """a0..a3 admitted (registered, a1 even read once and dropped); a1's folder then goes bad. Its request
    fails naming the adapter and the file; the others load bit for bit; no slot, buffer or stage leaks."""
    folders, want, store, pool, loader = _setup(tmp_path)
    buffers = []
    orig_alloc = lay.alloc_buffer
    monkeypatch.setattr(lay, "alloc_buffer", lambda n, pin: buffers.append(orig_alloc(n, pin)) or buffers[-1])
    store.get("a1")
    store.drop("a1")  # admitted and known good once; dropped (LRU) before its next load
    message = damage(folders[1])
    with HostStager(store, workers=2) as stager:
        stages = {aid: stager.submit(aid) for aid in ["a0", "a1", "a2", "a3"]}
        with pytest.raises(AdapterFormatError, match="^adapter 'a1': " + message):
            stages["a1"].result(10)
        served = []
        for aid in ["a0", "a2", "a3"]:
            slot = loader.load_async(aid, packed=stages[aid].result(10))
            check_slot(pool, slot, want[int(aid[1])])
            served.append(aid)
            if len(served) == pool.num_slots:
                loader.unload(served.pop(0))
        assert stager._inflight == {}
    assert loader.slot_of("a1") is None and sorted(loader.resident()) == ["a3"] and len(loader._free) == 1
    assert sum(loader._refs) == 0 and loader._pending == set()
    assert not store.is_packed("a1") and store.resident_bytes == sum(store.get(a).nbytes for a in store.packed_ids())
    refs = [weakref.ref(b) for b in buffers]
    del buffers
    held = {store.get(a).buffer.data_ptr() for a in store.packed_ids()}
    gc.collect()
    # every buffer the reader allocated is either held by the store or freed (the failed read's included),
    # while the failed stage (and its error) are still alive here
    assert all(r() is None or r().data_ptr() in held for r in refs), "a buffer of a failed read is still alive"
    assert stages["a1"].done()


def test_failed_read_keeps_no_buffer_while_its_error_lives(tmp_path, monkeypatch):
    folders, _, store, _, _ = _setup(tmp_path, n=1)
    (folders[0] / WEIGHTS).write_bytes((folders[0] / WEIGHTS).read_bytes())  # unchanged: fails during the read
    made = []
    orig_alloc = lay.alloc_buffer
    monkeypatch.setattr(lay, "alloc_buffer", lambda n, pin: made.append(weakref.ref(t := orig_alloc(n, pin))) or t)
    # the file shrinks after its header was checked: the read itself finds the truncation
    orig_plan = reader.plan_peft_adapter

    def plan_then_truncate(*a, **k):
        plan = orig_plan(*a, **k)
        path = folders[0] / WEIGHTS
        path.write_bytes(path.read_bytes()[:-64])
        return plan

    monkeypatch.setattr("lora_kernels.adapters.peft.plan_peft_adapter", plan_then_truncate)
    with HostStager(store, workers=1) as stager:
        stage = stager.submit("a0")
        with pytest.raises(AdapterFormatError, match=r"^adapter 'a0': .*adapter_model.safetensors: file truncated "
                                                     r"while reading"):
            stage.result(10)
        err = stage.future.exception()
        gc.collect()
        assert err is not None and len(made) == 1 and made[0]() is None


def test_budget_below_one_adapter_fails_clearly_never_hangs(tmp_path):
    folders, _, _, _, _ = _setup(tmp_path, n=1)
    store = HostAdapterStore(SPEC, torch.float32, capacity_bytes=1000, pin=False)
    store.register_path("a0", folders[0])
    with HostStager(store, workers=1) as stager:
        with pytest.raises(ValueError, match=r"^adapter 'a0' \(.*f0\) needs \d+ bytes of host memory, above the "
                                             r"store's capacity_bytes=1000$"):
            stager.submit("a0").result(10)  # a timeout here would raise TimeoutError instead: no hang
    with pytest.raises(ValueError, match=r"^adapter 'w' needs \d+ bytes of host memory, above the store's "
                                         r"capacity_bytes=1000$"):
        store.register("w", load_peft_adapter(folders[0], SPEC, dtype=torch.float32))
    assert store.resident_bytes == 0 and store.packed_ids() == []
    for bad in (0, -5, 1.5):
        with pytest.raises(ValueError, match=re.escape(f"capacity_bytes must be a positive int or None, got {bad!r}")):
            HostAdapterStore(SPEC, torch.float32, capacity_bytes=bad, pin=False)


def test_worker_exception_reaches_the_waiter_and_the_worker_survives(tmp_path, monkeypatch):
    folders, want, store, _, _ = _setup(tmp_path, n=2)
    orig = reader.read_packed

    def boom(adapter_id, *a, **k):
        if adapter_id == "a0":
            raise RuntimeError("disk controller on fire")
        return orig(adapter_id, *a, **k)

    monkeypatch.setattr(reader, "read_packed", boom)
    with HostStager(store, workers=1) as stager:
        bad = stager.submit("a0")
        with pytest.raises(RuntimeError, match="^disk controller on fire$"):
            bad.result(10)
        assert stager.submit("a1").result(10).rank == 8  # the same worker thread reads the next one
        with pytest.raises(RuntimeError, match="^disk controller on fire$"):
            stager.submit("a0").result(10)  # a failed read is not cached: retried, fails again
        assert stager._inflight == {} and stager.stats["reads"] == 1 and stager.stats["errors"] == 2


def _batch_out(pool, slots, counts, x, base):
    info = lk.BatchInfoBuilder(sum(counts), len(counts), pool.lora_ranks, pool.scalings).build(counts, slots)
    a, b, offs = pool.weights(0, "qkv_proj")
    out = base.clone()
    lk.apply_lora(x, out, a, b, info, offs, backend="torch")
    return out


def _reference(w, x, base):
    a, b = w.lora_a[(0, "qkv_proj")].double(), w.lora_b[(0, "qkv_proj")].double()
    r, offs = w.rank, SPEC.group("qkv_proj").slice_offsets
    out = base.double().clone()
    for i in range(3):
        out[:, offs[i]:offs[i + 1]] += w.scaling * (x.double() @ a[i * r:(i + 1) * r].T) @ b[offs[i]:offs[i + 1]].T
    return out


def test_evicting_an_adapter_a_batch_uses_is_refused_and_the_batch_stays_right(tmp_path):
    _, want, store, pool, loader = _setup(tmp_path, n=2, slots=1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, SPEC.hidden, generator=gen)
    base = torch.randn(5, SPEC.group("qkv_proj").out_total, generator=gen)
    slots = loader.acquire(["a0"])  # the batch is in flight until release
    with pytest.raises(RuntimeError, match=r"^cannot unload adapter 'a0': it is acquired or still loading$"):
        loader.unload("a0")
    with pytest.raises(RuntimeError, match=r"^cannot replace adapter 'a0' by 'a1': it is acquired or still loading$"):
        loader.load_async("a1", victim="a0")
    with pytest.raises(RuntimeError, match=r"^no slot for adapter 'a1': all 1 slots are acquired or still loading$"):
        loader.acquire(["a1"])
    out = _batch_out(pool, slots, [5], x, base)  # the batch runs after every refused eviction
    ref = _reference(want[0], x, base)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert (ref - base.double()).abs().max() > 1e-2  # the adapter changes the rows
    loader.release(["a0"])
    loader.unload("a0")  # released: now allowed, and the next load reuses the slot
    assert loader.acquire(["a1"]) == slots
    check_slot(pool, slots[0], want[1])
    loader.release(["a1"])
