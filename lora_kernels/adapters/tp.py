"""Tensor-parallel sharding of LoRA adapters (docs/tensor_parallel.md).

Each rank of a tensor-parallel group holds the LoRA weights that match its shard of the base layers
(Megatron-style TP: column-parallel qkv and gate_up, row-parallel o and down):

    group      base layer          lora_a [S*r, in]                lora_b [out, r]
    qkv_proj   column-parallel     replicated                      this rank's rows: its q heads, its kv heads
    gate_up    column-parallel     replicated                      this rank's rows of gate and of up
    o_proj     row-parallel        this rank's input columns       replicated
    down_proj  row-parallel        this rank's input columns       replicated

so a rank computes `(x_k A_kᵀ) B_kᵀ` with tensors it already has (its input shard x_k) and adds it to
its partial output before the base layer's all-reduce (row-parallel) or into its own output columns
(column-parallel): LoRA needs no collective of its own.

The per-rank shapes are exactly those of a smaller model: num_heads, num_kv_heads and intermediate
divided by tp_size, hidden and head_dim kept. `shard_spec` returns that model as a `ShardSpec` (a
`ModelSpec` that also remembers the full model and (tp_rank, tp_size)), so the pool, the host store
and the loader, given a `ShardSpec`, size and pack per-rank tensors with no other change, and two
ranks' specs never compare equal (a store of rank 0 cannot feed a pool of rank 1).

KV heads fewer than ranks (e.g. 8 KV heads at TP=16) are replicated, as the base layer does: when
tp_size is a multiple of num_kv_heads, rank k holds KV head k // (tp_size // num_kv_heads), the one
its query heads attend to. Any other non-divisible dimension is refused with its name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lora_kernels.adapters.spec import ModelSpec

COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _check_tp(tp_rank, tp_size) -> None:
    for name, v in (("tp_rank", tp_rank), ("tp_size", tp_size)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"need tp_size >= 1 and 0 <= tp_rank < tp_size, got tp_rank={tp_rank}, tp_size={tp_size}")


@dataclass(frozen=True)
class ShardSpec(ModelSpec):
    """The per-rank model of `full` at (tp_rank, tp_size): build it with `shard_spec`."""

    tp_rank: int
    tp_size: int
    full: ModelSpec

    def __post_init__(self):
        # ModelSpec's check covers every field (tp_rank may be 0); the shard dims come from a checked
        # full spec, so only the TP fields need checking here.
        _check_tp(self.tp_rank, self.tp_size)
        if isinstance(self.full, ShardSpec) or not isinstance(self.full, ModelSpec):
            raise TypeError(f"ShardSpec.full must be an unsharded ModelSpec, got {self.full!r}")

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold each KV head (1 = KV heads sharded, no replication)."""
        return max(1, self.tp_size // self.full.num_kv_heads)

    def with_layers(self, layers: int) -> "ShardSpec":
        return shard_spec(self.full.with_layers(layers), self.tp_rank, self.tp_size)


def shard_spec(spec: ModelSpec, tp_rank: int = 0, tp_size: int = 1) -> ModelSpec:
    """The model one rank holds: `spec` itself at tp_size 1, else a `ShardSpec`.

    Raises ValueError naming the dimension when num_heads or intermediate is not divisible by
    tp_size, or num_kv_heads neither divides by tp_size nor divides it (no even replication).
    A `ShardSpec` passes through when it already is this (tp_rank, tp_size) shard.
    """
    _check_tp(tp_rank, tp_size)
    if isinstance(spec, ShardSpec):
        if (spec.tp_rank, spec.tp_size) != (tp_rank, tp_size) and tp_size != 1:
            raise ValueError(f"spec is already the shard tp_rank={spec.tp_rank}, tp_size={spec.tp_size}; "
                             f"cannot shard it again as tp_rank={tp_rank}, tp_size={tp_size}")
        return spec
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    if tp_size == 1:
        return spec
    for name in ("num_heads", "intermediate"):
        if getattr(spec, name) % tp_size:
            raise ValueError(f"ModelSpec.{name}={getattr(spec, name)} is not divisible by tp_size={tp_size}")
    kv = spec.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"ModelSpec.num_kv_heads={kv} is neither divisible by tp_size={tp_size} nor divides it "
                         f"(KV heads can be sharded evenly or replicated evenly, not both)")
    return ShardSpec(layers=spec.layers, hidden=spec.hidden, intermediate=spec.intermediate // tp_size,
                     num_heads=spec.num_heads // tp_size, num_kv_heads=max(1, kv // tp_size),
                     head_dim=spec.head_dim, tp_rank=tp_rank, tp_size=tp_size, full=spec)


