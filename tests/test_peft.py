"""PEFT adapters end to end: made with `peft` on a tiny random Llama, saved, read by us, applied with
`apply_lora` on a mixed batch, compared with PEFT's own forward of every linear layer (float64)."""

import copy
import json
import re
import shutil
import struct

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import lora_kernels as lk  # noqa: E402
from lora_kernels.adapters import (AdapterFormatError, AdapterLoader, GpuAdapterPool, HostAdapterStore,  # noqa: E402
                                   ModelSpec, load_peft_adapter)
from lora_kernels.adapters import peft as peft_mod  # noqa: E402
from lora_kernels.adapters.peft import MODULES  # noqa: E402

# Odd sizes on purpose: hidden 40, 5 heads of 8, 1 kv head, intermediate 36, 2 layers.
CFG = dict(hidden_size=40, intermediate_size=36, num_hidden_layers=2, num_attention_heads=5, num_key_value_heads=1,
           head_dim=8, vocab_size=32)
MAX_RANK = 8

ADAPTERS = {
    # all seven modules
    "full": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]),
    # q and v without k (a missing slice), rsLoRA, o/gate_up untargeted (missing groups)
    "qv_rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    # per-module ranks and alphas: slot rank 6 from the pattern, smaller ranks zero-padded, scalings folded
    "patterns": dict(r=4, lora_alpha=8, target_modules="all-linear",
                     rank_pattern={"o_proj": 2, "model.layers.1.self_attn.q_proj": 6},
                     alpha_pattern={"down_proj": 3, "k_proj": 20}),
    # only layer 1, only the MLP
    "layer1_mlp": dict(r=3, lora_alpha=5, target_modules=["gate_proj", "up_proj"], layers_to_transform=[1]),
}


def _llama_config():
    return transformers.LlamaConfig(**CFG)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{name: (folder, float64 PEFT model)} plus the float64 base model."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(_llama_config()).eval()
    root = tmp_path_factory.mktemp("peft")
    out = {}
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**kw))
        gen = torch.Generator().manual_seed(100 + i)
        for mod in model.modules():
            if isinstance(mod, peft.tuners.lora.LoraLayer):
                for p in (mod.lora_A["default"].weight, mod.lora_B["default"].weight):
                    with torch.no_grad():  # PEFT zero-inits lora_B: randomise so outputs differ
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        folder = root / name
        model.save_pretrained(folder)
        out[name] = (folder, model.double().eval())
    return out, base.double().eval()


def _peft_linear(model, layer: int, module: str):
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return getattr(getattr(model.base_model.model.model.layers[layer], parent), module)


def _spec():
    return ModelSpec.from_hf_config(_llama_config().to_dict())


def test_spec_from_config_matches_model():
    spec = _spec()
    assert (spec.layers, spec.hidden, spec.intermediate, spec.num_heads, spec.num_kv_heads, spec.head_dim) == \
        (2, 40, 36, 5, 1, 8)
    assert spec.group("qkv_proj").slice_widths == (40, 8, 8)
    assert spec.group("o_proj").in_dim == 40


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peft_round_trip_mixed_batch(made, dtype):
    adapters, base = made
    spec = _spec()
    pool = GpuAdapterPool(spec, num_slots=len(adapters), max_rank=MAX_RANK, dtype=dtype, device="cpu")
    store = HostAdapterStore(spec, dtype, max_rank=MAX_RANK)
    for name, (folder, _) in adapters.items():
        store.register_path(name, folder)
    loader = AdapterLoader(pool, store)
    # A mixed batch: every adapter, one request without LoRA, one adapter twice, uneven lengths.
    reqs = ["full", None, "qv_rslora", "patterns", "full", "layer1_mlp"]
    counts = [3, 2, 4, 1, 5, 2]
    slots = loader.acquire(reqs)
    builder = lk.BatchInfoBuilder(sum(counts), len(reqs), pool.lora_ranks, pool.scalings)
    info = builder.build(counts, slots)
    owners = [r for r, c in zip(reqs, counts) for _ in range(c)]
    assert pool.lora_ranks[loader.slot_of("patterns")] == 6  # slot rank = largest module rank
    gen = torch.Generator().manual_seed(7)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for layer in range(spec.layers):
        for g in spec.groups:
            x = torch.randn(len(owners), g.in_dim, generator=gen, dtype=torch.float64)
            xd = x.to(dtype)
            base_out = torch.cat([xd.double() @ _plain_linear(base, layer, m).weight.T for m in g.members], dim=1)
            out = base_out.to(dtype)  # random, never zeros: rows without LoRA must come back unchanged
            start = out.double()
            lora_a, lora_b, offsets = pool.weights(layer, g.name)
            lk.apply_lora(xd, out, lora_a, lora_b, info, offsets, backend="torch")
            want = start.clone()
            for t, owner in enumerate(owners):
                if owner is not None:
                    row = xd[t:t + 1].double()
                    peft_out = torch.cat([_peft_linear(adapters[owner][1], layer, m)(row) for m in g.members], dim=1)
                    want[t] += peft_out[0] - base_out[t]
            err = (out.double() - want).norm() / want.norm()
            assert err < tol, (layer, g.name, dtype, float(err))
            assert torch.equal(out[3:5], start[3:5].to(dtype))  # the request without LoRA
            assert (want - start).abs().max() > 1e-2  # the adapters do change this layer's outputs
    loader.release(reqs)


