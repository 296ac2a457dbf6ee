"""The direct host-stage reader (`reader.read_packed`) and the N-worker `HostStager`, on the CPU.

The reader must produce the same packed bytes as the reference path (`load_peft_adapter` + `pack_adapter`)
for every PEFT feature (missing slices, rank/alpha patterns, layers_to_transform, dtype conversion), into
a buffer the allocator hands back dirty, and must validate from the header before reading."""

import json
import threading

import pytest
import torch

from lora_kernels.adapters import (AdapterFormatError, HostAdapterStore, HostStager, ModelSpec, load_peft_adapter,
                                   pack_adapter)
from lora_kernels.adapters import layout as lay
from lora_kernels.adapters import reader
from lora_kernels.serve_sim.folders import write_adapter

SPEC = ModelSpec(layers=2, hidden=24, intermediate=20, num_heads=3, num_kv_heads=1, head_dim=8)


def _poisoned_alloc(monkeypatch, made=None):
    """Buffers come back full of 0xFF bytes (NaN in every float dtype), as a reused pinned block could."""
    def alloc(n, pin):
        buf = torch.full((n,), 0xFF, dtype=torch.uint8)
        if made is not None:
            made.append(buf)
        return buf
    monkeypatch.setattr(lay, "alloc_buffer", alloc)


def _same_bytes(p, q):
    assert p.rank == q.rank and p.scaling == q.scaling and p.layout == q.layout
    assert torch.equal(p.header, q.header)
    for key in q.a:
        assert torch.equal(p.a[key], q.a[key]), ("A", key)
        assert torch.equal(p.b[key], q.b[key]), ("B", key)


def _edit_config(folder, **kw):
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(kw)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("file_dtype,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                              (torch.float32, torch.float32), (torch.float16, torch.float32)])
def test_read_packed_equals_reference_path(tmp_path, monkeypatch, file_dtype, dtype):
    write_adapter(tmp_path / "a", SPEC, 4, file_dtype, seed=3)
    _poisoned_alloc(monkeypatch)
    got = reader.read_packed("a", tmp_path / "a", SPEC, dtype, pin=False)
    want = pack_adapter("a", load_peft_adapter(tmp_path / "a", SPEC, dtype=dtype), SPEC, dtype, pin=False)
    _same_bytes(got, want)
    assert got.a[(1, "down_proj")].view(dtype).abs().sum() > 0  # real data, not zeros


@pytest.mark.parametrize("edit", [
    dict(target_modules=["q_proj", "v_proj", "down_proj"]),           # k slice missing, o/gate_up untargeted
    dict(rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 3}),  # module ranks and scalings differ
    dict(layers_to_transform=[1], target_modules=["gate_proj", "up_proj"]),
])
def test_read_packed_peft_features(tmp_path, monkeypatch, edit):
    """Folders written whole, then narrowed by the config (the file keeps only what the config names)."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "a"
    write_adapter(folder, SPEC, 4, torch.float32, seed=5)
    _edit_config(folder, **edit)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    targets = edit.get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    layers = edit.get("layers_to_transform", [0, 1])
    keep = {}
    for k, t in tensors.items():
        if any(f".{m}." in k for m in targets) and any(f"layers.{i}." in k for i in layers):
            if ".o_proj." in k and "rank_pattern" in edit:
                t = t[:2].contiguous() if "lora_A" in k else t[:, :2].contiguous()
            keep[k] = t
    save_file(keep, str(folder / "adapter_model.safetensors"))
    _poisoned_alloc(monkeypatch)
    got = reader.read_packed("a", folder, SPEC, torch.bfloat16, pin=False)
    want = pack_adapter("a", load_peft_adapter(folder, SPEC, dtype=torch.bfloat16), SPEC, torch.bfloat16, pin=False)
    _same_bytes(got, want)


def test_read_packed_parallel_reads_equal_serial(tmp_path, monkeypatch):
    write_adapter(tmp_path / "a", SPEC, 8, torch.bfloat16, seed=9)
    monkeypatch.setattr(reader, "_PARALLEL_MIN_BYTES", 0)  # force the threaded path on a small file
    one = reader.read_packed("a", tmp_path / "a", SPEC, torch.bfloat16, pin=False, read_threads=1)
    three = reader.read_packed("a", tmp_path / "a", SPEC, torch.bfloat16, pin=False, read_threads=3)
    _same_bytes(three, one)


def test_read_packed_validates_from_header_before_reading(tmp_path, monkeypatch):
    folder = tmp_path / "a"
    write_adapter(folder, SPEC, 4, torch.bfloat16, seed=1)
    _edit_config(folder, r=8, lora_alpha=16)  # the tensors are rank 4
    made = []
    _poisoned_alloc(monkeypatch, made)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(AdapterFormatError, match=f"adapter_model.safetensors: tensor '{q_a}' has shape "
                                                 r"\(4, 24\) but the model spec and rank 8 need \(8, 24\)"):
        reader.read_packed("a", folder, SPEC, torch.bfloat16, pin=False)
    assert made == []  # nothing allocated for an adapter the header already rejects


def test_allocator_nbytes_rounds_pinned_only():
    assert lay.allocator_nbytes(1000, pinned=False) == 1000
    assert lay.allocator_nbytes(1000, pinned=True) == 1024
    assert lay.allocator_nbytes(1024, pinned=True) == 1024
    assert lay.allocator_nbytes(83_886_336, pinned=True) == 1 << 27


def test_stager_runs_n_workers_at_once(tmp_path):
    store = HostAdapterStore(SPEC, torch.float32, pin=False)
    for i in range(3):
        write_adapter(tmp_path / f"f{i}", SPEC, 4, torch.float32, seed=i)
        store.register_path(f"a{i}", tmp_path / f"f{i}")
    barrier = threading.Barrier(3, timeout=5)  # passes only if three reads run at the same time
    orig_get = store.get

    def get(aid):
        barrier.wait()
        return orig_get(aid)

    store.get = get
    with HostStager(store, workers=3) as stager:
        stages = [stager.submit(f"a{i}") for i in range(3)]
        assert [s.result(10).rank for s in stages] == [4, 4, 4]
        assert stager.stats["reads"] == 3 and stager.workers == 3
    with pytest.raises(ValueError, match=r"^workers must be a positive int, got 0$"):
        HostStager(store, workers=0)


def test_read_packed_fused_modules(tmp_path, monkeypatch):
    """Phi-3 style fused qkv_proj / gate_up_proj: one A written into every slice's rows, B split by slice."""
    from safetensors.torch import save_file

    folder = tmp_path / "fused"
    folder.mkdir()
    gen = torch.Generator().manual_seed(4)
    tensors = {}
    for layer in range(SPEC.layers):
        for parent, name in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj"), ("self_attn", "o_proj")):
            g = SPEC.group(name)
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(4, g.in_dim, generator=gen)
            tensors[f"{key}.lora_B.weight"] = torch.randn(g.out_total, 4, generator=gen)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj", "gate_up_proj", "o_proj"]}))
    _poisoned_alloc(monkeypatch)
    for dtype in (torch.float32, torch.bfloat16):
        got = reader.read_packed("f", folder, SPEC, dtype, pin=False)
        want = pack_adapter("f", load_peft_adapter(folder, SPEC, dtype=dtype), SPEC, dtype, pin=False)
        _same_bytes(got, want)
        a = got.a[(1, "qkv_proj")].view(dtype).view(12, SPEC.hidden)
        assert torch.equal(a[0:4], a[8:12]) and a[0:4].abs().sum() > 0


