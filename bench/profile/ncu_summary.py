"""One table row per kernel from Nsight Compute's raw CSV (`ncu --csv --page raw --metrics ...`): duration, DRAM and
SM throughput (% of peak), the DRAM bytes read and written, achieved occupancy (warps active), registers,
tensor-pipe use, and the limiter: memory or compute by the larger of the two throughputs, with the warp stall that
dominates (cycles per issued instruction). Two kernels that move the same bytes at different speeds differ in how
they keep the memory busy (e.g. warps active), not in what they move.

    python3 bench/profile/ncu_summary.py LABEL < ncu.csv      # a markdown table, one row per kernel
"""

from __future__ import annotations

import csv
import sys

DURATION = "gpu__time_duration.sum"
DRAM = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
SM = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
L2 = "lts__throughput.avg.pct_of_peak_sustained_elapsed"
OCC = "sm__warps_active.avg.pct_of_peak_sustained_active"
DRAM_READ, DRAM_WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
REGS = "launch__registers_per_thread"
GRID = "launch__grid_size"
TENSOR = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "wait", "mio_throttle", "lg_throttle",
          "math_pipe_throttle", "membar", "no_instruction", "not_selected", "sleeping", "drain", "branch_resolving")
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
METRICS = [DURATION, DRAM, SM, L2, OCC, REGS, GRID, DRAM_READ, DRAM_WRITE] + [STALL.format(s) for s in STALLS]
OPTIONAL = [TENSOR]  # asked for first; where this ncu lacks one, scripts/ncu_regimes.sh reruns without them


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return float("nan")


def _limiter(dram: float, sm: float) -> str:
    """memory or compute where one unit runs above 40% of its peak, else latency (neither is busy)."""
    if max(dram, sm) < 40:
        return "latency"
    return "memory" if dram >= sm else "compute"


def rows(lines) -> list[dict]:
    """The kernels of a raw CSV page: a header line, a units line, then one line per kernel."""
    reader = list(csv.reader(line for line in lines if line.startswith('"')))
    if len(reader) < 3:
        return []
    head, units = reader[0], dict(zip(reader[0], reader[1]))
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    to_us = scale.get(units.get(DURATION, "nsecond"), 1e-3)
    byte_scale = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
    out = []
    for rec in reader[2:]:
        d = dict(zip(head, rec))
        stalls = sorted(((_num(d.get(STALL.format(s), "")), s) for s in STALLS), reverse=True)
        top = [(v, s) for v, s in stalls if v == v][:2]
        us = _num(d.get(DURATION, "")) * to_us
        dram, sm = _num(d.get(DRAM, "")), _num(d.get(SM, ""))
        out.append(dict(kernel=d.get("Kernel Name", "?")[:40], us=us, dram=dram, sm=sm, l2=_num(d.get(L2, "")),
                        occ=_num(d.get(OCC, "")), regs=_num(d.get(REGS, "")), grid=_num(d.get(GRID, "")),
                        tensor=_num(d.get(TENSOR, "")),
                        read_mb=_num(d.get(DRAM_READ, "")) * byte_scale.get(units.get(DRAM_READ, "byte"), 1e-6),
                        write_mb=_num(d.get(DRAM_WRITE, "")) * byte_scale.get(units.get(DRAM_WRITE, "byte"), 1e-6),
                        limiter=_limiter(dram, sm) + ", " +
                        " / ".join(f"{s} {v:.1f}" for v, s in top)))
    return out


def table(label: str, rs: list[dict]) -> str:
    lines = [f"{label}: {len(rs)} kernels, {sum(r['us'] for r in rs):.1f} µs (each alone, caches flushed)", "",
             "| kernel | grid | µs | DRAM % | DRAM MB read / written | SM % | L2 % | tensor % | occupancy % | regs | "
             "limiter (top stalls, cycles per issue) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {r['kernel']} | {r['grid']:.0f} | {r['us']:.1f} | {r['dram']:.1f} | "
                     f"{r['read_mb']:.1f} / {r['write_mb']:.1f} | {r['sm']:.1f} | {r['l2']:.1f} | {r['tensor']:.1f} | "
                     f"{r['occ']:.1f} | {r['regs']:.0f} | {r['limiter']} |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--metrics", "--metrics-all"):
        print(",".join(METRICS + (OPTIONAL if sys.argv[1] == "--metrics-all" else [])))
        return
    label = sys.argv[1] if len(sys.argv) > 1 else "ncu"
    rs = rows(sys.stdin.read().splitlines())
    if not rs:
        print(f"{label}: no kernel rows in the CSV")
        return
    print(table(label, rs))


if __name__ == "__main__":
    main()
