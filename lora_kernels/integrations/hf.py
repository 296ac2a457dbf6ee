"""Mixed-adapter batches for Hugging Face transformers causal LMs, through the package's kernels.

    from lora_kernels.integrations.hf import enable_multi_lora

    mlm = enable_multi_lora(peft_model)                      # or (base_model, adapters={"name": "path/", ...})
    logits = mlm(input_ids, attention_mask=mask, adapter_names=["a", "__base__", "b"]).logits
    tokens = mlm.generate(input_ids, attention_mask=mask, adapter_names=["a", "__base__", "b"], max_new_tokens=32)

Each row of the batch names its adapter (`"__base__"`: none, as in PEFT). What it does:

* The adapters (those already loaded into a `peft.PeftModel`, and/or PEFT folders given by path) go into a
  `HostAdapterStore` and are loaded by an `AdapterLoader` into a `GpuAdapterPool` of `num_slots` slots (q/k/v
  stacked as the three slices of `qkv_proj`, gate/up as the two of `gate_up_proj`). A batch acquires its
  adapters' slots (loading the missing ones, evicting the least recently used idle ones, async H2D on CUDA)
  and releases them when the call returns, so more adapters than slots just work.
* The q/k/v/o/gate/up/down Linear modules of every decoder layer get an instance `forward` (the module tree
  and the state_dict's values are unchanged; `remove()` restores them). Inside a call, the first member of a
  group called with an input x (q_proj, gate_proj) runs the group's base GEMM on x once, and adds the LoRA
  delta of every row with one `apply_lora`; the other members (k_proj, v_proj, up_proj), called with the same
  x, return their column slice of that output. One GEMM per group, not one per member: the weights of q/k/v
  (and of gate/up) are moved into one stacked tensor at enable time, each Linear's weight becoming a view of
  its rows (no extra memory; an eager decode step is host-bound, and this saves 3 of the 7 GEMM launches per
  layer). While enabled, those weights share storage, which `save_pretrained` (safetensors) refuses: call
  `remove()` first, which gives each weight its own storage again. Outside a call (e.g. a PeftModel used
  directly) the modules behave as before.
* One `LoRABatchInfo` per (batch, sequence length) of a call, built by `BatchInfoBuilder` from the rows'
  slots: batch*seq rows, one segment per request (`sort_by_adapter` when adapters repeat), reused by every
  module and, during `generate`, by every decode step.

Supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM (model_type llama, qwen2, mistral; GQA,
q/k/v biases), plain LoRA on any subset of the 7 projections with per-module rank and alpha (rank_pattern,
alpha_pattern, use_rslora). Not supported (clear errors): other architectures, DoRA and other LoRA variants,
non-LoRA PEFT types, LoRA biases, modules_to_save, LoRA on embeddings or lm_head. Inference only: calls run
under `torch.no_grad()`; dropout is not applied (as in PEFT's eval mode). Not thread-safe.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from lora_kernels.adapters import AdapterLoader, GpuAdapterPool, HostAdapterStore, ModelSpec
from lora_kernels.backends.cuda import BACKEND as CUDA, HAS_CUDA_EXT
from lora_kernels.batch_info import BatchInfoBuilder
from lora_kernels.integrations import _hf_mlp
from lora_kernels.integrations._hf_adapters import (MEMBERS, base_linear, check_peft_config, collect_modules,
                                                    folder_rank, weights_from_modules)
from lora_kernels.ops import apply_lora, sgmv_shrink

BASE = "__base__"
SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}

__all__ = ["BASE", "MultiLoRAModel", "SUPPORTED_MODEL_TYPES", "enable_multi_lora"]


def enable_multi_lora(model, adapters: Mapping[str, str | Path] | Sequence[str | Path] | None = None, *,
                      num_slots: int | None = None, max_rank: int | None = None, backend: str | None = None,
                      max_batch_tokens: int = 8192) -> "MultiLoRAModel":
    """Makes `model` run mixed-adapter batches through lora_kernels; returns the `MultiLoRAModel` to call.

    model: a transformers causal LM (Llama, Qwen2, Mistral) or a `peft.PeftModel` around one (all its LoRA
    adapters are used, under their PEFT names). adapters: PEFT LoRA folders, as {name: path} or a list of
    paths (named by folder name); read when first used. num_slots: adapters resident on the device at once
    (default: all of them); more are loaded on demand, least recently used evicted. max_rank: the pool's
    rank (default: the largest adapter rank; a later adapter above it is refused). backend: `apply_lora`'s
    backend (default: LORA_KERNELS_BACKEND if set; else, on CUDA with the extension built, the cuda backend for
    decode steps (one position per row) and auto for the rest; the torch backend on the CPU). A transformers
    decode step runs eagerly and is host-bound, and the cuda backend's call costs the host less (H200: 16 µs
    against 23 µs for Triton's); prefill is device-bound, where auto picks Triton. Each phase always uses the
    same backend, so a row's bits still do not depend on the rest of its batch. max_batch_tokens: the
    batch-info builder's initial row capacity (it grows when a call needs more).
    """
    return MultiLoRAModel(model, adapters, num_slots=num_slots, max_rank=max_rank, backend=backend,
                          max_batch_tokens=max_batch_tokens)


class _Group:
    """One module group of one decoder layer: the base Linears of its slices, their stacked weight and bias
    (the Linears' weights are views of its rows), the pool's weights, and the stacked output computed for the
    last input x (handed out slice by slice, then dropped)."""

    __slots__ = ("linears", "weight", "bias", "lora_a", "lora_b", "offsets", "widths", "x", "out", "unserved")

    def __init__(self, linears, lora_a, lora_b, offsets):
        self.linears, self.lora_a, self.lora_b, self.offsets = linears, lora_a, lora_b, offsets
        self.widths = [b - a for a, b in zip(offsets, offsets[1:])]
        self.weight, self.bias = _stack_weights(linears)
        self.x = self.out = None
        self.unserved = 0

    def unstack(self) -> None:
        """Each Linear's weight (and bias) in its own storage again (remove())."""
        if len(self.linears) > 1:
            with torch.no_grad():
                for lin in self.linears:
                    lin.weight.data = lin.weight.data.clone()
                    if lin.bias is not None:
                        lin.bias.data = lin.bias.data.clone()
        self.weight = self.bias = None


def _stack_weights(linears) -> tuple:
    """(weight [sum of out, in], bias or None) of the group's one GEMM. Several Linears: their weights are copied
    into one tensor and each Linear's weight becomes a view of its rows (the old storage is freed: no extra
    memory); biases likewise, where every member has one (a member without one gets zero rows)."""
    if len(linears) == 1:
        return linears[0].weight, linears[0].bias
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias if lin.bias is not None else
                              torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
                              for lin in linears])
        lo = 0
        for lin in linears:
            hi = lo + lin.out_features
            lin.weight.data = weight[lo:hi]
            if lin.bias is not None:
                lin.bias.data = bias[lo:hi]
            lo = hi
    return weight, bias