@pytest.mark.parametrize("native", [True, False])
def test_pread_jobs_reads_and_reports_truncation(tmp_path, monkeypatch, native):
    """The extension's pread_into (every read with the GIL released) and the Python preadv loop read the same bytes
    and raise the same error, naming the file, for a read past the end of the file."""
    if native and reader._pread_into is None:
        pytest.skip("extension not built")
    if not native:
        monkeypatch.setattr(reader, "_pread_into", None)
    monkeypatch.setattr(reader, "_PARALLEL_MIN_BYTES", 0)  # the threaded path on a small file
    path = tmp_path / "w.bin"
    data = bytes(range(256)) * 8
    path.write_bytes(data)
    a, b = bytearray(b"\xff" * 100), bytearray(b"\xff" * 7)
    fd = reader.os.open(path, reader.os.O_RDONLY)
    try:
        reader._pread_jobs(fd, [(5, memoryview(a)), (2000, memoryview(b))], path)
        assert bytes(a) == data[5:105] and bytes(b) == data[2000:2007]
        with pytest.raises(AdapterFormatError, match="^" + str(path) + r": file truncated while reading \(byte 2048 "
                           r"of a tensor ending at 2050\)$"):
            reader._pread_jobs(fd, [(5, memoryview(a)), (2040, memoryview(bytearray(10)))], path)
        # 3 threads over 12 jobs: every byte lands, and the first failure in job order is the one reported
        outs = [bytearray(b"\xff" * 150) for _ in range(12)]
        reader._pread_all(fd, [(150 * i, memoryview(o)) for i, o in enumerate(outs)], path, 3)
        assert b"".join(outs) == data[:1800]
        jobs = [(150 * i, memoryview(bytearray(150))) for i in range(12)] + [(2000, memoryview(bytearray(100)))]
        with pytest.raises(AdapterFormatError, match=r"byte 2048 of a tensor ending at 2100\)$"):
            reader._pread_all(fd, jobs, path, 3)
    finally:
        reader.os.close(fd)
