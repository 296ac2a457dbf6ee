"""The base model's shape as the adapter code needs it: layers and the LoRA module groups of each layer.

Every layer has the four module groups of DESIGN.md §3, in this order (the "pool order"):

    group          slices (PEFT module names)      in_dim          slice widths (out rows)
    qkv_proj       q_proj, k_proj, v_proj          hidden          heads*hd, kv_heads*hd, kv_heads*hd
    o_proj         o_proj                          heads*hd        hidden
    gate_up_proj   gate_proj, up_proj              hidden          intermediate, intermediate
    down_proj      down_proj                       intermediate    hidden
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


@dataclass(frozen=True)
class ModuleGroup:
    """One LoRA-targeted module group: the slices it fuses and its dims."""

    name: str
    members: tuple[str, ...]  # PEFT module names of the slices, in slice order
    in_dim: int
    slice_widths: tuple[int, ...]

    @property
    def num_slices(self) -> int:
        return len(self.members)

    @property
    def out_total(self) -> int:
        return sum(self.slice_widths)

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        offs = [0]
        for w in self.slice_widths:
            offs.append(offs[-1] + w)
        return tuple(offs)


GROUP_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

PRESETS = {
    # Llama-3-8B (and 3.1-8B): the serving benchmark's model.
    "llama3-8b": dict(layers=32, hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8, head_dim=128),
}


@dataclass(frozen=True)
class ModelSpec:
    """Decoder layer count and dims; `groups` gives the module groups of every layer."""

    layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelSpec.{f.name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelSpec.num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def groups(self) -> tuple[ModuleGroup, ...]:
        return _groups_of(self)[0]

    def group(self, name: str) -> ModuleGroup:
        g = _groups_of(self)[1].get(name)
        if g is None:
            raise KeyError(f"unknown module group {name!r}; groups are {GROUP_NAMES}")
        return g

    def adapter_numel(self, rank: int) -> int:
        """Elements of a full adapter (every group of every layer) at `rank`: Σ S*r*in + out_total*r."""
        per_layer = sum(g.num_slices * rank * g.in_dim + g.out_total * rank for g in self.groups)
        return self.layers * per_layer

    def with_layers(self, layers: int) -> "ModelSpec":
        return dataclasses.replace(self, layers=layers)

    @classmethod
    def preset(cls, name: str, layers: int | None = None) -> "ModelSpec":
        """A built-in model shape ("llama3-8b"), optionally with fewer layers."""
        if name not in PRESETS:
            raise KeyError(f"unknown ModelSpec preset {name!r}; presets are {sorted(PRESETS)}")
        spec = cls(**PRESETS[name])
        return spec if layers is None else spec.with_layers(layers)

    @classmethod
    def from_hf_config(cls, config: Mapping | str | Path) -> "ModelSpec":
        """From a Hugging Face `config.json` (a dict, or the file / its folder), Llama-style keys."""
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            config = json.loads(path.read_text())
        missing = [k for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
                   if k not in config]
        if missing:
            raise ValueError(f"HF config lacks {missing}; has {sorted(config)}")
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
        return cls(layers=int(config["num_hidden_layers"]), hidden=int(config["hidden_size"]),
                   intermediate=int(config["intermediate_size"]), num_heads=heads,
                   num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=int(head_dim))


@functools.lru_cache(maxsize=64)
def _groups_of(spec: ModelSpec) -> tuple[tuple[ModuleGroup, ...], dict[str, ModuleGroup]]:
    """The module groups of `spec` (built once per shape: the host stage asks for them per tensor)."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    groups = (
        ModuleGroup("qkv_proj", ("q_proj", "k_proj", "v_proj"), spec.hidden, (q, kv, kv)),
        ModuleGroup("o_proj", ("o_proj",), q, (spec.hidden,)),
        ModuleGroup("gate_up_proj", ("gate_proj", "up_proj"), spec.hidden, (spec.intermediate, spec.intermediate)),
        ModuleGroup("down_proj", ("down_proj",), spec.intermediate, (spec.hidden,)),
    )
    return groups, {g.name: g for g in groups}