def _plain_linear(model, layer, module):
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return getattr(getattr(model.model.layers[layer], parent), module)


def test_missing_slice_and_group_add_exactly_zero(made):
    adapters, _ = made
    spec = _spec()
    w = load_peft_adapter(adapters["qv_rslora"][0], spec)
    a = w.lora_a[(0, "qkv_proj")]
    b = w.lora_b[(0, "qkv_proj")]
    offs = spec.group("qkv_proj").slice_offsets
    assert a[w.rank:2 * w.rank].abs().sum() == 0 and b[offs[1]:offs[2]].abs().sum() == 0  # no k_proj
    assert a[:w.rank].abs().sum() > 0 and a[2 * w.rank:].abs().sum() > 0
    assert (0, "o_proj") not in w.lora_a and (1, "gate_up_proj") not in w.lora_a
    assert w.scaling == pytest.approx(16 / 8 ** 0.5)  # rsLoRA


def test_rank_and_alpha_pattern_folded_into_b(made):
    adapters, model = made[0]["patterns"][0], made[0]["patterns"][1]
    spec = _spec()
    w = load_peft_adapter(adapters, spec, dtype=torch.float64)
    assert w.rank == 6 and w.scaling == pytest.approx(8 / 4)
    # o_proj has rank 2 and the default alpha: scaling 8/2 = 4 -> B multiplied by 4/2.
    peft_o = _peft_linear(model, 0, "o_proj")
    want_b = peft_o.lora_B["default"].weight.double() * (8 / 2) / w.scaling
    assert torch.allclose(w.lora_b[(0, "o_proj")][:, :2], want_b)
    assert w.lora_b[(0, "o_proj")][:, 2:].abs().sum() == 0 and w.lora_a[(0, "o_proj")][2:].abs().sum() == 0


# ---- bad files: each case gives its own clear error ------------------------------------------------------------

@pytest.fixture()
def folder(made, tmp_path):
    src = made[0]["qv_rslora"][0]
    dst = tmp_path / "adapter"
    shutil.copytree(src, dst)
    return dst


def _tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _save(folder, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(folder / "adapter_model.safetensors"))


def _raises(folder, text, **kw):
    with pytest.raises(AdapterFormatError, match="^" + re.escape(text) + "$"):
        load_peft_adapter(folder, kw.pop("spec", _spec()), **kw)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_bad_corrupt_file(folder):
    path = folder / "adapter_model.safetensors"
    size = path.stat().st_size
    path.write_bytes(b"\xff" * size)
    n = struct.unpack("<Q", b"\xff" * 8)[0]
    _raises(folder, f"{path}: corrupt or truncated safetensors file (header of {n} bytes in a {size}-byte file)")


def test_bad_corrupt_header_json(folder):
    path = folder / "adapter_model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("#")  # the header's opening brace
    path.write_bytes(bytes(data))
    with pytest.raises(AdapterFormatError, match="^" + re.escape(f"{path}: corrupt safetensors header (Expecting value")):
        load_peft_adapter(folder, _spec())


def test_bad_truncated_file(folder):
    path = folder / "adapter_model.safetensors"
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    begin, end = header[last]["data_offsets"]
    path.write_bytes(data[:-10])
    _raises(folder, f"{path}: tensor {last!r} needs bytes [{begin}, {end}) of the data but the file holds "
                    f"{end - 10}: file truncated")


def test_bad_unknown_key(folder):
    t = _tensors(folder)
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 40)
    _save(folder, t)
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: unknown tensor 'base_model.model.lm_head.lora_A.weight' (expected "
                    f"...layers.{{i}}.{{self_attn|mlp}}.{{{'|'.join(MODULES)}}}.lora_{{A|B}}.weight)")


