"""`auto`: the backend that the generated table (tables.AUTO) measured fastest for the batch's regime."""

from __future__ import annotations

import torch

from lora_kernels import backends
from lora_kernels.backends import tables

ONE_SEGMENT_MIN_ROWS = 16
PREFILL_ROWS = 2048


def regime(info) -> str:
    """decode (one row per segment), one_segment (one adapter, >= 16 rows), prefill (>= 2048 rows) or mixed."""
    if info.num_segments == 1 and info.num_tokens >= ONE_SEGMENT_MIN_ROWS:
        return "one_segment"
    if info.max_seg_len <= 1:
        return "decode"
    return "prefill" if info.num_tokens >= PREFILL_ROWS else "mixed"


def choose(device: torch.device, info=None) -> str:
    """Never raises: falls back to Triton, then the extension, then torch, whichever can run on `device`."""
    if device.type != "cuda":
        return "torch"
    order = ([tables.AUTO[regime(info)]] if info is not None else []) + ["triton", "cuda"]
    for name in order:
        if backends.unavailable(name, device) is None:
            return name
    return "torch"
