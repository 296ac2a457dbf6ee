"""bench/bench_serving.py --smoke: the whole statistical run (correctness across policies, capacity, the
grid of seeds x loads x policies, tables with CIs) on the CPU with the tiny model: the script works end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_serving_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "serving.jsonl"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_serving.py"), "--smoke", "--json", str(out),
                           "--cache-dir", str(tmp_path / "cache"), "--plot", str(tmp_path / "load.png")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    chk = [r for r in rows if r["scenario"] == "correctness"]
    assert [c["backend"] for c in chk] == ["torch"] and chk[0]["identical"]
    runs = [r for r in rows if r["scenario"] == "run" and r["load"] is not None and r["load"] < 1]
    cells = {(r["dist"], r["load"]) for r in runs}
    assert cells == {(d, f) for d in ("zipf:1.5", "distinct") for f in (0.5, 0.8, 0.95)}
    assert len(runs) == 6 * 5 * 4  # 5 seeds x 4 policies per cell
    stats = [r for r in rows if r["scenario"] == "stats"]
    assert len(stats) == 24 and all(s["seeds"] == 5 for s in stats)
    for s in stats:
        for key in ("ttft_p50_x", "e2e_p50_x", "ttft_p99_x"):
            v = s[key]
            assert v["lo"] <= v["median"] <= v["hi"]
    md = (tmp_path / "bench_serving.md").read_text()
    assert "x oracle" in md and "Targets (issue 20)" in md and "**identical**" in md
    assert (tmp_path / "load.png").stat().st_size > 10_000
