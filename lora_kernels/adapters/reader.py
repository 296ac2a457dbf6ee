"""The direct host-stage reader: a PEFT folder into its packed (pinned) buffer in one pass.

`read_packed` checks the folder from its config and safetensors header alone (`peft.plan_peft_adapter`:
names, shapes, dtypes, ranks; errors name the file and tensor), lays the buffer out (`layout.py`),
allocates it once, and reads every tensor's bytes from the file straight into its place with
`os.preadv`: no intermediate tensors, no second copy. Only where the file cannot land as is does a
tensor go through a small temporary: a dtype other than the store's (cast on the copy), a module rank
below the slot's (rank_pattern: B's columns are strided), or a module scaling that differs from the
slot's (B rescaled in float64). Rows that no tensor writes (module ranks below the slot's, slices the
adapter lacks) are zeroed, since the allocator hands back reused blocks.

Large files are read by `read_threads` threads over disjoint byte ranges: from the page cache one thread
copies at a few GB/s, so a single thread would cap the host stage. A layer-wise read (`progress` given: a
load can copy layer l while later layers are still read) cuts layer 0's tensors, then layer 1's, ... into
pieces of 256 KB that every thread takes in turn, and publishes each complete layer (`progress.py`); with the
extension, its open, reads and close run in one call on kept threads, the GIL released once. With the extension built, one call of its
`pread_into` runs those threads and every read with the GIL released once (without it: a Python thread pool
and one `os.preadv` per tensor, each retaking the GIL, which waits while another thread runs Python: a
worker beside a busy Python thread read a rank-8 adapter in 169 ms that way, 55 ms with one GIL release per
thread, on the development machine).

Where the time went before (CPU profile of the old path, 8-layer Llama-3-8B, rank 8): safetensors
`get_tensor` per tensor, a finite check per tensor (`aminmax`), zeroed accumulators per group plus slice
assignment, then a second full copy into the packed buffer, and for pinned memory a fresh allocation of
the rounded size on every cache miss: a fixed cost of Python and allocation work before the bytes move.
Now: the plan (config + header parse and checks, ~0.7 ms) is cached by the files' bytes that define it,
the byte-level read plan by (plan, dtype), so a read of a known adapter is two small reads, one buffer
from the allocator's cache, and one `pread` per tensor.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_kernels.adapters import layout as lay
from lora_kernels.adapters import tp as _tp
from lora_kernels.adapters.layout import PackedAdapter, new_packed
from lora_kernels.adapters.peft import AdapterFormatError, AdapterPlan, ModuleRead, plan_peft_adapter
from lora_kernels.adapters.progress import LayerProgress
from lora_kernels.adapters.spec import ModelSpec

_PARALLEL_MIN_BYTES = 8 << 20  # below this one thread is as fast (thread hand-off costs ~50 µs)
_readers: ThreadPoolExecutor | None = None
_readers_lock = threading.Lock()


def _reader_pool(n: int) -> ThreadPoolExecutor:
    """One shared pool for every host-stage worker (no thread start per read), grown on demand."""
    global _readers
    with _readers_lock:
        if _readers is None or _readers._max_workers < n:
            _readers = ThreadPoolExecutor(max_workers=n, thread_name_prefix="lora-read")
        return _readers


def planned_nbytes(plan: AdapterPlan, spec: ModelSpec, dtype: torch.dtype, pin: bool, arena=None) -> int:
    """Host bytes the adapter will hold once packed (allocator rounding, or an arena's pages, included)."""
    blocks = lay.packed_layout(spec, plan.rank, plan.keys, dtype.itemsize)
    return lay.held_nbytes(blocks.nbytes, pin, arena)


def read_packed(adapter_id: str, path: str | Path, spec: ModelSpec, dtype: torch.dtype, *, pin: bool,
                max_rank: int | None = None, check_finite: bool = False, read_threads: int = 4,
                plan: AdapterPlan | None = None, progress: LayerProgress | None = None,
                arena=None) -> PackedAdapter:
    """Reads the PEFT folder `path` into a packed buffer (see the module docstring). Raises AdapterFormatError
    naming the adapter's file (and tensor) when the folder is missing, truncated or inconsistent.

    progress: publish the buffer before it is filled and report each layer as it lands (`progress.py`); the
    caller marks it failed if this raises. arena: a `PinnedArena` to carve the buffer from (`layout.new_packed`)."""
    plan = plan or plan_peft_adapter(path, _tp.full_spec(spec), max_rank=max_rank)  # a TP shard: the full model
    blocks = lay.packed_layout(spec, plan.rank, plan.keys, dtype.itemsize)
    packed = new_packed(adapter_id, blocks, plan.scaling, dtype, pin, arena)
    if progress is not None:
        progress.publish(packed)
    err = _fill(plan, spec, packed, dtype, read_threads, check_finite, progress)
    if err is not None:
        del packed  # the buffer goes back to the allocator now, not when the caller drops the error
        raise err
    return packed


@dataclass
class _ReadPlan:
    """Byte-level work of one read, computed once per (plan, dtype) and cached on the plan.

    direct: (file offset, buffer offset, bytes) read straight into place; dup: (from, to, bytes) copies
    inside the buffer after the reads (a fused A written into every slice); zero: (buffer offset, bytes);
    staged: modules needing a temporary (dtype cast, module rank below the slot's, rescaled B)."""

    direct: list[tuple[int, int, int]] = field(default_factory=list)
    dup: list[tuple[int, int, int]] = field(default_factory=list)
    zero: list[tuple[int, int]] = field(default_factory=list)
    staged: list[tuple[ModuleRead, bool]] = field(default_factory=list)  # (module, A?) read via a temporary
    by_layer: list[tuple[int, int, int, int]] | None = None  # direct as (layer, file offset, buffer offset, bytes)


def _direct_by_layer(rp: _ReadPlan, blocks: lay.PackedLayout) -> list[tuple[int, int, int, int]]:
    """rp.direct in layer order (file order within a layer), each read tagged with the layer whose block it fills
    (blocks lie in pool order, layer-major, so a buffer offset names its layer)."""
    if rp.by_layer is None:
        starts = sorted((blocks.a[key].offset, key[0]) for key in blocks.keys)
        offs = [o for o, _ in starts]
        tagged = [(starts[bisect.bisect_right(offs, o) - 1][1], f, o, n) for f, o, n in rp.direct]
        rp.by_layer = sorted(tagged)
    return rp.by_layer


def _read_plan(plan: AdapterPlan, spec: ModelSpec, blocks: lay.PackedLayout, dtype: torch.dtype) -> _ReadPlan:
    if isinstance(spec, _tp.ShardSpec):  # a tensor-parallel rank reads only its rows and columns
        return _tp.read_plan(plan, spec, blocks, dtype)
    rp = plan.reads.get(dtype)
    if rp is not None:
        return rp
    rp, rank, es, covered = _ReadPlan(), plan.rank, blocks.esize, set()
    for m in plan.modules:
        g = spec.group(m.group)
        a_off, b_off = blocks.a[(m.layer, m.group)].offset, blocks.b[(m.layer, m.group)].offset
        slices = list(range(g.num_slices) if m.sl is None else (m.sl,))
        covered.update((m.layer, m.group, i) for i in slices)
        row_a = g.in_dim * es
        if m.a.dtype == dtype:
            first = a_off + slices[0] * rank * row_a
            rp.direct.append((m.a.begin, first, m.rank * row_a))
            rp.dup += [(first, a_off + i * rank * row_a, m.rank * row_a) for i in slices[1:]]
        else:
            rp.staged.append((m, True))
        if m.rank < rank:
            rp.zero += [(a_off + (i * rank + m.rank) * row_a, (rank - m.rank) * row_a) for i in slices]
        offs = g.slice_offsets
        lo, hi = (0, g.out_total) if m.sl is None else (offs[m.sl], offs[m.sl + 1])
        if m.rank == rank and m.factor == 1.0 and m.b.dtype == dtype:
            rp.direct.append((m.b.begin, b_off + lo * rank * es, (hi - lo) * rank * es))
        else:
            rp.staged.append((m, False))  # also zeroes B's columns beyond the module rank
    zero_missing_slices(rp, plan, spec, blocks, covered, rank, es)
    rp.direct.sort()  # file order: sequential reads
    plan.reads[dtype] = rp
    return rp


def zero_missing_slices(rp: _ReadPlan, plan: AdapterPlan, spec: ModelSpec, blocks: lay.PackedLayout, covered,
                        rank: int, es: int) -> None:
    """Adds to rp.zero the A rows and B rows of the slices of a targeted group that the adapter lacks
    (spec: the full model, or a tensor-parallel rank's shard)."""
    for layer, gname in plan.keys:
        g = spec.group(gname)
        a_off, b_off = blocks.a[(layer, gname)].offset, blocks.b[(layer, gname)].offset
        for i in range(g.num_slices):
            if (layer, gname, i) not in covered:
                rp.zero.append((a_off + i * rank * g.in_dim * es, rank * g.in_dim * es))
                lo, hi = g.slice_offsets[i], g.slice_offsets[i + 1]
                rp.zero.append((b_off + lo * rank * es, (hi - lo) * rank * es))


def _fill(plan: AdapterPlan, spec: ModelSpec, packed: PackedAdapter, dtype: torch.dtype, read_threads: int,
          check_finite: bool, progress: LayerProgress | None = None) -> AdapterFormatError | None:
    """Reads the file into the packed buffer; returns (not raises) a format error, stripped of its traceback
    and context: a traceback keeps every frame's locals alive, here the memoryviews of the pinned buffer,
    for as long as the error lives (a failed host stage's future holds it)."""
    try:
        rp = _read_plan(plan, spec, packed.blocks, dtype)
        arr = packed.buffer.numpy()
        mv = memoryview(arr)
        _zero_unwritten(arr, rp)
        by_layer = progress is not None and _in_place(rp, check_finite)
        if by_layer and _native_pread_layers is not None:  # open, reads, close: one GIL release on the worker
            _native_layers(plan.weights_path, packed.buffer, _direct_by_layer(rp, packed.blocks), read_threads,
                           progress)
        else:
            try:
                fd = os.open(plan.weights_path, os.O_RDONLY)
            except OSError as e:
                raise AdapterFormatError(f"{plan.weights_path}: cannot open ({e.strerror})") from None
            try:
                if by_layer:
                    _pread_layers(fd, _direct_by_layer(rp, packed.blocks), mv, plan.weights_path, read_threads,
                                  progress)
                else:
                    _pread_all(fd, [(f, mv[o:o + n]) for f, o, n in rp.direct], plan.weights_path, read_threads)
                for m, is_a in rp.staged:
                    _read_staged(fd, plan, spec, packed, dtype, m, is_a)
            finally:
                os.close(fd)
        for src, dst, n in rp.dup:
            arr[dst:dst + n] = arr[src:src + n]
        if check_finite:
            _check_finite(plan, packed, dtype)
        if progress is not None and not by_layer:
            progress.complete()  # a read with a second pass: every layer at once, now
    except AdapterFormatError as e:
        e.__traceback__ = e.__context__ = e.__cause__ = None
        return e
    return None


def _in_place(rp: _ReadPlan, check_finite: bool) -> bool:
    """True when every byte of the read lands in place and nothing reads the buffer again (no dtype cast, fused A
    written into several slices, rescaled B or finite check): only such a read can report layer by layer."""
    return not (rp.dup or rp.staged or check_finite)


def _zero_unwritten(arr, rp: _ReadPlan) -> None:
    """Zeroes the buffer's rows no tensor writes: the allocator (or the arena) hands back reused bytes."""
    for off, n in rp.zero:
        arr[off:off + n] = 0


def _native_layers(path: Path, buffer: torch.Tensor, reads: list[tuple[int, int, int, int]], threads: int,
                   progress: LayerProgress) -> None:
    """The extension's layer-wise read: the file opened, read by every thread layer by layer (each complete layer
    published into progress.flag as it lands) and closed, with the GIL released once."""
    outcome = _native_pread_layers(str(path), buffer.numpy(), reads, progress.layers, max(1, threads),
                                   progress.flag.numpy())
    _layers_outcome(path, reads, progress, outcome)


def _layers_outcome(path: Path, reads: list[tuple[int, int, int, int]], progress: LayerProgress, outcome) -> None:
    """Records a native layer-wise read's layer times; raises its failure as AdapterFormatError naming the file."""
    failed, times = outcome
    progress.record(times)
    if failed is not None:
        i, at, err = failed
        if i < 0:
            raise AdapterFormatError(f"{path}: cannot open ({os.strerror(err)})")
        raise _read_error(path, at, err, reads[i][1] + reads[i][3])


class PendingRead:
    """A layer-wise read running on the extension's kept threads (`start_packed`); `wait()` ends it."""

    def __init__(self, packed: PackedAdapter, handle, path: Path, reads: list[tuple[int, int, int, int]],
                 progress: LayerProgress):
        self.packed, self.progress = packed, progress
        self._handle, self._path, self._reads = handle, path, reads

    def wait(self) -> PackedAdapter:
        """The packed adapter once every layer is in place (the GIL released while it waits); raises
        AdapterFormatError naming the file if the read failed (the caller marks the progress failed)."""
        handle, self._handle = self._handle, None
        if handle is None:
            raise RuntimeError("PendingRead.wait: already waited for")
        try:
            _layers_outcome(self._path, self._reads, self.progress, _native_wait(handle))
        except AdapterFormatError:
            self.packed = None  # the error's traceback holds this frame: the pinned buffer must not stay with it
            raise
        return self.packed


def start_packed(adapter_id: str, spec: ModelSpec, dtype: torch.dtype, *, pin: bool, plan: AdapterPlan,
                 read_threads: int, progress: LayerProgress, arena=None,
                 check_finite: bool = False) -> PendingRead | None:
    """`read_packed(..., progress=progress)` started on the extension's kept reader threads, returning at once; None
    where that read cannot run there (no extension, or a read with a second pass: `read_packed` then does it).

    The caller's thread lays out, allocates and publishes the buffer (about 0.1 ms); the bytes start to move before
    it returns. A worker thread that started the read instead would first wait for the GIL (a serving engine's
    scheduler thread holds it while it runs Python): on the H200 host a rank-8 stage's first layer landed 0.69 ms after
    its submit that way beside a busy thread, 0.30 ms alone (`bench/profile/host_stage_parts.py`)."""
    if _native_start is None or isinstance(spec, _tp.ShardSpec):
        return None
    blocks = lay.packed_layout(spec, plan.rank, plan.keys, dtype.itemsize)
    rp = _read_plan(plan, spec, blocks, dtype)
    if not _in_place(rp, check_finite):
        return None
    packed = new_packed(adapter_id, blocks, plan.scaling, dtype, pin, arena)
    arr = packed.buffer.numpy()
    _zero_unwritten(arr, rp)
    progress.publish(packed)
    reads = _direct_by_layer(rp, blocks)
    handle = _native_start(str(plan.weights_path), arr, reads, progress.layers, max(1, read_threads),
                           progress.flag.numpy())
    return PendingRead(packed, handle, plan.weights_path, reads, progress)


def _pread_layers(fd: int, reads: list[tuple[int, int, int, int]], mv: memoryview, path: Path, threads: int,
                  progress: LayerProgress) -> None:
    """The direct reads layer by layer, reporting each complete layer (Python fallback of `_native_layers`)."""
    layers = progress.layers
    k = 0
    for layer in range(layers):
        jobs = []
        while k < len(reads) and reads[k][0] == layer:
            _, f, o, n = reads[k]
            jobs.append((f, mv[o:o + n]))
            k += 1
        if jobs:
            _pread_all(fd, jobs, path, threads)
        progress.reached(layer + 1, time.monotonic())


def _read_staged(fd: int, plan: AdapterPlan, spec: ModelSpec, packed: PackedAdapter, dtype: torch.dtype,
                 m: ModuleRead, is_a: bool) -> None:
    """One tensor through a temporary of the file's dtype: cast (A), or cast, rescale in float64 and place
    into B's first m.rank columns, zeroing the rest (B)."""
    if isinstance(spec, _tp.ShardSpec):
        return _tp.read_staged(fd, plan, spec, packed, dtype, m, is_a)
    g, rank = spec.group(m.group), plan.rank
    e = m.a if is_a else m.b
    tmp = torch.empty(e.shape, dtype=e.dtype)
    _pread_all(fd, [(e.begin, _mv(tmp))], plan.weights_path, 1)
    if is_a:
        a = packed.a[(m.layer, m.group)].view(dtype).view(g.num_slices * rank, g.in_dim)
        for i in (range(g.num_slices) if m.sl is None else (m.sl,)):
            a[i * rank:i * rank + m.rank].copy_(tmp)  # casts: one rounding, as via float64
        return
    b = packed.b[(m.layer, m.group)].view(dtype).view(g.out_total, rank)
    offs = g.slice_offsets
    lo, hi = (0, g.out_total) if m.sl is None else (offs[m.sl], offs[m.sl + 1])
    b[lo:hi, :m.rank].copy_(tmp if m.factor == 1.0 else tmp.double() * m.factor)  # rescaled in float64, cast once
    b[lo:hi, m.rank:].zero_()


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def _pread_all(fd: int, jobs: list[tuple[int, memoryview]], path: Path, threads: int) -> None:
    total = sum(mv.nbytes for _, mv in jobs)
    if threads <= 1 or total < _PARALLEL_MIN_BYTES or len(jobs) < 2:
        threads = 1
    if _pread_into is not None:  # the extension's threads, the GIL released once for all of them
        _pread_jobs(fd, jobs, path, threads)
        return
    if threads == 1:
        _pread_jobs(fd, jobs, path)
        return
    chunks, cur, acc, per = [], [], 0, total / threads
    for job in jobs:  # contiguous runs of about total/threads bytes each
        cur.append(job)
        acc += job[1].nbytes
        if acc >= per * (len(chunks) + 1) and len(chunks) < threads - 1:
            chunks.append(cur)
            cur = []
    chunks.append(cur)
    futures = [_reader_pool(threads).submit(_pread_jobs, fd, c, path) for c in chunks[1:] if c]
    try:
        _pread_jobs(fd, chunks[0], path)  # this thread reads the first run itself
    finally:
        errors = [f.exception() for f in futures]  # waits for all: none may still write after we return
    for e in errors:
        if e is not None:
            raise e


try:  # the extension's reader: every read of a job list with the GIL released (csrc/host/file_reads.cpp)
    from lora_kernels._C import pread_into as _pread_into
    from lora_kernels._C import pread_layers as _native_pread_layers
except ImportError:
    _pread_into = _native_pread_layers = None
try:  # the same read started on the extension's kept threads, and its end
    from lora_kernels._C import pread_layers_start as _native_start
    from lora_kernels._C import pread_layers_wait as _native_wait
except ImportError:
    _native_start = _native_wait = None


def _read_error(path: Path, at: int, err: int, end: int) -> AdapterFormatError:
    """The error of a read that failed at file byte `at` with errno `err` (0: end of file, the file shrank after
    its header was read) in a tensor ending at byte `end`."""
    if err:
        return AdapterFormatError(f"{path}: read failed at byte {at} ({os.strerror(err)})")
    return AdapterFormatError(f"{path}: file truncated while reading (byte {at} of a tensor ending at {end})")


def _pread_jobs(fd: int, jobs: list[tuple[int, memoryview]], path: Path, threads: int = 1) -> None:
    if _pread_into is not None:
        failed = _pread_into(fd, jobs, threads)
        if failed is not None:
            i, at, err = failed
            raise _read_error(path, at, err, jobs[i][0] + jobs[i][1].nbytes)
        return
    for offset, mv in jobs:
        done = 0
        while done < mv.nbytes:
            try:
                n = os.preadv(fd, [mv[done:]], offset + done)
            except OSError as e:
                raise _read_error(path, offset + done, e.errno, offset + mv.nbytes) from None
            if n == 0:
                raise _read_error(path, offset + done, 0, offset + mv.nbytes)
            done += n


def _check_finite(plan: AdapterPlan, packed: PackedAdapter, dtype: torch.dtype) -> None:
    for key in plan.keys:
        for view in (packed.a[key], packed.b[key]):
            t = view.view(dtype)
            lo, hi = torch.aminmax(t)
            if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
                raise AdapterFormatError(f"{plan.weights_path}: non-finite values in layer {key[0]} {key[1]} "
                                         f"of adapter folder {plan.folder}")