def full_spec(spec: ModelSpec) -> ModelSpec:
    """The unsharded model of `spec` (itself when it is not a shard)."""
    return spec.full if isinstance(spec, ShardSpec) else spec


def tp_of(spec: ModelSpec) -> tuple[int, int]:
    """(tp_rank, tp_size) of `spec`: (0, 1) when it is not a shard."""
    return (spec.tp_rank, spec.tp_size) if isinstance(spec, ShardSpec) else (0, 1)


def split_spec(spec: ModelSpec, tp_rank: int = 0, tp_size: int = 1) -> tuple[ModelSpec, ShardSpec | None]:
    """(full spec, shard or None) for a loader given either a full spec and (tp_rank, tp_size) or a ShardSpec."""
    shard = shard_spec(spec, tp_rank, tp_size)
    return full_spec(shard), shard if isinstance(shard, ShardSpec) else None


@dataclass(frozen=True)
class GroupShard:
    """Which part of one module group's full tensors a rank holds.

    rows: [lo, hi) ranges of the full output dimension (lora_b rows, base weight rows), one per slice,
    concatenated in this order they form the shard's slices; cols: the [lo, hi) range of the full input
    dimension (lora_a columns, base weight columns). Column-parallel groups keep every column,
    row-parallel groups every row.
    """

    name: str
    parallel: str  # "column" | "row"
    rows: tuple[tuple[int, int], ...]
    cols: tuple[int, int]

    def take_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full [out_total, ...] tensor (lora_b, a base weight), contiguous."""
        if len(self.rows) == 1 and self.rows[0] == (0, t.shape[0]):
            return t
        return torch.cat([t[lo:hi] for lo, hi in self.rows])

    def take_cols(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's columns of a full [..., in_dim] tensor (lora_a, a base weight), contiguous."""
        lo, hi = self.cols
        return t if (lo, hi) == (0, t.shape[-1]) else t[..., lo:hi].contiguous()

    def take_outputs(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full output [..., out_total] of the group (its output columns), contiguous."""
        if len(self.rows) == 1 and self.rows[0] == (0, t.shape[-1]):
            return t
        return torch.cat([t[..., lo:hi] for lo, hi in self.rows], dim=-1)

    def take_weight(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's block of the base layer's full weight [out_total, in_dim] (for tests and examples)."""
        return self.take_cols(self.take_rows(w))


@functools.lru_cache(maxsize=64)
def group_shards(shard: ShardSpec) -> dict[str, GroupShard]:
    """The `GroupShard` of every module group for one rank."""
    full, k, n = shard.full, shard.tp_rank, shard.tp_size
    hd = full.head_dim
    q = full.num_heads * hd
    kv = full.num_kv_heads * hd
    q_lo, q_hi = k * q // n, (k + 1) * q // n
    if full.num_kv_heads % n == 0:
        kv_lo, kv_hi = k * kv // n, (k + 1) * kv // n
    else:  # replicated: the KV head that this rank's query heads attend to
        head = k // shard.kv_replicas
        kv_lo, kv_hi = head * hd, (head + 1) * hd
    inter, hidden = full.intermediate, full.hidden
    i_lo, i_hi = k * inter // n, (k + 1) * inter // n
    return {
        "qkv_proj": GroupShard("qkv_proj", "column", ((q_lo, q_hi), (q + kv_lo, q + kv_hi),
                                                      (q + kv + kv_lo, q + kv + kv_hi)), (0, hidden)),
        "o_proj": GroupShard("o_proj", "row", ((0, hidden),), (q_lo, q_hi)),
        "gate_up_proj": GroupShard("gate_up_proj", "column", ((i_lo, i_hi), (inter + i_lo, inter + i_hi)),
                                   (0, hidden)),
        "down_proj": GroupShard("down_proj", "row", ((0, hidden),), (i_lo, i_hi)),
    }


def shard_adapter(w, shard: ModelSpec):
    """This rank's part of a full `AdapterWeights` (see the module docstring), as `AdapterWeights` of `shard`.

    `w` must be read for `shard`'s full model. Column-parallel lora_b and row-parallel lora_a are
    copied (contiguous); replicated tensors are shared with `w`, not copied.
    """
    from lora_kernels.adapters.peft import AdapterWeights

    if not isinstance(shard, ShardSpec):
        if w.spec != shard:
            raise ValueError(f"adapter {w.name!r} was read for {w.spec}, not for {shard}")
        return w
    if w.spec != shard.full:
        raise ValueError(f"adapter {w.name!r} was read for {w.spec}; shard_adapter needs the full model "
                         f"{shard.full} of the shard tp_rank={shard.tp_rank}, tp_size={shard.tp_size}")
    gs = group_shards(shard)
    out = AdapterWeights(shard, w.rank, w.scaling, name=w.name)
    for key, a in w.lora_a.items():
        out.lora_a[key] = gs[key[1]].take_cols(a)
        out.lora_b[key] = gs[key[1]].take_rows(w.lora_b[key])
    return out


def unpack_adapter(packed, spec: ModelSpec):
    """The `AdapterWeights` (of `spec`) whose packing is `packed`, as views of its buffer (no copy)."""
    from lora_kernels.adapters.peft import AdapterWeights

    w = AdapterWeights(spec, packed.rank, packed.scaling, name=str(packed.adapter_id))
    for key, a in packed.a.items():
        g = spec.group(key[1])
        w.lora_a[key] = a.view(packed.dtype).view(g.num_slices * packed.rank, g.in_dim)
        w.lora_b[key] = packed.b[key].view(packed.dtype).view(g.out_total, packed.rank)
    return w


def shard_packed(packed, shard: ShardSpec, pin: bool | None = None):
    """This rank's `PackedAdapter` cut from a packed full adapter (one host copy of the full adapter
    feeding several ranks of one process). `pin` defaults to whether `packed` is pinned."""
    from lora_kernels.adapters.host_store import pack_adapter

    if not isinstance(shard, ShardSpec):
        raise TypeError(f"shard must be a ShardSpec (from shard_spec), got {type(shard).__name__}")
    pin = packed.buffer.is_pinned() if pin is None else pin
    w = shard_adapter(unpack_adapter(packed, shard.full), shard)
    return pack_adapter(packed.adapter_id, w, shard, packed.dtype, pin)


def _module_rows(shard: ShardSpec, gs: GroupShard, m, i: int) -> tuple[int, int]:
    """Rows [r0, r1) of module m's file B that slice i of this rank holds (m.sl None: a fused module, whose B
    spans the whole group)."""
    base = 0 if m.sl is None else shard.full.group(m.group).slice_offsets[m.sl]
    return gs.rows[i][0] - base, gs.rows[i][1] - base


def read_plan(plan, shard: ShardSpec, blocks, dtype: torch.dtype):
    """`reader._read_plan` for a tensor-parallel rank: the byte-level reads that fill a buffer laid out for
    `shard` from the full file `plan` (made for `shard.full`) describes, reading only this rank's bytes: one
    range per B slice (its rows), one per A row in row-parallel groups (its columns). Cached on the plan
    per (dtype, shard): one plan serves every rank of a process."""
    from lora_kernels.adapters.reader import _ReadPlan, zero_missing_slices

    rp = plan.reads.get((dtype, shard))
    if rp is not None:
        return rp
    rp, rank, es, covered, shards = _ReadPlan(), plan.rank, blocks.esize, set(), group_shards(shard)
    for m in plan.modules:
        g, gs = shard.group(m.group), shards[m.group]
        a_off, b_off = blocks.a[(m.layer, m.group)].offset, blocks.b[(m.layer, m.group)].offset
        row_a, full_in, (c0, c1) = g.in_dim * es, shard.full.group(m.group).in_dim, gs.cols
        for i in range(g.num_slices) if m.sl is None else (m.sl,):
            covered.add((m.layer, m.group, i))
            dst = a_off + i * rank * row_a
            if m.a.dtype != dtype:
                pass  # staged below, once per module
            elif (c0, c1) == (0, full_in):
                rp.direct.append((m.a.begin, dst, m.rank * row_a))
            else:
                rp.direct += [(m.a.begin + (j * full_in + c0) * es, dst + j * row_a, row_a) for j in range(m.rank)]
            if m.rank < rank:
                rp.zero.append((dst + m.rank * row_a, (rank - m.rank) * row_a))
            if m.rank == rank and m.factor == 1.0 and m.b.dtype == dtype:
                r0, r1 = _module_rows(shard, gs, m, i)
                rp.direct.append((m.b.begin + r0 * rank * es, b_off + g.slice_offsets[i] * rank * es,
                                  (r1 - r0) * rank * es))
        if m.a.dtype != dtype:
            rp.staged.append((m, True))
        if not (m.rank == rank and m.factor == 1.0 and m.b.dtype == dtype):
            rp.staged.append((m, False))
    zero_missing_slices(rp, plan, shard, blocks, covered, rank, es)
    rp.direct.sort()  # file order: sequential reads
    plan.reads[(dtype, shard)] = rp
    return rp


def read_staged(fd: int, plan, shard: ShardSpec, packed, dtype: torch.dtype, m, is_a: bool) -> None:
    """`reader._read_staged` for a tensor-parallel rank: the whole file tensor through a temporary (cast,
    rescaled in float64 for B), then this rank's columns of A / rows of B into place (B's columns beyond the
    module rank zeroed)."""
    from lora_kernels.adapters.reader import _mv, _pread_all

    g, gs, rank = shard.group(m.group), group_shards(shard)[m.group], plan.rank
    e = m.a if is_a else m.b
    tmp = torch.empty(e.shape, dtype=e.dtype)
    _pread_all(fd, [(e.begin, _mv(tmp))], plan.weights_path, 1)
    slices = range(g.num_slices) if m.sl is None else (m.sl,)
    if is_a:
        a = packed.a[(m.layer, m.group)].view(dtype).view(g.num_slices * rank, g.in_dim)
        for i in slices:
            a[i * rank:i * rank + m.rank].copy_(gs.take_cols(tmp))  # casts: one rounding, as via float64
        return
    b = packed.b[(m.layer, m.group)].view(dtype).view(g.out_total, rank)
    for i in slices:
        (r0, r1), lo, hi = _module_rows(shard, gs, m, i), g.slice_offsets[i], g.slice_offsets[i + 1]
        b[lo:hi, :m.rank].copy_(tmp[r0:r1] if m.factor == 1.0 else tmp[r0:r1].double() * m.factor)
        b[lo:hi, m.rank:].zero_()


def init_from_torchrun(tp_size: int, device: str) -> tuple[int, int]:
    """(tp_rank, tp_size) of this process, one of `tp_size` started by torchrun, with the default process
    group initialized (NCCL for `device` cuda, on the GPU LOCAL_RANK; gloo for cpu)."""
    import atexit
    import os

    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp_size:
        raise ValueError(f"--tp {tp_size} needs {tp_size} processes started by torchrun (torchrun "
                         f"--nproc-per-node {tp_size} ...), found WORLD_SIZE={world}")
    if not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        # Destroyed before the interpreter tears down: a gloo group left alive at exit can abort the process
        # ("terminate called without an active exception", seen once in CI on serve-sim --tp 2's rank 1).
        atexit.register(_destroy_group)
    return dist.get_rank(), dist.get_world_size()


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree_max(*values: float) -> tuple[float, ...]:
    """Each value's largest over the ranks of the default process group (unchanged without one): a TP step
    takes as long as its slowest rank, and every rank's scheduler must decide from the same times."""
    if _group_size() == 1:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(t.tolist())


def rank0_first(fn):
    """fn() on rank 0, then on the other ranks (a cache rank 0 fills and the others reuse)."""
    if _group_size() == 1:
        return fn()
    import torch.distributed as dist

    out = fn() if dist.get_rank() == 0 else None
    dist.barrier()
    return out if dist.get_rank() == 0 else fn()


def adapter_bytes(spec: ModelSpec, rank: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one adapter of `rank` targeting every group, for the model (or shard) `spec`."""
    return spec.adapter_numel(rank) * torch.empty((), dtype=dtype).element_size()


__all__ = ["COLUMN_PARALLEL", "ROW_PARALLEL", "GroupShard", "ShardSpec", "adapter_bytes", "agree_max", "full_spec",
           "group_shards", "init_from_torchrun", "rank0_first", "read_plan", "read_staged", "shard_adapter",
           "shard_packed", "shard_spec", "split_spec", "tp_of", "unpack_adapter"]