def test_bad_untargeted_module(folder):
    t = _tensors(folder)
    key = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    t[key] = torch.ones(8, 40)
    _save(folder, t)
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: unknown tensor {key!r}: module model.layers.0.self_attn.o_proj is not targeted by "
                    f"target_modules={_target_repr(folder)}")


def _target_repr(folder):
    return repr(json.loads((folder / "adapter_config.json").read_text())["target_modules"])


def test_bad_layer_out_of_range(folder):
    t = _tensors(folder)
    key = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"
    t[key] = t[Q_A].clone()
    _save(folder, t)
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: tensor {key!r} is for layer 7 but the model has 2 layers")


def test_bad_missing_key(folder):
    t = _tensors(folder)
    del t["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    _save(folder, t)
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: missing tensor 'base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight' "
                    f"(target_modules={_target_repr(folder)} names it)")


def test_bad_shape_vs_spec(folder):
    spec = ModelSpec(layers=2, hidden=48, intermediate=36, num_heads=6, num_kv_heads=1, head_dim=8)
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: tensor {Q_A!r} has shape (8, 40) but the model spec and rank 8 need (8, 48) "
                    f"(torch.float32)", spec=spec)


def test_bad_shape_vs_rank(folder):
    t = _tensors(folder)
    t[Q_A] = t[Q_A][:5].contiguous()
    _save(folder, t)
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: tensor {Q_A!r} has shape (5, 40) but the model spec and rank 8 need (8, 40) "
                    f"(torch.float32)")


def test_bad_rank_above_pool_max(folder):
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: tensor {Q_A!r} has rank 8, above the pool's max rank 4", max_rank=4)


def test_bad_dtype_not_convertible(folder):
    t = _tensors(folder)
    t[Q_A] = torch.ones(8, 40, dtype=torch.int32)
    _save(folder, t)
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: tensor {Q_A!r} has dtype torch.int32, which does not convert to floating point "
                    f"(shape (8, 40))")


def test_bad_non_finite(folder):
    t = _tensors(folder)
    t[Q_A][3, 5] = float("nan")
    _save(folder, t)
    path = folder / "adapter_model.safetensors"
    _raises(folder, f"{path}: tensor {Q_A!r} has non-finite values (shape (8, 40))")


def test_bad_config_missing(folder):
    (folder / "adapter_config.json").unlink()
    path = folder / "adapter_config.json"
    _raises(folder, f"{path}: not found (a PEFT adapter folder holds adapter_config.json and "
                    f"adapter_model.safetensors)")


def test_bad_config_json(folder):
    path = folder / "adapter_config.json"
    path.write_text("{not json")
    with pytest.raises(AdapterFormatError, match="^" + re.escape(f"{path}: not valid JSON (")):
        load_peft_adapter(folder, _spec())


def test_bad_config_dora(folder):
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg["use_dora"] = True
    path.write_text(json.dumps(cfg))
    _raises(folder, f"{path}: use_dora=true is not supported (the kernels apply no DoRA magnitudes)")


def test_bad_weights_missing(folder):
    (folder / "adapter_model.safetensors").unlink()
    _raises(folder, f"{folder / 'adapter_model.safetensors'}: not found")


def test_store_rejects_rank_above_pool(made):
    spec = _spec()
    store = HostAdapterStore(spec, torch.float32, max_rank=4)
    path = made[0]["qv_rslora"][0] / "adapter_model.safetensors"
    want = "^" + re.escape(f"adapter 'x': {path}: tensor {Q_A!r} has rank 8, above the pool's max rank 4") + "$"
    with pytest.raises(AdapterFormatError, match=want):  # checked when registered ...
        store.register_path("x", made[0]["qv_rslora"][0])
    store.register_path("x", made[0]["qv_rslora"][0], check=False)
    with pytest.raises(AdapterFormatError, match=want):  # ... and when read
        store.get("x")


def test_native_read_heads_matches_the_python_reads(folder):
    """The extension's read_heads (config and safetensors header with one GIL release) returns what the Python
    reads return, and None (so the Python path raises the error that names the file) on a truncated header."""
    if peft_mod._read_heads is None:
        pytest.skip("extension not built")
    cpath, wpath = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    size, hraw = peft_mod._header_bytes(wpath)
    assert peft_mod._read_heads(str(cpath), str(wpath)) == (cpath.read_bytes(), size, hraw)
    assert peft_mod._read_heads(str(folder / "missing.json"), str(wpath)) is None
    assert peft_mod._read_heads(str(cpath), str(folder)) is None  # a directory
    wpath.write_bytes(wpath.read_bytes()[:20])  # the header's length now exceeds the file
    assert peft_mod._read_heads(str(cpath), str(wpath)) is None
