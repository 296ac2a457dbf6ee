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


def gap_stats(ops: list[tuple[float, float]], ranges: list[tuple[float, float]]) -> dict:
    """GPU idle time between consecutive GPU operations (any stream), in the units given: the total, the
    median and largest gap, and the median idle gap that spans a batch-preparation range (the GPU waiting
    for the host to prepare the next batch)."""
    ops = sorted(ops)
    gaps = []  # (idle start, idle end)
    busy_until = ops[0][1] if ops else 0.0
    for start, end in ops[1:]:
        if start > busy_until:
            gaps.append((busy_until, start))
        busy_until = max(busy_until, end)
    spanning = []
    for r0, r1 in ranges:
        for g0, g1 in gaps:
            if g0 <= r1 and g1 >= r0:  # the idle period overlaps this preparation
                spanning.append(g1 - g0)
                break
    lengths = [g1 - g0 for g0, g1 in gaps]
    return {"gpu_ops": len(ops), "gaps": len(gaps), "idle_total": sum(lengths),
            "window": (busy_until - ops[0][0]) if ops else 0.0,
            "gap_median": statistics.median(lengths) if lengths else 0.0, "gap_max": max(lengths, default=0.0),
            "prep_gap_median": statistics.median(spanning) if spanning else 0.0, "prep_gaps": len(spanning)}
