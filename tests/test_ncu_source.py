"""bench/profile/ncu_source.py reads Nsight Compute's source page (one row a SASS instruction): a synthetic page
(the kernel's name line, the header, five rows) gives the instructions an item, the stall reasons' shares, the
instructions with the most samples first, and each part's share."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "ncu_source", Path(__file__).resolve().parent.parent / "bench" / "profile" / "ncu_source.py")
src = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(src)

HEADER = ["Address", "Source", src.SAMPLES, src.EXECUTED, "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]
ROWS = [  # address, instruction, samples, executed, long_sb, wait
    ("a0", "LDG.E R2, desc[UR6][R2.64]", "2", "100", "1", "1"),
    ("b0", "ISETP.GE.AND P0, PT, R2, R9, PT", "6", "100", "6", "0"),
    ("c0", "LDGSTS.E.BYPASS.128 [R15], desc[UR6][R16.64]", "1", "1,200", "0", "1"),
    ("d0", "HMMA.16816.F32.BF16 R28, R24, R28, RZ", "1", "400", "0", "1"),
    ("e0", "STG.E.128 desc[UR6][R34.64], R28", "10", "200", "2", "8"),
]


def _page() -> list[str]:
    quote = lambda vals: ",".join(f'"{v}"' for v in vals)  # noqa: E731
    return ['"Kernel Name","void k(int)"', quote(HEADER)] + [quote(list(r) + ["0"]) for r in ROWS]


def test_report_counts_items_reasons_top_rows_and_parts():
    hdr, rows = src.load(_page())
    assert len(rows) == 5
    lines = src.report(hdr, rows, items=10, parts="setup:0,copies:2,tail:3", top=2)
    assert lines[0] == "# 5 SASS rows, 2000 warp instructions (200 an item), 20 stall samples"
    assert lines[1] == "# stall reasons: wait 55.0%, long_sb 45.0%"
    top = [line for line in lines if line.startswith("| 4 |") or line.startswith("| 1 |")]
    assert top == ["| 4 | 50.0% | 200 | `STG.E.128 desc[UR6][R34.64], R28` |",
                   "| 1 | 30.0% | 100 | `ISETP.GE.AND P0, PT, R2, R9, PT` |"]
    assert "| setup | 0-1 | 20 | 40% |" in lines
    assert "| copies | 2-2 | 120 | 5% |" in lines
    assert "| tail | 3-4 | 60 | 55% |" in lines
