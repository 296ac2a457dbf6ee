"""The host store's pinned arena (CPU: the same allocator over unpinned memory): ranges carved first fit and
coalesced on release, a buffer returned when its PackedAdapter is collected, a miss falling back to torch's
allocator, and reads through the arena byte-identical to reads without it."""

import gc

import pytest
import torch

from lora_kernels.adapters import HostAdapterStore, HostStager, ModelSpec
from lora_kernels.adapters.arena import PAGE, PinnedArena
from lora_kernels.adapters.progress import LayerProgress
from lora_kernels.serve_sim.folders import write_adapter

SPEC = ModelSpec(layers=2, hidden=32, intermediate=40, num_heads=4, num_kv_heads=2, head_dim=8)


def test_ranges_are_carved_first_fit_and_coalesced():
    arena = PinnedArena(8 * PAGE, pin=False)
    views = [arena.alloc(PAGE + 1), arena.alloc(PAGE), arena.alloc(3 * PAGE)]  # 2 + 1 + 3 pages
    assert [off for _, off in views] == [0, 2 * PAGE, 3 * PAGE] and views[0][0].numel() == PAGE + 1
    assert arena.alloc(3 * PAGE) is None and arena.stats["misses"] == 1  # 2 pages left
    arena.release(2 * PAGE, PAGE)
    arena.release(0, PAGE + 1)  # merges with the free page after it: pages 0-2 free
    got = arena.alloc(3 * PAGE)
    assert got is not None and got[1] == 0
    with pytest.raises(RuntimeError, match="already free"):
        arena.release(6 * PAGE, PAGE)
    arena.release(0, 3 * PAGE)
    arena.release(3 * PAGE, 3 * PAGE)
    assert arena.free_bytes() == 8 * PAGE and arena.stats["in_use"] == 0
    assert arena.alloc(8 * PAGE)[1] == 0  # one range again


def test_store_reads_into_the_arena_and_returns_buffers_when_adapters_go(tmp_path):
    names = ["a", "b", "c"]
    plain = HostAdapterStore(SPEC, torch.bfloat16, pin=False)
    store = HostAdapterStore(SPEC, torch.bfloat16, pin=False)
    for i, n in enumerate(names):
        write_adapter(tmp_path / n, SPEC, 4 + 4 * i, torch.bfloat16, seed=i)
        plain.register_path(n, tmp_path / n)
        store.register_path(n, tmp_path / n)
    want = {n: plain.get(n) for n in names}
    arena = store.reserve_pinned(sum(PinnedArena.held(want[n].blocks.nbytes) for n in names[:2]))
    with HostStager(store, workers=1, layerwise=True) as stager:
        got = {n: stager.submit(n).result(timeout=30) for n in names}
    base = arena.buffer.data_ptr()
    inside = [base <= got[n].buffer.data_ptr() < base + arena.nbytes for n in names]
    assert inside == [True, True, False] and arena.stats["misses"] == 1  # c did not fit: torch's allocator
    assert [got[n].nbytes for n in names[:2]] == [PinnedArena.held(got[n].blocks.nbytes) for n in names[:2]]
    for n in names:
        for key in want[n].a:
            assert torch.equal(got[n].a[key], want[n].a[key]) and torch.equal(got[n].b[key], want[n].b[key])
    assert store.resident_bytes == sum(p.nbytes for p in got.values())
    for n in names:
        store.drop(n)
    del got
    gc.collect()
    assert arena.stats["in_use"] == 0 and arena.free_bytes() == arena.nbytes
    p = LayerProgress(SPEC.layers, pin=False)  # and the range is used again
    assert store.get("c", progress=p).buffer.data_ptr() == base


def test_a_buffer_stays_while_a_holder_keeps_its_adapter(tmp_path):
    write_adapter(tmp_path / "a", SPEC, 4, torch.bfloat16, seed=1)
    store = HostAdapterStore(SPEC, torch.bfloat16, pin=False)
    store.register_path("a", tmp_path / "a")
    arena = store.reserve_pinned(1 << 20)
    held = store.get("a")  # a load in flight holds it after the store drops it
    store.drop("a")
    gc.collect()
    assert arena.stats["in_use"] == store.held_nbytes(held.blocks.nbytes)
    again = store.get("a")
    assert again.buffer.data_ptr() != held.buffer.data_ptr()  # the held range is not handed out twice


def test_concurrent_allocs_and_releases_never_hand_out_a_range_twice():
    import random
    import threading

    arena = PinnedArena(64 * PAGE, pin=False)
    owner = torch.full((64,), -1, dtype=torch.int32)  # page -> thread holding it (-1: free)
    lock, errors = threading.Lock(), []

    def work(tid):
        rng = random.Random(tid)
        held = []
        try:
            for _ in range(400):
                if held and (rng.random() < 0.5 or len(held) > 6):
                    off, n = held.pop(rng.randrange(len(held)))
                    with lock:
                        owner[off // PAGE:(off + n) // PAGE] = -1
                    arena.release(off, n)
                    continue
                n = rng.randint(1, 5) * PAGE
                got = arena.alloc(n)
                if got is None:
                    continue
                off = got[1]
                with lock:
                    if (owner[off // PAGE:(off + n) // PAGE] != -1).any():
                        errors.append((tid, off, n))
                    owner[off // PAGE:(off + n) // PAGE] = tid
                held.append((off, n))
            for off, n in held:
                with lock:
                    owner[off // PAGE:(off + n) // PAGE] = -1
                arena.release(off, n)
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:3]
    assert arena.stats["in_use"] == 0 and arena.free_bytes() == arena.nbytes and arena.stats["allocs"] > 100
