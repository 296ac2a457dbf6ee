"""Layer-wise loads on the CPU: the reader reports each layer as it lands, the stager times them, the loader
copies layer by layer into the same bytes, and the simulator places and charges per-layer readiness.
(The GPU half, copies that wait on the host's flag and steps that wait per layer: test_loader_gpu.py.)"""

import pytest
import torch

from adapter_checks import check_slot
from lora_kernels.adapters import (AdapterLoader, GpuAdapterPool, HostAdapterStore, HostStager, ModelSpec,
                                   load_peft_adapter)
from lora_kernels.adapters import reader
from lora_kernels.adapters.progress import FAILED, LayerProgress
from lora_kernels.serve_sim.folders import write_adapter
from lora_kernels.serve_sim.scheduler import AdapterState

SPEC = ModelSpec(layers=3, hidden=32, intermediate=40, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("native", [True, False])
def test_reader_reports_every_layer_and_reads_the_same_bytes(tmp_path, monkeypatch, native):
    if native and reader._native_pread_layers is None:
        pytest.skip("extension not built")
    if not native:
        monkeypatch.setattr(reader, "_native_pread_layers", None)
    write_adapter(tmp_path / "a", SPEC, 4, torch.bfloat16, seed=1)
    want = reader.read_packed("a", tmp_path / "a", SPEC, torch.bfloat16, pin=False)
    p = LayerProgress(SPEC.layers, pin=False)
    got = reader.read_packed("a", tmp_path / "a", SPEC, torch.bfloat16, pin=False, progress=p, read_threads=3)
    assert p.packed is got and p.published()
    assert torch.equal(got.header, want.header)
    for key in want.a:  # block by block: the alignment padding between blocks is never written
        assert torch.equal(got.a[key], want.a[key]) and torch.equal(got.b[key], want.b[key]), key
    assert p.count == SPEC.layers and len(p.times) == SPEC.layers
    assert p.times == sorted(p.times)


def test_a_read_with_a_second_pass_completes_every_layer_at_its_end(tmp_path):
    write_adapter(tmp_path / "a", SPEC, 4, torch.float32, seed=1)  # cast to bf16: through a temporary
    p = LayerProgress(SPEC.layers, pin=False)
    reader.read_packed("a", tmp_path / "a", SPEC, torch.bfloat16, pin=False, progress=p)
    assert p.count == SPEC.layers and len(set(p.times)) == 1


def test_stager_times_each_layer_and_a_failure_releases_the_flag(tmp_path):
    write_adapter(tmp_path / "a", SPEC, 4, torch.bfloat16, seed=1)
    write_adapter(tmp_path / "b", SPEC, 4, torch.bfloat16, seed=2)
    store = HostAdapterStore(SPEC, torch.bfloat16, pin=False)
    store.register_path("a", tmp_path / "a")
    store.register_path("b", tmp_path / "b")
    weights = tmp_path / "b" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated after admission
    with HostStager(store, workers=2, layerwise=True) as stager:
        a, b = stager.submit("a"), stager.submit("b")
        a.result()
        with pytest.raises(Exception, match="truncated|adapter 'b'"):
            b.result()
    secs = a.layer_seconds
    assert len(secs) == SPEC.layers and list(secs) == sorted(secs) and 0 <= secs[0] and secs[-1] <= a.seconds
    assert b.progress.failed and b.progress.count == FAILED and b.layer_seconds is None


@pytest.mark.parametrize("rank", [8, 4])  # r = R: whole blocks; r < R: B through staging, scattered per layer
def test_layerwise_loader_fills_the_slot_like_the_whole_load(tmp_path, rank):
    write_adapter(tmp_path / "a", SPEC, rank, torch.bfloat16, seed=5)
    store = HostAdapterStore(SPEC, torch.bfloat16, pin=False)
    store.register_path("a", tmp_path / "a")
    pool = GpuAdapterPool(SPEC, 3, 8, torch.bfloat16, "cpu")
    for t in [*(d[g] for d in pool.lora_a for g in d), *pool.lora_b_stacked.values()]:
        t.fill_(7.0)  # stale slot contents: every row the load must write is checked
    loader = AdapterLoader(pool, store, layerwise=True)
    p = LayerProgress(SPEC.layers, pin=False)
    store.get("a", progress=p)
    slot = loader.load_async("a", progress=p)
    check_slot(pool, slot, load_peft_adapter(tmp_path / "a", SPEC, dtype=torch.bfloat16))
    assert loader.acquire(["a"], layerwise=True) == [slot]
    loader.wait_layer(0)  # a CPU pool: nothing in flight
    loader.release(["a"])


def test_loader_refuses_a_failed_or_unpublished_progress(tmp_path):
    store = HostAdapterStore(SPEC, torch.bfloat16, pin=False)
    loader = AdapterLoader(GpuAdapterPool(SPEC, 2, 8, torch.bfloat16, "cpu"), store)
    p = LayerProgress(SPEC.layers, pin=False)
    with pytest.raises(ValueError, match="not published"):
        loader.load_async("a", progress=p)
    p.fail(OSError("disk gone"))
    with pytest.raises(OSError, match="disk gone"):
        loader.load_async("a", progress=p)


def test_sim_places_layers_and_charges_a_late_layer():
    cache = AdapterState(4)
    cache.start_load("x", None)
    layers = [1.0, 2.0, 3.0, 4.0]
    cache.set_ready("x", layers, walk_s=2.0)  # a step reaches layer l at start + l/4 * >= 2 s
    assert cache.ready_at["x"] == pytest.approx(max(t - i / 4 * 2.0 for i, t in enumerate(layers)))  # 2.5
    assert not cache.is_ready("x", 0.9) and cache.is_ready("x", 2.5)
    cache.observe_step(64, 8.0)  # steps of >= 128 rows are known to take >= 8 s: layer 3 is reached at +6 s
    assert cache.is_ready("x", 1.0, rows=128) and not cache.is_ready("x", 1.0, rows=64)
    # A 4 s step from t = 1: layer 3 (ready at 4) is reached at 1 + 3 = 4, on time; a 2 s step waits for it.
    assert cache.step_end(1.0, 4.0, {"x"}) == pytest.approx(5.0)
    assert cache.step_end(1.0, 2.0, {"x"}) == pytest.approx(4.0 + 0.5)
    cache.set_ready("x", [3.0], walk_s=2.0)  # a whole load: one entry
    assert cache.ready_at["x"] == 3.0 and "x" not in cache.layers_at


def test_concurrent_layerwise_reads_share_the_reader_pool(tmp_path):
    """Several workers read at once through the process-wide reader threads: every buffer is right, every read
    reports all its layers, and none waits on another's helpers (the pool is shared, never exclusive)."""
    import threading

    names = [f"a{i}" for i in range(6)]
    for i, n in enumerate(names):
        write_adapter(tmp_path / n, SPEC, 4 + 4 * (i % 2), torch.bfloat16, seed=i)
    want = {n: reader.read_packed(n, tmp_path / n, SPEC, torch.bfloat16, pin=False) for n in names}
    errors = []

    def work(n):
        try:
            for _ in range(5):
                p = LayerProgress(SPEC.layers, pin=False)
                got = reader.read_packed(n, tmp_path / n, SPEC, torch.bfloat16, pin=False, progress=p, read_threads=4)
                assert p.count == SPEC.layers and len(p.times) == SPEC.layers
                for key in want[n].a:
                    assert torch.equal(got.a[key], want[n].a[key]) and torch.equal(got.b[key], want[n].b[key])
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a read hung"
    assert not errors, errors


def _started_stager_store(tmp_path, names):
    store = HostAdapterStore(SPEC, torch.bfloat16, pin=False)
    for i, n in enumerate(names):
        write_adapter(tmp_path / n, SPEC, 4, torch.bfloat16, seed=i)
        store.register_path(n, tmp_path / n)
    return store


def test_a_layerwise_stage_starts_its_read_on_the_submitting_thread(tmp_path):
    """With the extension, a layer-wise read starts inside `submit` (no worker hand-off before its first byte): the
    buffer is published when submit returns, the stage is timed from its submit, and the bytes are the whole read's."""
    if reader._native_start is None:
        pytest.skip("extension not built")
    store = _started_stager_store(tmp_path, ["a"])
    want = reader.read_packed("a", tmp_path / "a", SPEC, torch.bfloat16, pin=False)
    with HostStager(store, workers=1, layerwise=True) as stager:
        stage = stager.submit("a")
        assert stage.progress.published()  # on this thread, before any worker ran
        got = stage.result(timeout=30)
    assert stage.progress.count == SPEC.layers and len(stage.layer_seconds) == SPEC.layers
    assert stage.progress.packed is got and store.is_packed("a")
    for key in want.a:
        assert torch.equal(got.a[key], want.a[key]) and torch.equal(got.b[key], want.b[key]), key


@pytest.mark.parametrize("fault", ["deleted", "truncated"])
def test_a_started_read_that_fails_fails_only_its_stage(tmp_path, monkeypatch, fault):
    """The file goes bad after the read's plan was checked (between the header check and the tensor reads): the
    stage fails with an error naming the adapter and the file, its flag is released, nothing is held, and the
    next stage of another adapter reads fine."""
    if reader._native_start is None:
        pytest.skip("extension not built")
    store = _started_stager_store(tmp_path, ["a", "b"])
    weights = tmp_path / "b" / "adapter_model.safetensors"
    start = reader.start_packed

    def go_bad_then_start(adapter_id, *args, **kwargs):  # after the plan check, before the native read opens the file
        if adapter_id == "b":
            if fault == "deleted":
                weights.unlink()
            else:
                weights.write_bytes(weights.read_bytes()[:-64])
        return start(adapter_id, *args, **kwargs)

    monkeypatch.setattr(reader, "start_packed", go_bad_then_start)
    with HostStager(store, workers=1, layerwise=True) as stager:
        b = stager.submit("b")
        with pytest.raises(Exception, match="adapter 'b'.*adapter_model.safetensors.*(cannot open|truncated)"):
            b.result(timeout=30)
        a = stager.submit("a")
        a.result(timeout=30)
    assert b.progress.failed and not store.is_packed("b") and store.is_packed("a")
    assert stager.stats["errors"] == 1 and stager.stats["reads"] == 1


def test_native_started_read_waits_once_and_a_dropped_handle_waits_for_its_read(tmp_path):
    if reader._native_start is None:
        pytest.skip("extension not built")
    import gc

    write_adapter(tmp_path / "a", SPEC, 4, torch.bfloat16, seed=3)
    store = _started_stager_store(tmp_path, [])
    store.register_path("a", tmp_path / "a")
    p = LayerProgress(SPEC.layers, pin=False)
    pending = store.start_get("a", p)
    assert isinstance(pending, reader.PendingRead)
    assert store.finish_get("a", pending) is p.packed and p.count == SPEC.layers
    with pytest.raises(RuntimeError, match="already waited"):
        pending.wait()
    for _ in range(20):  # handles dropped unwaited: each waits for its read before the buffer can go
        store.drop("a")
        store.start_get("a", LayerProgress(SPEC.layers, pin=False))
        gc.collect()


def test_a_load_ready_within_a_share_of_the_step_may_join_it():
    """overlap policies' admit_within: a load usable if the step started `share` of its lower bound later joins it
    (the step then starts when the load allows); a load further out, or not yet placed, does not."""
    cache = AdapterState(4)
    cache.observe_step(16, 4.0)  # steps of >= 32 rows take >= 4 s
    cache.start_load("x", None)
    assert not cache.ready_soon("x", 0.0, 64, 0.25)  # issued, not placed: unknown
    cache.set_ready("x", [1.0], walk_s=4.0)  # a whole load, in place at t = 1
    assert not cache.is_ready("x", 0.0, rows=64)
    assert cache.ready_soon("x", 0.0, 64, 0.25)  # 1 s late, a quarter of a 4 s step
    assert not cache.ready_soon("x", 0.0, 64, 0.2) and not cache.ready_soon("x", 0.0, 8, 0.25)  # no bound below 32
    assert not cache.ready_soon("x", 0.0, 64, 0.0)


def test_without_the_started_read_the_worker_reads_layer_by_layer(tmp_path, monkeypatch):
    """No extension start (or a read with a second pass): `start_get` says None and the worker reads the stage, still
    reporting every layer."""
    monkeypatch.setattr(reader, "_native_start", None)
    store = _started_stager_store(tmp_path, ["a"])
    assert store.start_get("a", LayerProgress(SPEC.layers, pin=False)) is None
    with HostStager(store, workers=1, layerwise=True) as stager:
        stage = stager.submit("a")
        got = stage.result(timeout=30)
    assert stage.progress.count == SPEC.layers and stage.progress.packed is got and len(stage.layer_seconds) == SPEC.layers
