"""`lora-kernels serve-sim --tp 2` under torchrun (gloo, CPU): every rank runs its shard, the ranks agree on
every measured time (else their collectives would mismatch), rank 0 alone prints the report."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_kernels.cli import main
from test_tp import _free_port

REPO = Path(__file__).resolve().parents[1]


def test_serve_sim_tp2_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--nnodes=1", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "-m", "lora_kernels", "serve-sim", "--tp", "2", "--device", "cpu",
           "--backend", "torch", "--layers", "1", "--adapters", "4", "--slots", "2", "--requests", "8", "--rate", "200",
           "--input-len", "4:20", "--seeds", "1", "--output-len", "2:4", "--chunk", "8", "--max-batch-tokens", "32",
           "--cache-dir", str(tmp_path), "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"serve-sim --tp 2 timed out (ranks disagreeing would hang a collective): {e.stderr!r}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = proc.stdout
    assert out.count("tensor parallel: 2 ranks") == 1 and out.count("layer-0 LoRA outputs") == 1  # rank 0 only
    assert "identical" in out and "overlap+prefetch" in out


def test_serve_sim_tp_without_torchrun_is_one_error_line(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["serve-sim", "--no-progress", "--tp", "2", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert len(err.strip().splitlines()) == 1 and "torchrun --nproc-per-node 2" in err
