"""lora_kernels.integrations.hf against PEFT's own mixed-adapter batches (tiny random Llama / Qwen2 / Mistral).

Reference: `PeftModel(..., adapter_names=[...])` and `PeftModel.generate(..., adapter_names=[...])`, the
mixed-batch path PEFT computes adapter by adapter. The adapters have random A and B (init_lora_weights=False),
so every one moves the logits far more than the tolerance (checked).
"""

import copy
import subprocess
import sys
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from lora_kernels.integrations import _hf_mlp  # noqa: E402
from lora_kernels.integrations.hf import BASE, enable_multi_lora  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Ranks and alphas all differ; one rsLoRA; one with rank_pattern + alpha_pattern; one on a subset of modules.
ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8),
    "beta": dict(r=8, lora_alpha=16, use_rslora=True),
    "gamma": dict(r=2, lora_alpha=4, rank_pattern={"q_proj": 6, "down_proj": 3}, alpha_pattern={"o_proj": 7}),
    "delta": dict(r=5, lora_alpha=3, target_modules=["q_proj", "v_proj", "down_proj"]),
}
ROWS = ["alpha", BASE, "beta", "gamma", "delta", "alpha"]


def tiny_config(arch: str, hidden=64, inter=96, heads=4, kv_heads=2, layers=2):
    common = dict(vocab_size=128, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    return cls(**common)


def tiny_base(arch: str, seed=0, dtype=torch.float32, device="cpu", **kw):
    torch.manual_seed(seed)
    cfg = tiny_config(arch, **kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def add_adapters(base, adapters=ADAPTERS, seed=1):
    torch.manual_seed(seed)
    pm = None
    for name, kw in adapters.items():
        kw = {"target_modules": ALL7, **kw}
        cfg = peft.LoraConfig(init_lora_weights=False, **kw)
        if pm is None:
            pm = peft.get_peft_model(base, cfg, adapter_name=name)
        else:
            pm.add_adapter(name, cfg)
    # Match the base's dtype (PEFT keeps fp32 adapter weights under bf16 bases by default).
    return pm.to(next(base.parameters()).dtype).eval()


def inputs(batch=len(ROWS), seq=9, device="cpu", seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch, 2):  # left padding on every other row, of different lengths
        mask[row, : 1 + row % 4] = 0
    ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_logits_match_peft_mixed_batch(arch):
    pm = add_adapters(tiny_base(arch))
    ids, mask = inputs()
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
        base = pm(input_ids=ids, attention_mask=mask, adapter_names=[BASE] * len(ROWS)).logits
    for row, name in enumerate(ROWS):  # the test can fail: each adapter moves its row's logits a lot
        moved = rel(ref[row], base[row])
        assert (moved > 1e-2) == (name != BASE), (name, moved)
    mlm = enable_multi_lora(pm)
    out = mlm(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
    assert rel(out, ref) <= 1e-5
    assert torch.equal(out[1], base[1])  # a __base__ row is exactly the base model's
    only_base = mlm(input_ids=ids, attention_mask=mask, adapter_names=[BASE] * len(ROWS)).logits
    assert torch.equal(only_base, base)  # (no row with an adapter: apply_lora is skipped)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_generate_matches_peft_left_padding(arch):
    pm = add_adapters(tiny_base(arch))
    ids, mask = inputs()
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = pm.generate(adapter_names=ROWS, **kw)
    mlm = enable_multi_lora(pm)
    out = mlm.generate(adapter_names=ROWS, **kw)
    assert out.shape == ref.shape == (len(ROWS), ids.shape[1] + 8)
    assert torch.equal(out, ref)
    # Beam search repeats each row (generate's repeat_interleave order); PEFT extends adapter_names the same way.
    kw.update(num_beams=2, num_return_sequences=2, max_new_tokens=4)
    assert torch.equal(mlm.generate(adapter_names=ROWS, **kw), pm.generate(adapter_names=ROWS, **kw))


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_triton_backend(fused_mlp, monkeypatch):
    """The Triton kernels through the integration (the interpreter on a CPU box): sorted segments, odd dims;
    fused_mlp: the MLP's prefill path, the gate_up expand fused into the silu pass (CUDA's default for prefill)."""
    pytest.importorskip("triton")
    if fused_mlp:  # the prefill path on the CPU too (under the interpreter there)
        monkeypatch.setattr(_hf_mlp, "kernels_for", lambda x: True)
        calls = []
        real = _hf_mlp.silu_mul_lora_kernel
        monkeypatch.setattr(_hf_mlp, "silu_mul_lora_kernel", lambda *a: calls.append(1) or real(*a))
    device = "cuda" if HAS_CUDA else "cpu"
    pm = add_adapters(tiny_base("llama", device=device))
    ids, mask = inputs(seq=5, device=device)
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
    out = enable_multi_lora(pm, backend="triton")(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
    assert rel(out, ref) <= 1e-5
    if fused_mlp:
        assert len(calls) == 2  # both layers' MLPs


def test_peft_folders_and_more_adapters_than_slots(tmp_path):
    base = tiny_base("llama")
    pm = add_adapters(copy.deepcopy(base))
    pm.save_pretrained(tmp_path)  # one folder per adapter, named by it
    paths = {name: tmp_path / name for name in ADAPTERS}
    mlm = enable_multi_lora(base, adapters=paths, num_slots=2)
    assert mlm.pool.num_slots == 2 and mlm.adapter_names == sorted(ADAPTERS)
    ids, mask = inputs(batch=4)
    batches = [["alpha", "beta", BASE, "alpha"], ["gamma", "delta", "gamma", BASE], ["beta", "gamma", "beta", "beta"],
               ["delta", "alpha", "alpha", "delta"], ["alpha", "beta", "alpha", "beta"]]
    for names in batches:
        with torch.no_grad():
            ref = pm(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        out = mlm(input_ids=ids, attention_mask=mask, adapter_names=names).logits
        assert rel(out, ref) <= 1e-5, names
    assert mlm.loader.stats["evictions"] >= 4 and mlm.loader.stats["loads"] >= 6
    with pytest.raises(ValueError, match="3 distinct adapters but the pool has num_slots=2"):
        mlm(input_ids=ids, attention_mask=mask, adapter_names=["alpha", "beta", "gamma", BASE])


def test_outside_calls_and_remove():
    pm = add_adapters(tiny_base("qwen2"))
    ids, mask = inputs()
    keys = list(pm.state_dict())
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
        pm.set_adapter("beta")
        single = pm(input_ids=ids, attention_mask=mask).logits
    values = {k: v.clone() for k, v in pm.state_dict().items()}
    mlm = enable_multi_lora(pm)
    assert list(pm.state_dict()) == keys  # the module tree is unchanged, and its values
    assert all(torch.equal(v, values[k]) for k, v in pm.state_dict().items())
    mlp = pm.get_base_model().model.layers[1].mlp
    assert "forward" in mlp.__dict__  # the gated SiLU MLP computes from the stacked gate_up output (_hf_mlp)
    attn = pm.get_base_model().model.layers[1].self_attn  # q/k/v are views of one stacked weight (one GEMM)
    qkv = [getattr(attn, m).get_base_layer() for m in ("q_proj", "k_proj", "v_proj")]
    assert len({lin.weight.untyped_storage().data_ptr() for lin in qkv}) == 1
    assert len({lin.bias.untyped_storage().data_ptr() for lin in qkv}) == 1  # qwen2: q/k/v biases too
    with torch.no_grad():  # outside a MultiLoRAModel call, PEFT works as before
        assert torch.equal(pm(input_ids=ids, attention_mask=mask).logits, single)
    out = mlm(input_ids=ids, attention_mask=mask, adapter_names=["beta"] * len(ROWS)).logits
    assert rel(out, single) <= 1e-5
    mlm.remove()
    assert "forward" not in mlp.__dict__
    assert len({lin.weight.untyped_storage().data_ptr() for lin in qkv}) == 3  # own storage again (saveable)
    assert all(torch.equal(v, values[k]) for k, v in pm.state_dict().items())
    with torch.no_grad():
        assert torch.equal(pm(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits, ref)
    with pytest.raises(RuntimeError, match="removed"):
        mlm(input_ids=ids, attention_mask=mask, adapter_names=ROWS)


def test_lm_head_input_contiguous_inside_calls():
    """Prefill with logits_to_keep=1 hands lm_head a strided [batch, 1, hidden] view; inside a call it gets a
    contiguous copy (one GEMM instead of a broadcast bmm for PEFT's frozen weight), outside and after remove()
    the view as before; the logits do not change."""
    pm = add_adapters(tiny_base("llama"))
    ids, mask = inputs()
    head = pm.get_base_model().get_output_embeddings()
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask, adapter_names=ROWS, logits_to_keep=1).logits
    mlm = enable_multi_lora(pm)
    seen = []  # the probe runs after the integration's hook (registration order)
    probe = head.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    with torch.no_grad():
        pm(input_ids=ids, attention_mask=mask, adapter_names=ROWS, logits_to_keep=1)  # outside a call
    out = mlm(input_ids=ids, attention_mask=mask, adapter_names=ROWS, logits_to_keep=1).logits
    assert seen == [False, True] and rel(out, ref) <= 1e-5
    mlm.remove()
    with torch.no_grad():
        pm(input_ids=ids, attention_mask=mask, adapter_names=ROWS, logits_to_keep=1)
    assert seen == [False, True, False]
    probe.remove()


def test_errors(tmp_path):
    pm = add_adapters(tiny_base("llama"))
    mlm = enable_multi_lora(pm)
    ids, mask = inputs()
    with pytest.raises(ValueError, match=r"unknown adapter name\(s\) \['nope'\].*known: \['alpha', 'beta'"):
        mlm(input_ids=ids, attention_mask=mask, adapter_names=["nope"] + ROWS[1:])
    with pytest.raises(ValueError, match="adapter_names has 5 entries but the model runs a batch of 6 rows"):
        mlm(input_ids=ids, attention_mask=mask, adapter_names=ROWS[:5])
    mlm.remove()
    with pytest.raises(ValueError, match=r"adapter 'beta' has rank 8, above the pool's max_rank=4"):
        enable_multi_lora(pm, max_rank=4)
    with pytest.raises(ValueError, match=r"unsupported architecture GPT2LMHeadModel .*LlamaForCausalLM \(llama\), "
                                         r"Qwen2ForCausalLM \(qwen2\), MistralForCausalLM \(mistral\)"):
        enable_multi_lora(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)))
    cases = [(dict(r=4, target_modules=ALL7, use_dora=True), "use_dora=True: DoRA"),
             (dict(r=4, target_modules=ALL7 + ["lm_head"]), "LoRA weights on .*lm_head"),
             (dict(r=4, target_modules=ALL7, modules_to_save=["lm_head"]), "modules_to_save")]
    for kw, msg in cases:
        bad = peft.get_peft_model(tiny_base("llama"), peft.LoraConfig(**kw), adapter_name="bad")
        with pytest.raises(ValueError, match=msg):
            enable_multi_lora(bad)
    merged = add_adapters(tiny_base("llama"), {"alpha": ADAPTERS["alpha"]})
    merged.merge_adapter()
    with pytest.raises(ValueError, match="merged adapters.*unmerge_adapter"):
        enable_multi_lora(merged)
    ia3 = peft.get_peft_model(tiny_base("llama"), peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                                   feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match="PEFT IA3 adapter; only plain LoRA"):
        enable_multi_lora(ia3)
    big = tmp_path / "big"
    add_adapters(tiny_base("llama"), {"big": dict(r=4, rank_pattern={"o_proj": 12})}).save_pretrained(big)
    with pytest.raises(ValueError, match=r"adapter 'big' has rank 12, above the pool's max_rank=8"):
        enable_multi_lora(tiny_base("llama"), adapters={"big": big / "big"}, max_rank=8)


def test_import_does_not_pull_transformers():
    code = ("import sys, lora_kernels, lora_kernels.integrations; "
            "bad = [m for m in ('transformers', 'peft') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- GPU ----------------------------------------------------------------------------------------------------

GPU_KW = dict(hidden=256, inter=512, heads=8, kv_heads=2, layers=2)  # real kernel tiles, still seconds


def norm_rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bf16_pair(arch, adapters=ADAPTERS, b_scale=0.3):
    """The same model + adapters in fp32 (the reference) and bf16, on the GPU. B is scaled down to a trained
    adapter's size (random A and B at PEFT's default init make deltas larger than the base output)."""
    pm32 = add_adapters(tiny_base(arch, device="cuda", **GPU_KW), adapters)
    with torch.no_grad():
        for name, p in pm32.named_parameters():
            if "lora_B" in name:
                p.mul_(b_scale)
    return pm32, copy.deepcopy(pm32).to(torch.bfloat16)


def check_bf16(out, ref16, ref32):
    """bf16 logits: within 1e-2 of PEFT's bf16 mixed batch (‖·‖ relative; the bf16 base model alone is ~8e-3
    from fp32 at these shapes), and no farther from the fp32 reference than PEFT's own bf16 result is."""
    assert norm_rel(out, ref16) <= 1e-2
    assert norm_rel(out, ref32) <= 1.25 * norm_rel(ref16, ref32) + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("mlp_kernel", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_bf16_matches_peft(arch, mlp_kernel, monkeypatch):
    """mlp_kernel: the MLP's one-pass kernels at prefill (the default; off: torch's two ops after apply_lora)."""
    monkeypatch.setenv("LORA_KERNELS_HF_MLP_KERNEL", "1" if mlp_kernel else "0")
    pm32, pm16 = bf16_pair(arch)
    ids, mask = inputs(device="cuda", seq=33)
    with torch.no_grad():
        ref32 = pm32(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
        ref16 = pm16(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
        base = pm16(input_ids=ids, attention_mask=mask, adapter_names=[BASE] * len(ROWS)).logits
    assert min(rel(ref32[i], base[i]) for i, n in enumerate(ROWS) if n != BASE) > 5e-2  # LoRA matters
    mlm = enable_multi_lora(pm16)
    out = mlm(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
    check_bf16(out, ref16, ref32)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    a, b = mlm.generate(adapter_names=ROWS, **kw), pm16.generate(adapter_names=ROWS, **kw)
    # bf16 rounding may flip a near-tie (then the rest of that row differs); most tokens must agree.
    assert a.shape == b.shape and (a == b).float().mean().item() >= 0.9


@pytest.mark.gpu
def test_gpu_fp32_matches_peft():
    pm = add_adapters(tiny_base("mistral", device="cuda", **GPU_KW))
    ids, mask = inputs(device="cuda", seq=17)
    with torch.no_grad():
        ref = pm(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
    mlm = enable_multi_lora(pm)
    out = mlm(input_ids=ids, attention_mask=mask, adapter_names=ROWS).logits
    assert rel(out, ref) <= 1e-4  # fp32 kernels use IEEE dots; only summation orders differ
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(mlm.generate(adapter_names=ROWS, **kw), pm.generate(adapter_names=ROWS, **kw))


@pytest.mark.gpu
def test_gpu_more_adapters_than_slots():
    many = {f"ad{i}": dict(r=[4, 8, 16][i % 3], lora_alpha=4 + 2 * i) for i in range(7)}
    pm32, pm16 = bf16_pair("llama", many, b_scale=0.1)
    few = enable_multi_lora(pm16, num_slots=3)  # loads and evictions on every step
    ids, mask = inputs(batch=4, device="cuda", seq=20)
    names = list(many)
    outs = []
    for step in range(6):
        rows = [names[(step * 2 + j) % 7] for j in (0, 1, 2)] + [BASE]
        with torch.no_grad():
            ref32 = pm32(input_ids=ids, attention_mask=mask, adapter_names=rows).logits
            ref16 = pm16(input_ids=ids, attention_mask=mask, adapter_names=rows).logits
        out = few(input_ids=ids, attention_mask=mask, adapter_names=rows).logits
        check_bf16(out, ref16, ref32)
        gen = few.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, max_new_tokens=4, do_sample=False)
        outs.append((rows, out, gen))
    torch.cuda.synchronize()
    assert few.loader.stats["evictions"] >= 6
    few.remove()
    # Every slot holds exactly its adapter: the same batches with all 7 resident give bitwise the same results
    # (a row's output does not depend on its slot index or on the rest of the batch).
    allres = enable_multi_lora(pm16, num_slots=7)
    for rows, out, gen in outs:
        assert torch.equal(allres(input_ids=ids, attention_mask=mask, adapter_names=rows).logits, out)
        assert torch.equal(allres.generate(input_ids=ids, attention_mask=mask, adapter_names=rows, max_new_tokens=4,
                                           do_sample=False), gen)


def test_bench_hf_smoke(tmp_path):
    """bench/bench_hf.py on the tiny shape (CPU, fp32): every variant is timed (prefill, generate decode and the
    fixed-context step), and the integration's mixed-batch logits equal PEFT's."""
    import json
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # CPU even on a GPU machine: the bench runs bf16 on CUDA, and this checks the fp32 bound.
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "hf.jsonl"
    proc = subprocess.run([sys.executable, str(root / "bench" / "bench_hf.py"), "--models", "tiny", "--quick",
                           "--adapters", "2,4", "--json", str(out)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=root / "bench")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["variant"], r["adapters"]) for r in rows} == {
        ("base", 0), ("peft_single", 1), ("peft_mixed", 2), ("peft_mixed", 4), ("lk_no_lora", 0), ("lk_mixed", 2),
        ("lk_mixed", 4)}
    assert all(r["prefill_ms"] > 0 and r["step_ms"] > 0 for r in rows)
    assert all(r["logits_rel_err"] <= 1e-5 for r in rows if r["variant"] == "lk_mixed")


def test_default_backend_per_phase(monkeypatch):
    """backend=None: decode steps (one position per row) on the cuda backend where it is built and the pool is on
    CUDA, other forwards on auto; an explicit backend or LORA_KERNELS_BACKEND applies to every forward."""
    from lora_kernels.integrations import hf

    rt = hf._Runtime.__new__(hf._Runtime)
    rt.pool = types.SimpleNamespace(device=torch.device("cuda"))
    monkeypatch.setattr(hf, "HAS_CUDA_EXT", True)
    monkeypatch.delenv("LORA_KERNELS_BACKEND", raising=False)
    rt.set_backend(None)
    assert (rt.backend, rt.decode_backend) == (None, "cuda")
    rt.set_backend("triton")
    assert (rt.backend, rt.decode_backend) == ("triton", "triton")
    monkeypatch.setenv("LORA_KERNELS_BACKEND", "triton")
    rt.set_backend(None)
    assert (rt.backend, rt.decode_backend) == (None, None)
    monkeypatch.delenv("LORA_KERNELS_BACKEND")
    monkeypatch.setattr(hf, "HAS_CUDA_EXT", False)
    rt.set_backend(None)
    assert rt.decode_backend is None
    monkeypatch.setattr(hf, "HAS_CUDA_EXT", True)
    rt.pool = types.SimpleNamespace(device=torch.device("cpu"))
    rt.set_backend(None)
    assert rt.decode_backend is None
