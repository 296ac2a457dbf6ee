"""What both profilers report, from plain (start, end) intervals: synchronizing CUDA calls inside the
batch-preparation ranges, and GPU idle time between consecutive GPU operations."""

from __future__ import annotations

import bisect
import statistics

PREP = "batch_prep"  # the range around each batch preparation, in both profilers' traces

# Runtime/driver calls that make the host wait for the GPU. A device-to-host copy is added by the callers
# (they tell D2H from H2D through the copy's correlated GPU activity).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaMemcpy2D", "cudaFree", "cudaFreeHost", "cuStreamSynchronize", "cuCtxSynchronize",
              "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpyDtoH_v2", "cuMemFree", "cuMemFree_v2")


def is_sync_call(name: str) -> bool:
    """True for a synchronizing call; nsys appends a version (cudaStreamSynchronize_v3020), torch does not."""
    base = name.split("_v")[0] if name.startswith("cuda") else name
    return base in SYNC_CALLS or name in SYNC_CALLS


def calls_in_ranges(ranges: list[tuple[float, float]], calls: list[tuple[float, float, object]]) -> list:
    """The calls (start, end, payload) that lie inside one of the (start, end) ranges (same thread assumed)."""
    ranges = sorted(ranges)
    starts = [r[0] for r in ranges]
    out = []
    for start, end, payload in calls:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and end <= ranges[i][1]:
            out.append(payload)
    return out


def gap_stats(ops: list[tuple[float, float]], ranges: list[tuple[float, float]],
              kernels: list[tuple[float, float]] | None = None) -> dict:
    """GPU idle time between consecutive GPU operations (any stream), in the units given: total, median and
    largest gap; and, per batch-preparation range, the idle time from the GPU's last operation before the
    range to the first kernel that starts after it, less any GPU work in between (the bubble a step's
    preparation and launch leave on the GPU), with the preparation ranges' own median length."""
    ops = sorted(ops)
    gaps = []
    busy_until = ops[0][1] if ops else 0.0
    prefix_end = [busy_until]  # latest end among ops[:i+1]
    for start, end in ops[1:]:
        if start > busy_until:
            gaps.append(start - busy_until)
        busy_until = max(busy_until, end)
        prefix_end.append(busy_until)
    starts = [o[0] for o in ops]
    kstarts = sorted(k[0] for k in (ops if kernels is None else kernels))
    bubbles = []
    for r0, r1 in ranges:
        i = bisect.bisect_left(starts, r0)
        j = bisect.bisect_left(kstarts, r1)
        if i == 0 or j == len(kstarts):
            continue
        a, b = prefix_end[i - 1], kstarts[j]
        busy, covered = 0.0, a
        for start, end in ops[i:]:
            if start >= b:
                break
            lo, hi = max(start, covered), min(end, b)
            if hi > lo:
                busy += hi - lo
                covered = hi
        bubbles.append(max(b - a - busy, 0.0))
    return {"gpu_ops": len(ops), "gaps": len(gaps), "idle_total": sum(gaps),
            "window": (busy_until - ops[0][0]) if ops else 0.0,
            "gap_median": statistics.median(gaps) if gaps else 0.0, "gap_max": max(gaps, default=0.0),
            "prep_bubble_median": statistics.median(bubbles) if bubbles else 0.0, "prep_bubbles": len(bubbles),
            "prep_median": statistics.median(r1 - r0 for r0, r1 in ranges) if ranges else 0.0}
