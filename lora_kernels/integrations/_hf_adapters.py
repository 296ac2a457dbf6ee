"""Adapters for the HF integration: LoRA weights read out of a loaded `PeftModel`, and PEFT folder checks.

An in-memory adapter is turned into `AdapterWeights` (the pool layout of DESIGN.md §3) from what PEFT itself
computes with: per module `lora_A[name].weight` [r_m, in], `lora_B[name].weight` [out, r_m] and
`scaling[name]` (which already folds in lora_alpha, rank_pattern, alpha_pattern and use_rslora). The slot rank
is the adapter's largest module rank; smaller modules are zero-padded (adding exactly 0). The slot scaling is
the most common module scaling; a module with another scaling has its B multiplied by s_m / s_slot (in
float64, cast once), so slot scaling × B equals PEFT's s_m × B_m.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from lora_kernels.adapters import AdapterWeights, ModelSpec

# HF module attribute -> (parent attribute in the decoder layer, pool group, slice index)
MEMBERS = {
    "q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
SUPPORTED_TARGETS = tuple(MEMBERS)


def peft_type_name(config) -> str:
    t = getattr(config, "peft_type", None)
    return str(getattr(t, "value", t))


def check_peft_config(name: str, config) -> None:
    """Raises ValueError for an adapter the kernels cannot apply exactly: non-LoRA types, DoRA, biases,
    modules_to_save, embedding/lm_head targets are caught by `collect_modules`."""
    kind = peft_type_name(config)
    if kind != "LORA":
        raise ValueError(f"adapter {name!r} is a PEFT {kind} adapter; only plain LoRA adapters are supported")
    for flag, why in (("use_dora", "DoRA (weight-decomposed LoRA)"), ("lora_bias", "LoRA biases")):
        if getattr(config, flag, False):
            raise ValueError(f"adapter {name!r} has {flag}=True: {why} is not supported, only plain LoRA")
    if getattr(config, "bias", "none") not in (None, "none"):
        raise ValueError(f"adapter {name!r} has bias={config.bias!r}: only bias='none' is supported")
    if getattr(config, "modules_to_save", None):
        raise ValueError(f"adapter {name!r} has modules_to_save={config.modules_to_save!r}: fully trained "
                         f"modules are not supported, only LoRA on {', '.join(SUPPORTED_TARGETS)}")


def folder_rank(name: str, path: str | Path) -> int:
    """The largest module rank of a PEFT folder's adapter, after the same checks as an in-memory adapter."""
    cfg_path = Path(path) / "adapter_config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"adapter {name!r}: {cfg_path} not found (a PEFT LoRA folder holds "
                                f"adapter_config.json and adapter_model.safetensors)")
    cfg = json.loads(cfg_path.read_text())
    check_peft_config(name, SimpleNamespace(**{**cfg, "peft_type": cfg.get("peft_type", "LORA")}))
    ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
    return int(max(ranks))


def base_linear(module: nn.Module, where: str) -> nn.Linear:
    """The plain nn.Linear under a module (itself, or a PEFT layer's innermost `base_layer`)."""
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    if type(base) is not nn.Linear:
        raise ValueError(f"{where} is a {type(base).__name__}, not a torch.nn.Linear (quantized or custom layers "
                         f"are not supported)")
    return base


def collect_modules(name: str, peft_model, targets: dict[int, str]) -> dict[tuple[int, str], nn.Module]:
    """{(layer, member): PEFT layer} holding adapter `name`; raises for any other module holding it.

    targets: id(module) -> "layers.{i}.{member}" for the 7 supported modules of every decoder layer."""
    found = {}
    for mod_name, m in peft_model.named_modules():
        ranks = getattr(m, "r", None)
        if not isinstance(ranks, dict) or name not in ranks:
            continue
        where = targets.get(id(m))
        if where is None:
            raise ValueError(f"adapter {name!r} has LoRA weights on {mod_name} ({type(m).__name__}); only "
                             f"{', '.join(SUPPORTED_TARGETS)} of the decoder layers are supported")
        if name in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(name, False):
            raise ValueError(f"adapter {name!r} uses a LoRA variant (DoRA or similar) on {mod_name}; only plain "
                             f"LoRA is supported")
        if getattr(m, "merged_adapters", None):
            raise ValueError(f"{mod_name} has merged adapters {m.merged_adapters}: the base weights include them; "
                             f"call unmerge_adapter() first")
        if getattr(m, "lora_bias", {}).get(name, False):
            raise ValueError(f"adapter {name!r} has a LoRA bias on {mod_name}; not supported")
        layer, member = where.split(".")[1:]
        found[(int(layer), member)] = m
    if not found:
        raise ValueError(f"adapter {name!r} has no LoRA weights in the model")
    return found


def weights_from_modules(name: str, spec: ModelSpec, modules: dict[tuple[int, str], nn.Module],
                         dtype: torch.dtype) -> AdapterWeights:
    """`AdapterWeights` (host tensors in `dtype`) of adapter `name` from its PEFT LoRA layers."""
    parts = {}
    for (layer, member), m in modules.items():
        a = m.lora_A[name].weight.detach()
        b = m.lora_B[name].weight.detach()
        parts[(layer, member)] = (a, b, int(m.r[name]), float(m.scaling[name]))
    rank = max(p[2] for p in parts.values())
    s_slot = Counter(p[3] for p in parts.values()).most_common(1)[0][0] or 1.0
    w = AdapterWeights(spec, rank, s_slot, name=name)
    for (layer, member), (a, b, r, s) in parts.items():
        _, gname, sl = MEMBERS[member]
        g = spec.group(gname)
        key = (layer, gname)
        if key not in w.lora_a:
            w.lora_a[key] = torch.zeros(g.num_slices * rank, g.in_dim, dtype=dtype)
            w.lora_b[key] = torch.zeros(g.out_total, rank, dtype=dtype)
        if tuple(a.shape) != (r, g.in_dim) or tuple(b.shape) != (g.slice_widths[sl], r):
            raise ValueError(f"adapter {name!r} layer {layer} {member}: lora_A {tuple(a.shape)} / lora_B "
                             f"{tuple(b.shape)} do not match rank {r} and the model's dims")
        w.lora_a[key][sl * rank: sl * rank + r] = a.cpu()
        off = g.slice_offsets[sl]
        factor = s / s_slot
        w.lora_b[key][off: off + b.shape[0], :r] = b.cpu() if factor == 1.0 else b.cpu().double() * factor
    return w
