"""Kernel launches with a small host cost.

Triton's `kernel[grid](...)` binds and specializes every argument in Python on each call (tens of µs).
The first launch for a plan and grid goes that way; the CompiledKernel it returns is kept in the plan
and later launches call its runner directly on the current stream. The cache key holds what Triton
specializes on and the plan does not already fix: each pointer's 16-byte alignment, the device, the
grid and the caller's variant tag. Never under TRITON_INTERPRET (there every launch is interpreted).
"""

from __future__ import annotations

import os

from lora_kernels.batch_info import _raw_stream

FAST = (os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        and os.environ.get("LORA_KERNELS_TRITON_FAST_LAUNCH", "1") != "0")


def launch(fn, runs: dict, tag, grid: tuple, tensors: tuple, scalars: tuple, kw: dict) -> None:
    """fn[grid](*tensors, *scalars, **kw); `runs` is the plan's cache of compiled launchers.

    The kernel's parameters must be its tensors, then its runtime scalars, then its constexprs.
    """
    if FAST:
        dev = tensors[0].device.index
        key = (tag, dev, grid, *[t.data_ptr() & 15 for t in tensors])
        hit = runs.get(key)
        if hit is not None:
            runner, consts = hit
            runner(*tensors, *scalars, *consts, stream=_raw_stream(dev))
            return
    compiled = fn[grid](*tensors, *scalars, **kw)
    if FAST and compiled is not None:
        names = fn.arg_names[len(tensors) + len(scalars):]
        grid3 = tuple(grid) + (1,) * (3 - len(grid))  # the compiled runner reads grid[0], grid[1], grid[2]
        runs[key] = (compiled[grid3], tuple(kw[n] for n in names))
