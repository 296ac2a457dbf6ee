"""The examples run as a user runs them (a fresh interpreter, CPU), and say what they show."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_hf_mixed_adapters_example():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_mixed_adapters.py"), "--device", "cpu"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("prompt of") == 6
    assert "evictions: 1" in r.stdout  # 3 adapters through 2 device slots
    assert "agrees on 100.0% of tokens" in r.stdout
