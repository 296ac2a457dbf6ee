"""Counts synchronizing CUDA calls inside the "batch_prep" NVTX ranges of an nsys SQLite export, and the
GPU idle time between GPU operations (the same report as torch_profile.py). Exit 1 if any sync is found,
2 if there is nothing to verify.

    python bench/profile/nsys_sync_check.py out/profile/lora_batch_prep.sqlite
"""

from __future__ import annotations

import sqlite3
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import analysis  # noqa: E402
from analysis import PREP  # noqa: E402

DTOH = 2  # CUPTI_ACTIVITY_MEMCPY_KIND_DTOH


def rows(db, sql):
    try:
        return db.execute(sql).fetchall()
    except sqlite3.OperationalError:  # the table is absent when nsys recorded no such activity
        return []


def main(path: str) -> int:
    db = sqlite3.connect(path)
    prep = {}
    for start, end, tid in rows(db, f"""SELECT e.start, e.end, e.globalTid FROM NVTX_EVENTS e
            LEFT JOIN StringIds s ON e.textId = s.id WHERE COALESCE(e.text, s.value) = '{PREP}'
            AND e.end IS NOT NULL"""):
        prep.setdefault(tid, []).append((start, end))
    d2h = {c for (c,) in rows(db, f"SELECT correlationId FROM CUPTI_ACTIVITY_KIND_MEMCPY WHERE copyKind = {DTOH}")}
    calls = {}
    for start, end, tid, name, corr in rows(db, """SELECT r.start, r.end, r.globalTid, s.value, r.correlationId
            FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s ON r.nameId = s.id"""):
        calls.setdefault(tid, []).append((start, end, (name, corr)))
    inside = []
    for tid, ranges in prep.items():
        inside += analysis.calls_in_ranges(ranges, calls.get(tid, []))
    syncs = Counter(name for name, corr in inside if analysis.is_sync_call(name) or corr in d2h)
    gpu = []
    for table in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET"):
        gpu += rows(db, f"SELECT start, end FROM {table}")
    kernels = rows(db, "SELECT start, end FROM CUPTI_ACTIVITY_KIND_KERNEL")
    all_prep = [r for ranges in prep.values() for r in ranges]
    us = lambda xs: [(s / 1e3, e / 1e3) for s, e in xs]  # noqa: E731  (nsys times are ns)
    g = analysis.gap_stats(us(gpu), us(all_prep), us(kernels))
    print(f"batch-prep ranges: {len(all_prep)}; CUDA calls inside them: {len(inside)}")
    print(f"synchronizing calls in batch preparation: {sum(syncs.values())} {dict(syncs) or ''}")
    print(f"GPU: {g['gpu_ops']} ops, idle {g['idle_total']:.0f} us of {g['window']:.0f} us in {g['gaps']} gaps "
          f"(median {g['gap_median']:.1f} us, max {g['gap_max']:.1f} us); per step, batch-prep range "
          f"median {g['prep_median']:.1f} us, GPU bubble from the previous step's last op to this step's first "
          f"kernel median {g['prep_bubble_median']:.1f} us ({g['prep_bubbles']} steps)")
    if not all_prep or not inside:
        print("FAIL: no batch-prep range with CUDA calls inside; cannot verify")
        return 2
    return 1 if syncs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
