"""Kernel launches with a small host cost.

Triton's `kernel[grid](...)` binds and specializes every argument in Python on each call (tens of µs).
The first launch for a plan and grid goes that way; the CompiledKernel it returns is kept in the plan
and later launches call its launcher (`CompiledKernel.run`, the C launch) directly on the current stream.
That skips the CompiledKernel runner, which builds a launch-metadata dict and has the C launch call two Python
hook chains on every launch even when they are empty (µs per launch); while a hook is registered (a profiler
such as proton), launches go through the runner so that it sees them. The cache key holds what Triton
specializes on and the plan does not already fix: each pointer's 16-byte alignment, the device, the
grid and the caller's variant tag. Never under TRITON_INTERPRET (there every launch is interpreted).
"""

from __future__ import annotations

import os

from lora_kernels.batch_info import _raw_stream

try:
    from triton import knobs as _knobs
except ImportError:  # an older Triton: always the runner
    _knobs = None


def _hooks_empty() -> bool:
    rt = getattr(_knobs, "runtime", None)
    hooks = (getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None))
    return rt is not None and all(h is None or not getattr(h, "calls", True) for h in hooks)


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
            runner, consts, run, grid3, function, meta = hit
            if _hooks_empty():  # the C launch with no launch metadata and no hooks (None: not called)
                run(*grid3, _raw_stream(dev), function, meta, None, None, None, *tensors, *scalars, *consts)
            else:
                runner(*tensors, *scalars, *consts, stream=_raw_stream(dev))
            return
    compiled = fn[grid](*tensors, *scalars, **kw)
    if FAST and compiled is not None:
        names = fn.arg_names[len(tensors) + len(scalars):]
        grid3 = tuple(grid) + (1,) * (3 - len(grid))  # the compiled runner reads grid[0], grid[1], grid[2]
        runner = compiled[grid3]  # loads the module (function handle) if needed
        runs[key] = (runner, tuple(kw[n] for n in names), compiled.run, grid3, compiled.function,
                     compiled.packed_metadata)
