"""Reading PEFT LoRA adapter folders and mapping them onto the pool layout of DESIGN.md §3.

A folder holds `adapter_config.json` and `adapter_model.safetensors` with tensors named
`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`, A: [r, in], B: [out, r].

Mapping (exact, per slot one rank and one scaling, as the kernels take them):
- The slot rank is the adapter's largest module rank. A module of smaller rank r_m (rank_pattern) is
  zero-padded: its A rows r_m..rank-1 and B columns r_m..rank-1 are 0, which adds exactly 0.
- The slot scaling is the config's default scaling (lora_alpha / r, or / sqrt(r) with use_rslora; 1.0
  if that is 0). A module whose own scaling s_m differs (rank_pattern / alpha_pattern) has its B
  multiplied by s_m / s_slot (in float64, then cast), so slot scaling × B gives s_m × B_m.
- A slice the adapter lacks inside a targeted group (e.g. q and v without k) is written as zeros
  in both its A rows and B rows: the slot's rank is shared by all slices, so "rank 0 for that slice"
  is represented by zero weights. A group the adapter does not target at all is left out of
  `AdapterWeights` and the loader zeroes that group's A rows in the slot (again adding exactly 0).
- Fused modules (`qkv_proj`, `gate_up_proj`, as in Phi-3) have one A for all slices: it is written
  into every slice's A rows, and B's rows split by slice.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_kernels.adapters import tp as _tp
from lora_kernels.adapters.spec import ModelSpec

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

# PEFT module name -> (group, slice index); None slice = a fused module covering every slice.
MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "qkv_proj": ("qkv_proj", None),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "gate_up_proj": ("gate_up_proj", None),
    "down_proj": ("down_proj", 0),
}
_PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}
_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\."
                     r"(?P<name>\w+))\.lora_(?P<ab>[AB])\.weight$")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class AdapterFormatError(ValueError):
    """A PEFT adapter folder that cannot be mapped onto the pool: the message names the file or tensor."""


@dataclass
class AdapterWeights:
    """One adapter in the §3 layout at its own rank (not yet padded to a pool's max rank).

    lora_a[(layer, group)]: [S*rank, in_dim], slice i in rows [i*rank, (i+1)*rank)
    lora_b[(layer, group)]: [out_total, rank], slice i in rows [off[i], off[i+1])
    Groups absent from the dicts are not targeted (they must add 0). `scaling` is the slot scaling.
    """

    spec: ModelSpec
    rank: int
    scaling: float
    lora_a: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    lora_b: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    name: str = ""

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.lora_a.values())).dtype if self.lora_a else torch.float32

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.lora_a, self.lora_b) for t in d.values())

    @classmethod
    def random(cls, spec: ModelSpec, rank: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
               groups: tuple[str, ...] | None = None, scaling: float = 2.0, std: float = 0.05,
               device: str = "cpu") -> "AdapterWeights":
        """A random adapter targeting `groups` (default: all) of every layer, host tensors; for tests and
        benchmarks (`device="cuda"` draws the numbers there, faster for Llama-sized adapters)."""
        gen = torch.Generator(device).manual_seed(seed)
        w = cls(spec, rank, scaling, name=f"random-r{rank}-s{seed}")
        for layer in range(spec.layers):
            for g in spec.groups:
                if groups is not None and g.name not in groups:
                    continue
                a = torch.randn(g.num_slices * rank, g.in_dim, generator=gen, device=device) * std
                b = torch.randn(g.out_total, rank, generator=gen, device=device) * std
                w.lora_a[(layer, g.name)] = a.to(dtype).cpu()
                w.lora_b[(layer, g.name)] = b.to(dtype).cpu()
        return w


def _all_finite(t: torch.Tensor) -> bool:
    # aminmax propagates NaN and ±inf and is ~40x faster than isfinite(t).all() on the CPU (a cold adapter
    # load is on a serving engine's critical path).
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _scaling(alpha: float, r: int, rslora: bool) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule: a pattern key applies when the module name ends with it (as a regex, after a dot)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _is_targeted(target, module: str) -> bool:
    if target == "all-linear":
        return True
    if isinstance(target, str):
        return re.fullmatch(target, module) is not None
    return any(module == t or module.endswith("." + t) for t in target)


def _config_bytes(folder: Path) -> tuple[Path, bytes]:
    path = folder / CONFIG_NAME
    try:
        return path, path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise AdapterFormatError(f"{path}: not found (a PEFT adapter folder holds {CONFIG_NAME} and "
                                 f"{WEIGHTS_NAME})") from None


def _read_config(folder: Path) -> dict:
    return _parse_config(*_config_bytes(folder))


def _parse_config(path: Path, raw: bytes) -> dict:
    try:
        cfg = json.loads(raw.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterFormatError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterFormatError(f"{path}: peft_type must be LORA, got {cfg.get('peft_type')!r}")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterFormatError(f"{path}: r must be a positive int, got {r!r}")
    if not isinstance(cfg.get("lora_alpha", r), (int, float)):
        raise AdapterFormatError(f"{path}: lora_alpha must be a number, got {cfg.get('lora_alpha')!r}")
    for flag, why in (("use_dora", "DoRA magnitudes"), ("lora_bias", "LoRA biases")):
        if cfg.get(flag):
            raise AdapterFormatError(f"{path}: {flag}=true is not supported (the kernels apply no {why})")
    if cfg.get("bias", "none") != "none":
        raise AdapterFormatError(f"{path}: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("target_modules") is None:
        raise AdapterFormatError(f"{path}: target_modules is missing")
    return cfg


# safetensors dtype names (the file header's spelling) -> torch dtypes.
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, from its header: bytes [begin, end) of the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _header_bytes(path: Path) -> tuple[int, bytes]:
    """(file size, the JSON header's bytes), checked against the file size."""
    try:
        f = open(path, "rb")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise AdapterFormatError(f"{path}: not found") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise AdapterFormatError(f"{path}: corrupt or truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise AdapterFormatError(f"{path}: corrupt or truncated safetensors file (header of {n} bytes "
                                     f"in a {size}-byte file)")
        return size, f.read(n)


def read_safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of a safetensors file, from its JSON header alone (no data read), checked against the
    file size and the dtypes and shapes, so that truncation or corruption names the tensor."""
    return _parse_header(path, *_header_bytes(path))


def _parse_header(path: Path, size: int, raw: bytes) -> dict[str, TensorEntry]:
    n = len(raw)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterFormatError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise AdapterFormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_size, base = size - 8 - n, 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(v) for v in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
            dtype_name = info["dtype"]
        except (TypeError, KeyError, ValueError):
            raise AdapterFormatError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
        if end > data_size:
            raise AdapterFormatError(f"{path}: tensor {name!r} needs bytes [{begin}, {end}) of the data but the "
                                     f"file holds {data_size}: file truncated")
        dtype = _ST_DTYPES.get(dtype_name)
        if dtype is None:
            raise AdapterFormatError(f"{path}: cannot read tensor {name!r}: unsupported dtype {dtype_name!r}")
        numel = math.prod(shape)
        if not 0 <= begin <= end or end - begin != numel * dtype.itemsize:
            raise AdapterFormatError(f"{path}: corrupt safetensors header entry for tensor {name!r} ({dtype_name} "
                                     f"{list(shape)} in bytes [{begin}, {end}))")
        out[name] = TensorEntry(name, dtype, shape, base + begin, base + end)
    return out


@dataclass(frozen=True)
class ModuleRead:
    """One PEFT module of the file and where it lands: slice `sl` (None = a fused module, every slice) of
    group `group` of `layer`, at module rank `rank`, B multiplied by `factor` (its scaling over the slot's)."""

    layer: int
    name: str
    group: str
    sl: int | None
    a: TensorEntry
    b: TensorEntry
    rank: int
    factor: float


@dataclass
class AdapterPlan:
    """What a PEFT folder holds, checked against a `ModelSpec` from the config and the safetensors header only.

    keys: the (layer, group) pairs present, in pool order; rank/scaling: the slot's."""

    folder: Path
    weights_path: Path
    rank: int
    scaling: float
    modules: list[ModuleRead]
    keys: tuple[tuple[int, str], ...]
    file_dtype: torch.dtype
    reads: dict = field(default_factory=dict, compare=False, repr=False)  # reader's byte plans, per dtype


def _expected_modules(cfg: dict, spec: ModelSpec, names_in_file: set[str]):
    """(targetable, expected) full module names -> (layer, PEFT name). A regex or "all-linear" cannot tell
    fused from unfused names without the model: there a name is expected in every targeted layer once the
    file has it in any layer."""
    target = cfg["target_modules"]
    layers_to_transform = cfg.get("layers_to_transform")
    if isinstance(layers_to_transform, int):
        layers_to_transform = [layers_to_transform]
    targetable: dict[str, tuple[int, str]] = {}
    expected: dict[str, tuple[int, str]] = {}
    for layer in range(spec.layers):
        if layers_to_transform is not None and layer not in layers_to_transform:
            continue
        for name, (group, _) in MODULES.items():
            module = f"model.layers.{layer}.{_PARENT[group]}.{name}"
            if _is_targeted(target, module):
                targetable[module] = (layer, name)
                if not isinstance(target, str) or name in names_in_file:
                    expected[module] = (layer, name)
    return targetable, expected


def _match_tensors(entries: dict[str, TensorEntry], targetable, target, spec: ModelSpec, wpath: Path):
    """module -> {"A"|"B": entry}; raises on unknown, out-of-range, untargeted or non-float tensors."""
    found: dict[str, dict[str, TensorEntry]] = {}
    for key, e in entries.items():
        m = _KEY_RE.match(key)
        if m is None or m["name"] not in MODULES:
            raise AdapterFormatError(f"{wpath}: unknown tensor {key!r} (expected "
                                     f"...layers.{{i}}.{{self_attn|mlp}}.{{{'|'.join(MODULES)}}}.lora_{{A|B}}.weight)")
        layer = int(m["layer"])
        if layer >= spec.layers:
            raise AdapterFormatError(f"{wpath}: tensor {key!r} is for layer {layer} but the model has "
                                     f"{spec.layers} layers")
        module = f"model.layers.{layer}.{m['parent']}.{m['name']}"
        if module not in targetable:
            raise AdapterFormatError(f"{wpath}: unknown tensor {key!r}: module {module} is not targeted by "
                                     f"target_modules={target!r}")
        if e.dtype not in _FLOAT_DTYPES:
            raise AdapterFormatError(f"{wpath}: tensor {key!r} has dtype {e.dtype}, which does not convert to "
                                     f"floating point (shape {e.shape})")
        found.setdefault(module, {})[m["ab"]] = e
    return found


def _module_reads(cfg: dict, expected, found, spec: ModelSpec, wpath: Path, max_rank: int | None):
    """Per-module rank and scaling, with shape checks against the spec; (modules, slot rank, slot scaling)."""
    target = cfg["target_modules"]
    for module in expected:
        for ab in "AB":
            if ab not in found.get(module, {}):
                raise AdapterFormatError(f"{wpath}: missing tensor 'base_model.model.{module}.lora_{ab}.weight' "
                                         f"(target_modules={target!r} names it)")
    r_default, alpha_default = cfg["r"], cfg.get("lora_alpha", cfg["r"])
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    slot_scaling = _scaling(alpha_default, r_default, rslora) or 1.0
    modules = []
    for module, (layer, name) in expected.items():
        gname, sl = MODULES[name]
        group = spec.group(gname)
        out = group.out_total if sl is None else group.slice_widths[sl]
        r_m = int(_pattern_value(rank_pattern, module, r_default))
        alpha_m = float(_pattern_value(alpha_pattern, module, alpha_default))
        a, b = found[module]["A"], found[module]["B"]
        for e, want in ((a, (r_m, group.in_dim)), (b, (out, r_m))):
            if e.shape != want:
                raise AdapterFormatError(f"{wpath}: tensor {e.name!r} has shape {e.shape} but the model spec "
                                         f"and rank {r_m} need {want} ({e.dtype})")
        if max_rank is not None and r_m > max_rank:
            raise AdapterFormatError(f"{wpath}: tensor {a.name!r} has rank {r_m}, above the pool's max rank "
                                     f"{max_rank}")
        factor = _scaling(alpha_m, r_m, rslora) / slot_scaling
        modules.append(ModuleRead(layer, name, gname, sl, a, b, r_m, factor))
    return modules, max((m.rank for m in modules), default=0), slot_scaling


def _check_overlaps(modules: list[ModuleRead], spec: ModelSpec, wpath: Path) -> None:
    filled: set[tuple[int, str, int]] = set()
    for m in modules:
        group = spec.group(m.group)
        for i in (range(group.num_slices) if m.sl is None else (m.sl,)):
            if (m.layer, m.group, i) in filled:
                raise AdapterFormatError(f"{wpath}: module {m.name} of layer {m.layer} overlaps another module of "
                                         f"group {m.group} (fused and unfused names both present)")
            filled.add((m.layer, m.group, i))


try:  # config + header in one call with the GIL released once; both files' stat (csrc/host/file_reads.cpp)
    from lora_kernels._C import file_ids as _file_ids
    from lora_kernels._C import read_heads as _read_heads
except ImportError:
    _read_heads = _file_ids = None

_PLANS: dict = {}  # (folder, config bytes, header bytes, file size, spec, max_rank) -> AdapterPlan
_PLANS_BY_STAT: dict = {}  # (folder, both files' stat identity, spec, max_rank) -> AdapterPlan
_PLANS_MAX = 4096
_plans_lock = threading.Lock()
_SETTLED_S = 2.0  # a file last changed this long ago is keyed by its stat (see _stat_key)


def _stat_key(cpath: Path, wpath: Path) -> tuple | None:
    """Both files' identity (device, inode, size, mtime ns, ctime ns), or None when a stat fails or a file changed
    in the last _SETTLED_S seconds. File times tick coarsely (a few ms), so a file rewritten with the same size
    within a tick of its stat could keep the same identity: a recently changed file is keyed by its bytes instead
    (as git treats a "racily clean" file). With the extension the stats keep the GIL (`_C.file_ids`)."""
    if _file_ids is not None:
        key = _file_ids(str(cpath), str(wpath))
    else:
        try:
            key = tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                        for st in map(os.stat, (cpath, wpath)))
        except OSError:
            return None
    if key is None or time.time_ns() - max(max(k[3], k[4]) for k in key) < _SETTLED_S * 1e9:
        return None
    return key


def plan_peft_adapter(path: str | Path, spec: ModelSpec, *, max_rank: int | None = None) -> AdapterPlan:
    """Checks a PEFT folder against `spec` from its config and safetensors header (no tensor data read).
    Raises AdapterFormatError naming the file or tensor (see `load_peft_adapter`, less the finite check).

    A plan depends only on the config's bytes, the header's bytes and the file's size; the parse and checks (~1 ms
    for 8 Llama layers) are skipped when those are unchanged, e.g. when an adapter dropped from host memory is read
    again. Files that have not changed for a few seconds are recognized by their stat (device, inode, size, mtime,
    ctime: any write changes it) without reading them; others by reading the config and the header (two small
    reads). A file changed in any way that matters misses both keys, so the cache never serves a stale plan."""
    folder = Path(path)
    cpath, wpath = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    ident = _stat_key(cpath, wpath)  # before the reads: a change after it only misses next time
    skey = (str(folder), ident, spec, max_rank)
    plan = _PLANS_BY_STAT.get(skey) if ident is not None else None
    if plan is not None:  # two stats instead of two reads and a hash of the header (~0.15 ms on the H200 host)
        return plan
    heads = _read_heads(str(cpath), str(wpath)) if _read_heads is not None else None
    if heads is not None:  # the extension read both with one GIL release (a host-stage worker's hot path)
        craw, size, hraw = heads
    else:  # without it, or when something is wrong: this path names what
        cpath, craw = _config_bytes(folder)
        if not wpath.is_file() and (folder / "adapter_model.bin").is_file():
            raise AdapterFormatError(f"{wpath}: not found (only adapter_model.bin is there; save with safetensors)")
        size, hraw = _header_bytes(wpath)
    key = (str(folder), craw, hraw, size, spec, max_rank)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(folder, _parse_config(cpath, craw), wpath, _parse_header(wpath, size, hraw), spec, max_rank)
    with _plans_lock:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
            _PLANS_BY_STAT.clear()
        _PLANS[key] = plan
        if ident is not None:
            _PLANS_BY_STAT[skey] = plan
    return plan


def _plan(folder: Path, cfg: dict, wpath: Path, entries: dict[str, TensorEntry], spec: ModelSpec,
          max_rank: int | None) -> AdapterPlan:
    names_in_file = {m["name"] for m in map(_KEY_RE.match, entries) if m is not None}
    targetable, expected = _expected_modules(cfg, spec, names_in_file)
    found = _match_tensors(entries, targetable, cfg["target_modules"], spec, wpath)
    modules, rank, scaling = _module_reads(cfg, expected, found, spec, wpath, max_rank)
    if rank == 0:
        raise AdapterFormatError(f"{wpath}: no LoRA tensors for target_modules={cfg['target_modules']!r}")
    _check_overlaps(modules, spec, wpath)
    present = {(m.layer, m.group) for m in modules}
    keys = tuple((layer, g.name) for layer in range(spec.layers) for g in spec.groups if (layer, g.name) in present)
    file_dtype = next(iter(entries.values())).dtype
    return AdapterPlan(folder, wpath, rank, scaling, modules, keys, file_dtype)


def _read_tensors(plan: AdapterPlan) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    out = {}
    try:
        with safe_open(str(plan.weights_path), framework="pt") as f:
            for m in plan.modules:
                for e in (m.a, m.b):
                    out[e.name] = f.get_tensor(e.name)
    except SafetensorError as e:
        raise AdapterFormatError(f"{plan.weights_path}: corrupt safetensors file ({e})") from None
    except (TypeError, ValueError) as e:  # e.g. a dtype torch cannot represent
        raise AdapterFormatError(f"{plan.weights_path}: cannot read tensor ({e})") from None
    return out


def _assemble(plan: AdapterPlan, spec: ModelSpec, tensors: dict[str, torch.Tensor],
              out_dtype: torch.dtype) -> AdapterWeights:
    """The §3 blocks at the slot rank: module ranks zero-padded, missing slices zero, B rescaled per module."""
    rank = plan.rank
    w = AdapterWeights(spec, rank, plan.scaling, name=str(plan.folder))
    for m in plan.modules:
        group = spec.group(m.group)
        key = (m.layer, m.group)
        if key not in w.lora_a:
            w.lora_a[key] = torch.zeros(group.num_slices * rank, group.in_dim, dtype=out_dtype)
            w.lora_b[key] = torch.zeros(group.out_total, rank, dtype=out_dtype)
        a, b = tensors[m.a.name], tensors[m.b.name]
        for i in (range(group.num_slices) if m.sl is None else (m.sl,)):
            w.lora_a[key][i * rank: i * rank + m.rank] = a  # copy_ casts: one rounding, as via float64
        offs = group.slice_offsets
        lo, hi = (0, group.out_total) if m.sl is None else (offs[m.sl], offs[m.sl + 1])
        # rescaled in float64, cast once
        w.lora_b[key][lo:hi, :m.rank] = b if m.factor == 1.0 else b.double() * m.factor
    # pool order, as the packed layout walks it
    w.lora_a = {k: w.lora_a[k] for k in plan.keys}
    w.lora_b = {k: w.lora_b[k] for k in plan.keys}
    return w


def load_peft_adapter(path: str | Path, spec: ModelSpec, *, dtype: torch.dtype | None = None,
                      max_rank: int | None = None, tp_rank: int = 0, tp_size: int = 1) -> AdapterWeights:
    """Reads a PEFT LoRA folder into `AdapterWeights` for a base model of shape `spec`.

    tp_rank, tp_size (or a `tp.ShardSpec` as `spec`): return only this tensor-parallel rank's shard
    (adapters/tp.py), checked against the full model's shapes.

    dtype: the weights' dtype (default: the file's); max_rank: the pool's max rank, checked here so
    that a too-large adapter fails at load with its tensor named. Raises AdapterFormatError (a
    ValueError) naming the file or tensor for: a missing/invalid config, a corrupt or truncated
    safetensors file, unknown or missing tensors, shapes that do not match `spec`, a rank above
    `max_rank`, a dtype that cannot be converted to floating point, or non-finite values.
    (The host store's direct reader, `reader.read_packed`, shares the checks but the finite one.)
    """
    spec, shard = _tp.split_spec(spec, tp_rank, tp_size)  # full model for the checks
    plan = plan_peft_adapter(path, spec, max_rank=max_rank)
    tensors = _read_tensors(plan)
    for m in plan.modules:
        for e in (m.a, m.b):
            if not _all_finite(tensors[e.name]):
                raise AdapterFormatError(f"{plan.weights_path}: tensor {e.name!r} has non-finite values "
                                         f"(shape {e.shape})")
    out_dtype = dtype or plan.file_dtype
    if out_dtype not in _FLOAT_DTYPES:
        raise AdapterFormatError(f"dtype must be one of {_FLOAT_DTYPES}, got {out_dtype}")
    w = _assemble(plan, spec, tensors, out_dtype)
    return w if shard is None else _tp.shard_adapter(w, shard)
