"""Random PEFT LoRA adapter folders for the serving simulation, generated once into a cache directory.

Each folder is what `peft` saves (`adapter_config.json` + `adapter_model.safetensors`, tensors
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`, A: [r, in], B: [out, r])
and is read back through `lora_kernels.adapters.load_peft_adapter` like any user adapter. Weights are
random and non-zero (B too, unlike a fresh PEFT init), so every adapter changes the outputs.
A folder set is keyed by model shape, adapter count, ranks, dtype and seed; a `.complete` marker
written last makes an interrupted generation start over instead of being reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from lora_kernels.adapters.peft import CONFIG_NAME, WEIGHTS_NAME
from lora_kernels.adapters.spec import ModelSpec

_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def default_cache_dir() -> Path:
    base = os.environ.get("LORA_KERNELS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lora_kernels")
    return Path(base) / "serve_sim"


def _modules(spec: ModelSpec) -> list[tuple[str, int, int]]:
    """(PEFT module name, in_dim, out_dim) of every targeted module of one layer."""
    out = []
    for g in spec.groups:
        for name, width in zip(g.members, g.slice_widths):
            out.append((name, g.in_dim, width))
    return out


def adapter_rank(k: int, ranks: tuple[int, ...]) -> int:
    return ranks[k % len(ranks)]


def write_adapter(folder: Path, spec: ModelSpec, rank: int, dtype: torch.dtype, seed: int) -> None:
    """One random PEFT LoRA folder of `rank` for every module of every layer (lora_alpha = 2 * rank)."""
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"  # randn on the GPU: seconds, not minutes
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(spec.layers):
        for name, in_dim, out_dim in _modules(spec):
            key = f"base_model.model.model.layers.{layer}.{_PARENT[name]}.{name}"
            # Scaled so that the LoRA term is a few percent of a unit-variance base output.
            a = torch.randn(rank, in_dim, generator=gen, device=device) * in_dim ** -0.5
            b = torch.randn(out_dim, rank, generator=gen, device=device) * (0.1 * rank ** -0.5)
            tensors[f"{key}.lora_A.weight"] = a.to(dtype).cpu().contiguous()
            tensors[f"{key}.lora_B.weight"] = b.to(dtype).cpu().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_NAME))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(_PARENT), "task_type": "CAUSAL_LM", "use_rslora": False}
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2))


def ensure_adapters(spec: ModelSpec, num_adapters: int, ranks: tuple[int, ...], dtype: str, seed: int,
                    cache_dir: Path | None = None, progress=None) -> list[Path]:
    """The folders adapter_000 … of this configuration, generating them on first use."""
    key = json.dumps([spec.layers, spec.hidden, spec.intermediate, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                      num_adapters, list(ranks), dtype, seed])
    root = (cache_dir or default_cache_dir()) / f"{num_adapters}x-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    folders = [root / f"adapter_{k:03d}" for k in range(num_adapters)]
    if (root / ".complete").is_file():
        return folders
    if root.exists():
        shutil.rmtree(root)
    try:
        root.mkdir(parents=True)
    except OSError as e:
        raise ValueError(f"cannot create the adapter cache directory {root}: {e.strerror}") from None
    for k, folder in enumerate(folders):
        write_adapter(folder, spec, adapter_rank(k, ranks), _DTYPES[dtype], seed * 100_003 + k)
        if progress is not None:
            progress(k + 1, num_adapters)
    (root / "config.json").write_text(key)
    (root / ".complete").write_text("")
    return folders


def list_adapter_dir(path: Path) -> list[Path]:
    """PEFT folders under a user's --adapter-dir (sorted); raises ValueError if it cannot be read."""
    try:
        entries = sorted(p for p in path.iterdir() if (p / CONFIG_NAME).is_file())
    except OSError as e:
        raise ValueError(f"--adapter-dir {path}: cannot read it ({e.strerror or e})") from None
    if not entries:
        raise ValueError(f"--adapter-dir {path}: no PEFT adapter folders (subfolders with {CONFIG_NAME}) in it")
    return entries
