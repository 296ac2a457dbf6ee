"""`auto`: the backend that the generated table (tables.AUTO) measured fastest for the batch's regime."""

from __future__ import annotations

import torch

from lora_kernels import backends
from lora_kernels.backends import tables

ONE_SEGMENT_MIN_ROWS = 16
PREFILL_ROWS = 2048
# Batches of segments longer than one row, from this many rows below PREFILL_ROWS: a chunked-prefill step (a prefill
# chunk beside decode rows) in practice, where sorted decode batches (short segments) stay below it. The kernels that
# win the two differ, so each has its table entry. By rows, not max_seg_len: in graph mode that is the token capacity.
CHUNKED_MIN_ROWS = 512


def regime(info) -> str:
    """decode (one row per segment), one_segment (one adapter, >= 16 rows), prefill (>= 2048 rows), chunked (>= 512
    rows) or mixed (fewer: a sorted decode batch)."""
    if info.num_segments == 1 and info.num_tokens >= ONE_SEGMENT_MIN_ROWS:
        return "one_segment"
    if info.max_seg_len <= 1:
        return "decode"
    if info.num_tokens >= PREFILL_ROWS:
        return "prefill"
    return "chunked" if info.num_tokens >= CHUNKED_MIN_ROWS else "mixed"


def choose(device: torch.device, info=None) -> str:
    """Never raises: falls back to Triton, then the extension, then torch, whichever can run on `device`.
    Memoized per (device, regime) for the current table object (an engine calls this per module and layer:
    the availability checks cost µs of host time, and availability does not change in a process)."""
    if device.type != "cuda":
        return "torch"
    if _memo[0] is not tables.AUTO:
        _memo[0], _memo[1] = tables.AUTO, {}
    key = (device, regime(info) if info is not None else None)
    name = _memo[1].get(key)
    if name is None:
        name = _memo[1][key] = _first_available(device, ([tables.AUTO[key[1]]] if info is not None else []))
    return name


_memo: list = [None, {}]  # [the tables.AUTO object the memo was made for, {(device, regime): backend}]


def _first_available(device: torch.device, preferred: list) -> str:
    for name in preferred + ["triton", "cuda"]:
        if backends.unavailable(name, device) is None:
            return name
    return "torch"