def _group_output(rt: "_Runtime", g: _Group, x: torch.Tensor):
    """Group g on x (_group_compute): [batch, seq, out_total] for one member; for several, its slices (views, made
    in one torch call: each call is host time in a decode step), kept until every member has taken its own."""
    if g.x is x:
        return g.out
    out = _group_compute(rt, g, x)
    if len(g.linears) > 1:
        out = out.split(g.widths, -1)
        g.x, g.out, g.unserved = x, out, (1 << len(g.linears)) - 1
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [batch, seq, in] as the ops' contiguous [rows, in] (a view where x is contiguous)."""
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else x.reshape(-1, x.shape[-1]).contiguous()


_LOOKUP = object()  # _group_compute's info not given: it looks it up (None means no row has an adapter)


def _group_compute(rt: "_Runtime", g: _Group, x: torch.Tensor, info=_LOOKUP) -> torch.Tensor:
    """[batch, seq, out_total]: the group's base GEMM on x plus every row's LoRA delta (one apply_lora). x goes to
    F.linear as it is and the members get plain slices of the result: in an eager decode step every extra torch
    call (a reshape, a view) is host time, which is what the step costs."""
    if info is _LOOKUP:
        info = rt.info_for(x)
    if info is None:
        return F.linear(x, g.weight, g.bias)  # the group's one GEMM (stacked weights); contiguous
    backend = rt.decode_backend if x.shape[1] == 1 else rt.backend
    if backend == "cuda" and x.is_cuda and x.is_contiguous():
        # GEMM and LoRA in one host call (the extension's sgmv_linear checks every argument): what an eager
        # decode step pays is host time, several µs per Python-to-C++ crossing. In a decode step the LoRA also
        # takes one launch instead of two (the same bits): its GPU waits on the host (1B, 32 rows, H100: 4.1 ms of
        # GPU work in a 13 ms step, bench/RESULTS.md).
        return CUDA.linear(x, g.weight, g.bias, g.lora_a, g.lora_b, info, g.offsets, one_launch=x.shape[1] == 1)
    out = F.linear(x, g.weight, g.bias)
    apply_lora(_rows(x), out.view(-1, out.shape[-1]), g.lora_a, g.lora_b, info, g.offsets, backend=backend)
    return out


