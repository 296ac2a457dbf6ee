"""Kernel launches with a small host cost.

Triton's `kernel[grid](...)` binds and specializes every argument in Python on each call (tens of µs).
The first launch for a plan and grid goes that way; the CompiledKernel it returns is kept in the plan
and later launches call its launcher (`CompiledKernel.run`, the C launch) directly on the current stream.
That skips the CompiledKernel runner, which builds a launch-metadata dict and has the C launch call two Python
hook chains on every launch even when they are empty (µs per launch); while a hook is registered (a profiler
such as proton), launches go through the runner so that it sees them. Where the launcher is Triton 3.6's form and
the kernel needs no scratch memory, the launcher's own C launch is called directly (`_c_launch`): its Python
wrapper only allocates scratch buffers, and costs ~2 µs a launch (host_breakdown.py: 7.1 µs a cached launch).
The cache key holds what Triton specializes on and the plan does not already fix: each pointer's 16-byte
alignment, the device, the grid and the caller's variant tag. Never under TRITON_INTERPRET (there every launch is
interpreted).
"""

from __future__ import annotations

import inspect
import os

from lora_kernels.batch_info import _raw_stream

try:
    from triton import knobs as _knobs

    _RT = _knobs.runtime
    _RT.launch_enter_hook.calls, _RT.launch_exit_hook.calls  # hook chains with a list of hooks (Triton 3.4+)
except (ImportError, AttributeError):  # another Triton: cached launches through the runner
    _RT = None


def _hooks_empty() -> bool:
    return _RT is not None and not (_RT.launch_enter_hook.calls or _RT.launch_exit_hook.calls)


# Triton 3.6's CudaLauncher.__call__ parameters: it allocates the scratch buffers the kernel asks for (none: None) and
# calls launch(gridX, gridY, gridZ, stream, function, cooperative, pdl, global_scratch, profile_scratch, *args).
_LAUNCHER_36 = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]


def _c_launch(run):
    """(launch, cooperative, pdl) of the compiled launcher `run` where calling launch directly is what its __call__
    does (Triton 3.6's form, no scratch memory); else None (other Triton versions go through __call__)."""
    try:
        if list(inspect.signature(type(run).__call__).parameters) != _LAUNCHER_36:
            return None
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        return run.launch, run.launch_cooperative_grid, run.launch_pdl
    except (AttributeError, TypeError, ValueError):
        return None


FAST = (os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        and os.environ.get("LORA_KERNELS_TRITON_FAST_LAUNCH", "1") != "0")


def launch(fn, runs: dict, tag, grid: tuple, tensors: tuple, scalars: tuple, kw: dict) -> None:
    """fn[grid](*tensors, *scalars, **kw); `runs` is the plan's cache of compiled launchers.

    The kernel's parameters must be its tensors, then its runtime scalars, then its constexprs.
    """
    if FAST:
        dev = tensors[0].device.index
        ptrs = [t.data_ptr() for t in tensors]
        low = 0
        for p in ptrs:
            low |= p
        # Every pointer 16-byte aligned (the usual case) is one key; otherwise each pointer's low bits join it.
        key = (tag, dev, grid) if low & 15 == 0 else (tag, dev, grid, *[p & 15 for p in ptrs])
        hit = runs.get(key)
        if hit is not None:
            runner, consts, run, grid3, function, meta, c = hit
            if _hooks_empty():
                # The C launch with no launch metadata and no hooks (None: not called), and the pointers as ints:
                # for a tensor the launcher calls data_ptr() and asks the driver about the pointer
                # (cuPointerGetAttribute), per argument and launch; the ops validated these tensors (CUDA, this
                # device) before.
                if c is not None:
                    c[0](*grid3, _raw_stream(dev), function, c[1], c[2], None, None, meta, None, None, None, *ptrs,
                         *scalars, *consts)
                else:
                    run(*grid3, _raw_stream(dev), function, meta, None, None, None, *ptrs, *scalars, *consts)
            else:
                runner(*tensors, *scalars, *consts, stream=_raw_stream(dev))
            return
    compiled = fn[grid](*tensors, *scalars, **kw)
    if FAST and compiled is not None:
        names = fn.arg_names[len(tensors) + len(scalars):]
        grid3 = tuple(grid) + (1,) * (3 - len(grid))  # the compiled runner reads grid[0], grid[1], grid[2]
        runner = compiled[grid3]  # loads the module (function handle) if needed
        runs[key] = (runner, tuple(kw[n] for n in names), compiled.run, grid3, compiled.function,
                     compiled.packed_metadata, _c_launch(compiled.run))
