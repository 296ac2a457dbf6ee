"""Where one kernel's instructions and warp stalls go, from Nsight Compute's source page (SASS, one row an
instruction): totals, the stall reasons' shares, the instructions with the most stall samples, and parts of the
kernel given as SASS row ranges (instructions an item and share of stall samples each).

    ncu -k regex:stream --launch-skip 2 --launch-count 1 --set full --import-source no -o rep \
        python3 scripts/cuda_kernel_probe.py layer cuda "r16 decode 16x1 uniform" sorted
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python3 bench/profile/ncu_source.py src.csv --items 6272 --parts "prologue:0,B copies:572,out copies:783,..."

A part runs from its row to the next part's; rows are the CSV's instruction rows from 0 (--top prints them).
"""

from __future__ import annotations

import argparse
import csv

SAMPLES, EXECUTED = "Warp Stall Sampling (All Samples)", "Instructions Executed"


def load(lines) -> tuple[list[str], list[list[str]]]:
    """The source page's header and instruction rows (lines before the header, e.g. the kernel's name, skipped)."""
    rows = list(csv.reader(lines))
    start = next(i for i, r in enumerate(rows) if SAMPLES in r)
    return rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]


def num(r: list[str], i: int) -> float:
    return float(r[i].replace(",", "") or 0)


def report(hdr: list[str], rows: list[list[str]], items: int = 0, parts: str = "", top: int = 12) -> list[str]:
    """Markdown lines: totals, stall reasons, the top instructions by stall samples, and the parts' shares."""
    col = {h: i for i, h in enumerate(hdr)}
    s_i, n_i = col[SAMPLES], col[EXECUTED]
    samples, executed = sum(num(r, s_i) for r in rows), sum(num(r, n_i) for r in rows)
    per, whole = items or 1, max(samples, 1)
    out = [f"# {len(rows)} SASS rows, {executed:.0f} warp instructions ({executed / per:.0f} an item), "
           f"{samples:.0f} stall samples"]
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    shares = sorted(((sum(num(r, col[h]) for r in rows) / whole, h) for h in reasons), reverse=True)
    out.append("# stall reasons: " + ", ".join(f"{h[6:]} {100 * f:.1f}%" for f, h in shares[:8]))
    out += ["", "| row | stall samples | executed | instruction |", "|---|---|---|---|"]
    for i in sorted(range(len(rows)), key=lambda i: -num(rows[i], s_i))[:top]:
        out.append(f"| {i} | {100 * num(rows[i], s_i) / whole:.1f}% | {num(rows[i], n_i):.0f} | "
                   f"`{rows[i][col['Source']].strip()[:70]}` |")
    if parts:
        bounds = [(n, int(r)) for n, r in (x.rsplit(":", 1) for x in parts.split(","))]
        out += ["", f"| part | rows | instructions{' an item' if items else ''} | stall samples |", "|---|---|---|---|"]
        for k, (name, first) in enumerate(bounds):
            last = bounds[k + 1][1] if k + 1 < len(bounds) else len(rows)
            part = rows[first:last]
            out.append(f"| {name} | {first}-{last - 1} | {sum(num(r, n_i) for r in part) / per:.0f} | "
                       f"{100 * sum(num(r, s_i) for r in part) / whole:.0f}% |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--items", type=int, default=0, help="work items of the launch: instructions are shown per item")
    p.add_argument("--parts", default="", help='comma list of "name:first_row"')
    p.add_argument("--top", type=int, default=12, help="instructions with the most stall samples to list")
    a = p.parse_args()
    with open(a.csv, newline="") as f:
        hdr, rows = load(f)
    print("\n".join(report(hdr, rows, a.items, a.parts, a.top)))


if __name__ == "__main__":
    main()