def _mlp_forward(rt: "_Runtime", g: _Group, down, original, x, *args, **kwargs):
    """The patched forward of a gated SiLU MLP (group g: its gate_up): down(silu(gate) * up) from the stacked
    output, not kept: at prefill in one Triton pass (silu_mul_lora, the LoRA expand in it, or silu_mul_kernel when
    no row has an adapter), in decode steps torch's two ops on the halves (_hf_mlp.silu_mul)."""
    if rt.slots is None or args or kwargs:
        return original(x, *args, **kwargs)
    info = rt.info_for(x)
    if x.shape[1] > 1 and _hf_mlp.kernels_for(x):  # prefill (by phase, not size: a row's bits never follow its batch)
        gu = F.linear(x, g.weight, g.bias)
        if info is None:
            return down(_hf_mlp.silu_mul_kernel(gu))
        # The LoRA expand goes into the silu pass (silu_mul_lora): the stacked output, the layer's largest (twice the
        # MLP's width), is read once and never written back.
        # v in x's dtype, not zeroed: silu_mul_lora casts v to B's dtype before its dot (the same bits from half the
        # bytes), and reads only rows its work list covers, which the shrink writes.
        rows = _rows(x)
        v = torch.empty(rows.shape[0], g.lora_a.shape[1], dtype=x.dtype, device=x.device)
        sgmv_shrink(rows, g.lora_a, info, 2, out=v, backend=rt.backend)
        return down(_hf_mlp.silu_mul_lora(gu, v, g.lora_b, info))
    return down(_hf_mlp.silu_mul(_group_compute(rt, g, x, info)))


def _member_forward(rt: "_Runtime", g: _Group, index: int, original, x, *args, **kwargs):
    """The patched forward of slice `index` of group g (original: the module's own forward)."""
    if rt.slots is None:
        return original(x, *args, **kwargs)
    if args or kwargs:
        raise TypeError(f"a patched Linear takes only its input inside a MultiLoRAModel call, got extra arguments "
                        f"{len(args)} positional, {sorted(kwargs)} keyword")
    out = _group_output(rt, g, x)
    if len(g.linears) == 1:
        return out
    g.unserved &= ~(1 << index)
    if not g.unserved:  # every slice handed out: free the stacked output
        g.x = g.out = None
    return out[index]


