"""`GpuAdapterPool`: the §3 weight tensors of every layer and module group, and per-slot rank and scaling.

For layer l and module group g (S slices, max rank R):

    pool.lora_a[l][g] : [num_slots, S*R, in_dim]      slice i of slot s in rows [i*R, i*R + rank)
    pool.lora_b[l][g] : [num_slots, out_total, R]     slice i in rows [off[i], off[i+1]), columns [0, rank)
    pool.lora_ranks   : int32[num_slots]   (0 = empty)      pool.scalings : float32[num_slots]
    pool.lora_b_stacked[g] : [layers, num_slots, out_total, R]  every layer's lora_b of group g (strided view)

The tensors start zeroed and are only ever overwritten with finite adapter data, so the stale rows
beyond a slot's rank (which the kernels never read) and the B rows of a zeroed-out group are always
finite: a zero A row then contributes exactly 0. Only `AdapterLoader` writes them (on its load stream).
"""

from __future__ import annotations

import torch

from lora_kernels.adapters.spec import ModelSpec, ModuleGroup
from lora_kernels.adapters.tp import shard_spec
from lora_kernels.limits import MAX_RANK

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class GpuAdapterPool:
    """Fixed-size slot storage for `num_slots` adapters of rank ≤ `max_rank` (CUDA or CPU device); with
    (tp_rank, tp_size), this rank's shard of each (`spec` is then a `tp.ShardSpec`)."""

    def __init__(self, model_spec: ModelSpec, num_slots: int, max_rank: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cuda", tp_rank: int = 0, tp_size: int = 1):
        # Tensor parallelism: the pool holds this rank's shard, whose shapes are those of a smaller model.
        model_spec = shard_spec(model_spec, tp_rank, tp_size)
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not 1 <= max_rank <= MAX_RANK:
            raise ValueError(f"max_rank must be in 1..{MAX_RANK}, got {max_rank}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype}")
        self.spec = model_spec
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        R = max_rank
        self.lora_a: list[dict[str, torch.Tensor]] = []
        self.lora_b: list[dict[str, torch.Tensor]] = [{} for _ in range(model_spec.layers)]
        for _ in range(model_spec.layers):
            self.lora_a.append({g.name: torch.zeros(num_slots, g.num_slices * R, g.in_dim, dtype=dtype,
                                                    device=self.device) for g in model_spec.groups})
        # lora_b of one group, every layer, as one strided tensor [layers, num_slots, out_total, R]: a load of
        # rank < R scatters a group's B columns of all layers in one copy (adapters/layout.py). Each layer's
        # tensor is a contiguous view of it, starting on a 256-byte boundary like a separate allocation.
        self.lora_b_stacked: dict[str, torch.Tensor] = {}
        for g in model_spec.groups:
            shape = (num_slots, g.out_total, R)
            esize = torch.empty((), dtype=dtype).element_size()
            step = -(-num_slots * g.out_total * R * esize // 256) * 256 // esize
            flat = torch.zeros(model_spec.layers * step, dtype=dtype, device=self.device)
            stacked = flat.as_strided((model_spec.layers, *shape), (step, g.out_total * R, R, 1))
            self.lora_b_stacked[g.name] = stacked
            for layer in range(model_spec.layers):
                self.lora_b[layer][g.name] = stacked[layer]
        self.lora_ranks = torch.zeros(num_slots, dtype=torch.int32, device=self.device)
        self.scalings = torch.zeros(num_slots, dtype=torch.float32, device=self.device)

    @property
    def groups(self) -> tuple[ModuleGroup, ...]:
        return self.spec.groups

    def weights(self, layer: int, group: str) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
        """(lora_a, lora_b, slice_offsets) of one layer's module group, as `apply_lora` takes them."""
        return self.lora_a[layer][group], self.lora_b[layer][group], self.spec.group(group).slice_offsets

    def slot_bytes(self) -> int:
        """Device bytes one slot occupies (all layers and groups at max rank)."""
        return self.spec.adapter_numel(self.max_rank) * torch.empty((), dtype=self.dtype).element_size()

    def nbytes(self) -> int:
        return self.slot_bytes() * self.num_slots + 8 * self.num_slots
