"""bench/profile/ncu_summary.py turns Nsight Compute's raw CSV into one row per kernel: a synthetic two-kernel CSV
(header line, units line, rows) gives the durations in µs, the DRAM bytes in MB by their units, and the limiter."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "ncu_summary", Path(__file__).resolve().parent.parent / "bench" / "profile" / "ncu_summary.py")
ncu = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ncu)


def _csv(units: dict, kernels: list[dict]) -> list[str]:
    cols = ["ID", "Kernel Name"] + ncu.METRICS
    quote = lambda vals: ",".join(f'"{v}"' for v in vals)  # noqa: E731
    lines = ["==PROF== a log line the parser skips", quote(cols),
             quote(["", ""] + [units.get(c, "") for c in ncu.METRICS])]
    for i, k in enumerate(kernels):
        lines.append(quote([str(i), k["name"]] + [k.get(c, "") for c in ncu.METRICS]))
    return lines


def test_rows_scale_durations_and_bytes_by_their_units():
    units = {ncu.DURATION: "usecond", ncu.DRAM_READ: "Mbyte", ncu.DRAM_WRITE: "Gbyte"}
    kernels = [{"name": "expand", ncu.DURATION: "377.0", ncu.DRAM: "73.8", ncu.SM: "35.3", ncu.OCC: "23.8",
                ncu.DRAM_READ: "483.1", ncu.DRAM_WRITE: "0.45", ncu.STALL.format("long_scoreboard"): "5.3",
                ncu.STALL.format("wait"): "1.7"},
               {"name": "shrink", ncu.DURATION: "1,000", ncu.DRAM: "12", ncu.SM: "60", ncu.DRAM_READ: "2",
                ncu.DRAM_WRITE: "1"}]
    rs = ncu.rows(_csv(units, kernels))
    assert [r["kernel"] for r in rs] == ["expand", "shrink"]
    assert rs[0]["us"] == 377.0 and rs[1]["us"] == 1000.0
    assert rs[0]["read_mb"] == 483.1 and abs(rs[0]["write_mb"] - 450.0) < 1e-9
    assert rs[0]["limiter"] == "memory, long_scoreboard 5.3 / wait 1.7"
    assert rs[1]["limiter"].startswith("compute")
    table = ncu.table("case", rs)
    assert "483.1 / 450.0" in table and table.count("\n| ") == 3  # the header row and two kernels


def test_bytes_in_bytes_become_megabytes():
    units = {ncu.DURATION: "nsecond", ncu.DRAM_READ: "byte", ncu.DRAM_WRITE: "byte"}
    rs = ncu.rows(_csv(units, [{"name": "k", ncu.DURATION: "2500", ncu.DRAM_READ: "104,612,608",
                                ncu.DRAM_WRITE: "80,508,672"}]))
    assert rs[0]["us"] == 2.5
    assert abs(rs[0]["read_mb"] - 104.612608) < 1e-9 and abs(rs[0]["write_mb"] - 80.508672) < 1e-9