class _Runtime:
    """Per-call state shared by the patched modules: the rows' slots and the batch infos built for them."""

    def __init__(self, pool: GpuAdapterPool, backend: str | None, max_tokens: int):
        self.pool = pool
        self.set_backend(backend)
        self.builder = BatchInfoBuilder(max_tokens, 64, pool.lora_ranks, pool.scalings)
        self.slots: list[int] | None = None
        self.infos: dict = {}

    def set_backend(self, backend: str | None) -> None:
        """backend for every forward, or None: the default of `enable_multi_lora` (cuda for decode steps where
        it is built and no LORA_KERNELS_BACKEND is set)."""
        self.backend = self.decode_backend = backend
        if backend is None and not os.environ.get("LORA_KERNELS_BACKEND") and self.pool.device.type == "cuda" \
                and HAS_CUDA_EXT:
            self.decode_backend = "cuda"

    def info_for(self, x: torch.Tensor):
        """The LoRABatchInfo of x [batch, seq, in] (rows batch*seq, one segment per request), built once per shape;
        None when no row has an adapter (nothing to add: the base model alone runs)."""
        if x.dim() != 3:
            raise ValueError(f"expected the decoder's hidden states [batch, seq, in], got shape {tuple(x.shape)}")
        batch, seq = x.shape[0], x.shape[1]
        key = (batch, seq)
        if key in self.infos:
            return self.infos[key]
        slots = self.slots
        if batch != len(slots):
            # generate() repeats each row for num_beams / num_return_sequences (repeat_interleave order).
            if batch % len(slots):
                raise ValueError(f"adapter_names has {len(slots)} entries but the model runs a batch of {batch} rows")
            slots = [s for s in slots for _ in range(batch // len(slots))]
        b = self.builder
        if batch * seq > b.max_tokens or batch > b.max_segments:
            self.builder = b = BatchInfoBuilder(max(b.max_tokens, 2 * batch * seq), max(b.max_segments, 2 * batch),
                                                self.pool.lora_ranks, self.pool.scalings)
        used = [s for s in slots if s >= 0]
        info = b.build([seq] * batch, slots, sort_by_adapter=len(set(used)) < len(used)) if used else None
        self.infos[key] = info
        return info


class MultiLoRAModel:
    """A transformers causal LM whose calls take `adapter_names=[...]` (one per row); see the module docstring.

    Attributes: model (the transformers model, patched), peft_model (or None), spec, pool, store, loader.
    """

    def __init__(self, model, adapters=None, *, num_slots=None, max_rank=None, backend=None, max_batch_tokens=8192):
        self.peft_model = model if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else None
        self.model = model.get_base_model() if self.peft_model is not None else model
        self.spec, layers = _check_architecture(self.model)
        self._targets = {id(getattr(getattr(layer, parent), m)): f"layers.{i}.{m}"
                         for i, layer in enumerate(layers) for m, (parent, _, _) in MEMBERS.items()}
        ref = base_linear(layers[0].self_attn.q_proj, "layers.0.self_attn.q_proj")
        self.device, self.dtype = ref.weight.device, ref.weight.dtype
        in_memory = self._read_peft_adapters()
        folders = _folder_mapping(adapters)
        names = list(in_memory) + list(folders)
        if len(set(names)) != len(names) or BASE in names:
            raise ValueError(f"adapter names must be unique and not {BASE!r}, got {names}")
        ranks = {n: w.rank for n, w in in_memory.items()} | {n: folder_rank(n, p) for n, p in folders.items()}
        if not ranks:
            raise ValueError("no adapters: pass a PeftModel with LoRA adapters or adapters={name: folder}")
        self.max_rank = max_rank or max(ranks.values())
        for n, r in ranks.items():
            _check_rank(n, r, self.max_rank)
        self.pool = GpuAdapterPool(self.spec, num_slots or len(names), self.max_rank, self.dtype, self.device)
        self.store = HostAdapterStore(self.spec, self.dtype, max_rank=self.max_rank)
        self.loader = AdapterLoader(self.pool, self.store)
        for n, w in in_memory.items():
            self.store.register(n, w)
        for n, p in folders.items():
            self.store.register_path(n, p)
        self._names = set(names)
        self._rt = _Runtime(self.pool, backend, max_batch_tokens)
        self._patched, self._groups, self._hooks = [], [], []
        self._patch(layers)
        self._hook_lm_head()

    # -- adapters ------------------------------------------------------------------------------------------

    @property
    def adapter_names(self) -> list[str]:
        return sorted(self._names)

    def add_adapter(self, name: str, path: str | Path) -> None:
        """Registers one more PEFT LoRA folder (read when first used); its rank must fit the pool's max rank."""
        if name in self._names or name == BASE:
            raise ValueError(f"adapter name {name!r} is already used (or reserved)")
        _check_rank(name, folder_rank(name, path), self.max_rank)
        self.store.register_path(name, path)
        self._names.add(name)

    def _read_peft_adapters(self) -> dict:
        if self.peft_model is None:
            return {}
        out = {}
        for name, config in self.peft_model.peft_config.items():
            check_peft_config(name, config)
            modules = collect_modules(name, self.peft_model, self._targets)
            out[name] = weights_from_modules(name, self.spec, modules, self.dtype)
        return out

    # -- calls ---------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def batch(self, adapter_names: Sequence[str]):
        """Within it, every forward of `model` applies row i's adapter `adapter_names[i]` (BASE: none)."""
        if self._rt.slots is not None:
            raise RuntimeError("MultiLoRAModel calls do not nest")
        if not self._patched:
            raise RuntimeError("this MultiLoRAModel was removed from its model; call enable_multi_lora again")
        names = list(adapter_names)
        unknown = sorted({n for n in names if n not in self._names and n != BASE})
        if not names or unknown:
            raise ValueError(f"unknown adapter name(s) {unknown} in adapter_names; known: {self.adapter_names} "
                             f"and {BASE!r} for the base model" if unknown else "adapter_names is empty")
        ids = sorted({n for n in names if n != BASE})
        if len(ids) > self.pool.num_slots:
            raise ValueError(f"the batch uses {len(ids)} distinct adapters but the pool has num_slots="
                             f"{self.pool.num_slots}; split the batch or pass a larger num_slots")
        slot_of = dict(zip(ids, self.loader.acquire(ids)))
        self._rt.slots, self._rt.infos = [slot_of.get(n, -1) for n in names], {}
        try:
            with torch.no_grad():
                yield self
        finally:
            self._rt.slots, self._rt.infos = None, {}
            for g in self._groups:  # nothing computed for this batch may serve another one
                g.x = g.out = None
            self.loader.release(ids)

    def __call__(self, *args, adapter_names: Sequence[str], **kwargs):
        """`model(*args, **kwargs)` with row i using adapter `adapter_names[i]`."""
        with self.batch(adapter_names):
            return self.model(*args, **kwargs)

    forward = __call__

    def generate(self, *args, adapter_names: Sequence[str], **kwargs):
        """`model.generate(*args, **kwargs)` with row i using adapter `adapter_names[i]` at every step."""
        with self.batch(adapter_names):
            return self.model.generate(*args, **kwargs)

    # -- patching ------------------------------------------------------------------------------------------

    def _patch(self, layers) -> None:
        for i, layer in enumerate(layers):
            by_group: dict[str, list] = {}
            for member, (parent, gname, sl) in MEMBERS.items():
                by_group.setdefault(gname, []).append((sl, member, getattr(getattr(layer, parent), member)))
            for gname, members in by_group.items():
                members.sort()
                lin = [base_linear(m, f"layers.{i}.{name}") for _, name, m in members]
                a, b, offsets = self.pool.weights(i, gname)
                g = _Group(lin, a, b, offsets)
                self._groups.append(g)
                for sl, _, m in members:
                    saved = m.__dict__.get("forward")
                    m.forward = functools.partial(_member_forward, self._rt, g, sl, m.forward)
                    self._patched.append((m, saved))
                if gname == "gate_up_proj":
                    self._patch_mlp(layer.mlp, g)

    def _patch_mlp(self, mlp, g: _Group) -> None:
        """mlp computes from its group's stacked output in one pass, where it is the gated SiLU MLP with gate and up
        of one width (else its own forward runs on the members' slices)."""
        widths = [b - a for a, b in zip(g.offsets, g.offsets[1:])]
        if len(widths) != 2 or widths[0] != widths[1] or not _hf_mlp.silu_gated(mlp):
            return
        saved = mlp.__dict__.get("forward")
        mlp.forward = functools.partial(_mlp_forward, self._rt, g, mlp.down_proj, mlp.forward)
        self._patched.append((mlp, saved))

    def _hook_lm_head(self) -> None:
        """lm_head gets its input contiguous inside a call. Prefill hands it the last position's slice of the hidden
        states ([batch, 1, hidden], a strided view); PEFT freezes the base weights, and for a weight that does not
        require grad torch's matmul does not fold such a view into one GEMM: it broadcasts the vocab-sized weight
        into a bmm (H200, 1B shape, 32 rows: 3.9 ms against ~0.1 ms, a fifth of the base prefill)."""
        head = self.model.get_output_embeddings() if hasattr(self.model, "get_output_embeddings") else None
        if head is None:
            return
        rt = self._rt

        def contiguous_input(module, args):
            if rt.slots is not None and args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
                return (args[0].contiguous(), *args[1:])
            return None
        self._hooks.append(head.register_forward_pre_hook(contiguous_input))

    def remove(self) -> None:
        """Restores the model's modules (their own forward again); the MultiLoRAModel is unusable after."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for m, saved in reversed(self._patched):
            if saved is None:
                del m.forward
            else:
                m.forward = saved
        self._patched = []
        for g in self._groups:
            g.unstack()
        self._groups = []


def _check_rank(name: str, rank: int, max_rank: int) -> None:
    if rank > max_rank:
        raise ValueError(f"adapter {name!r} has rank {rank}, above the pool's max_rank={max_rank} "
                         f"(pass a larger max_rank)")


def _folder_mapping(adapters) -> dict[str, Path]:
    if adapters is None:
        return {}
    if isinstance(adapters, Mapping):
        return {str(k): Path(v) for k, v in adapters.items()}
    if isinstance(adapters, (str, Path)):
        raise TypeError(f"adapters must be a mapping name -> folder or a list of folders, got {adapters!r}")
    return {Path(p).name: Path(p) for p in adapters}


def _check_architecture(model):
    """(ModelSpec, decoder layers) of a supported transformers causal LM; ValueError naming the supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(f"{v} ({k})" for k, v in SUPPORTED_MODEL_TYPES.items())
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {type(model).__name__} (model_type {model_type!r}); "
                         f"supported: {supported}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not len(layers):
        raise ValueError(f"{type(model).__name__} has no model.layers: expected a causal LM ({supported})")
    spec = ModelSpec.from_hf_config(config.to_dict())
    if spec.layers != len(layers):
        raise ValueError(f"config says {spec.layers} layers, the model has {len(layers)}")
    for g in spec.groups:
        names = [m for m, (_, gname, _) in MEMBERS.items() if gname == g.name]
        for name, width in zip(names, g.slice_widths):
            parent = MEMBERS[name][0]
            lin = base_linear(getattr(getattr(layers[0], parent), name), f"layers.0.{parent}.{name}")
            if tuple(lin.weight.shape) != (width, g.in_dim):
                raise ValueError(f"layers.0.{parent}.{name} weight has shape {tuple(lin.weight.shape)}, expected "
                                 f"{(width, g.in_dim)} from the config")
    return spec, layers
