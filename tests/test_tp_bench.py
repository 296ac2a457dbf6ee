"""bench/bench_tp.py's logic on the CPU (fake timers, a tiny model): measure -> report end to end, its PEFT
writer read back by load_peft_adapter, and the per-rank byte ratios it reports."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_tp  # noqa: E402
import common  # noqa: E402

from lora_kernels.adapters import AdapterWeights, ModelSpec, load_peft_adapter  # noqa: E402

TINY = ModelSpec(layers=2, hidden=64, intermediate=96, num_heads=4, num_kv_heads=2, head_dim=16)


def test_save_peft_reads_back_exactly(tmp_path):
    w = AdapterWeights.random(TINY, 4, torch.bfloat16, seed=3, scaling=2.0)
    bench_tp.save_peft(w, tmp_path / "a")
    got = load_peft_adapter(tmp_path / "a", TINY)
    assert got.rank == 4 and got.scaling == 2.0 and set(got.lora_a) == set(w.lora_a)
    for key in w.lora_a:
        assert torch.equal(got.lora_a[key], w.lora_a[key]) and torch.equal(got.lora_b[key], w.lora_b[key])


@pytest.fixture
def cpu_bench(monkeypatch):
    """The script on the CPU: a tiny model, small cases, timers that run the work once and return its bytes."""
    monkeypatch.setattr(bench_tp, "DEVICE", "cpu")
    monkeypatch.setattr(bench_tp, "FULL", TINY)
    monkeypatch.setattr(bench_tp, "RANK", 4)
    monkeypatch.setattr(bench_tp, "DTYPE", torch.float32)  # bf16 matmuls are slow on the CPU
    monkeypatch.setattr(bench_tp, "ROTATE_BYTES", 1)  # one buffer set per module
    monkeypatch.setattr(bench_tp, "CASES", (bench_tp.Case("decode", 4, "distinct", 4),
                                            bench_tp.Case("prefill", 2, "distinct", 2, seq=24)))

    def fake_graph(fns, inner=1, warmup=0, reps=0):
        for f in fns:
            f()
        return 1.0

    def fake_span(fn, stream=None, warmup=0, reps=0, hold_cycles=0):
        fn()
        return {"gpu_us": 2.0, "wall_us": 3.0}

    monkeypatch.setattr(common, "time_graph_us", fake_graph)
    monkeypatch.setattr(common, "time_span_us", fake_span)
    monkeypatch.setattr(common, "copy_bandwidth_gbs", lambda: 1000.0)


def test_measure_and_report_on_cpu(cpu_bench, tmp_path, capsys):
    w = AdapterWeights.random(TINY, 4, torch.bfloat16, seed=0)
    bench_tp.save_peft(w, tmp_path / "adapter")
    args = type("A", (), {"quick": True, "backend": "torch", "json": tmp_path / "out.jsonl"})()
    per_rank = [bench_tp.measure(k, 2, args, tmp_path / "adapter", w) for k in range(2)]
    for r in per_rank:
        assert set(r["layers"]) == {c.name for c in bench_tp.CASES}
        for c in r["layers"].values():
            assert c["tpN"]["floor_us"] < c["tp1"]["floor_us"]
        assert r["load"]["tpN"]["MB"] < r["load"]["tp1"]["MB"]
    bench_tp.report(per_rank, 2, emulated=False, args=args)
    text = capsys.readouterr().out
    assert "bytes_ratio" in text and "floor_ratio" in text
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    loads = [r for r in rows if r["bench"] == "tp_load" and r["tp"] == 2]
    assert len(loads) == 1 and 0.5 < loads[0]["bytes_ratio"] < 1.0
    assert len([r for r in rows if r["bench"] == "tp_layer"]) == 2 * len(bench_tp.CASES)
