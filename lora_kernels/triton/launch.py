"""Kernel launches with a small host cost.

Triton's `kernel[grid](...)` binds and specializes every argument in Python on each call (tens of µs
for these ~25-argument kernels). The first launch for a plan goes that way; the CompiledKernel it
returns is then kept in the plan and later launches call it directly. The cache key holds what
Triton specializes on and the plan does not already fix: each pointer's 16-byte alignment, the
device, and the caller's variant tag.

Opt-in for now (LORA_KERNELS_TRITON_FAST_LAUNCH=1): its first device run failed on a 2-D grid
(CompiledKernel's runner indexes grid[2]; fixed below by padding the grid), and the fix has not been
run on a GPU yet. Never under TRITON_INTERPRET.
"""

from __future__ import annotations

import os

import torch

FAST = (os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        and os.environ.get("LORA_KERNELS_TRITON_FAST_LAUNCH", "0") == "1")


def launch(fn, runs: dict, tag, grid: tuple, tensors: tuple, scalars: tuple, kw: dict) -> None:
    """fn[grid](*tensors, *scalars, **kw); `runs` is the plan's cache of compiled launchers.

    The kernel's parameters must be its tensors, then its runtime scalars, then its constexprs.
    """
    if FAST:
        key = (tag, torch.cuda.current_device(), *[t.data_ptr() & 15 for t in tensors])
        hit = runs.get(key)
        if hit is not None:
            runner, consts = hit
            runner(*tensors, *scalars, *consts)
            return
    compiled = fn[grid](*tensors, *scalars, **kw)
    if FAST and compiled is not None:
        names = fn.arg_names[len(tensors) + len(scalars):]
        grid3 = tuple(grid) + (1,) * (3 - len(grid))  # the compiled runner reads grid[0], grid[1], grid[2]
        runs[key] = (compiled[grid3], tuple(kw[n] for n in names))
