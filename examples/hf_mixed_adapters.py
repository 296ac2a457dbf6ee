"""Serve requests that each use their own LoRA adapter, in one batch, with transformers' `generate`.

    python examples/hf_mixed_adapters.py                                     # tiny random model + adapters
    python examples/hf_mixed_adapters.py --model path/to/llama --adapter sql=path/to/peft_sql \\
        --adapter chat=path/to/peft_chat --prompt "sql:SELECT" --prompt "chat:Hello" --prompt "__base__:Hi"

Without --model, the script builds a tiny random-weight Llama and saves three random PEFT LoRA adapters as
folders (the same files `PeftModel.save_pretrained` writes for real ones), so it runs anywhere in seconds
(CPU or GPU). The steps are the same with a real model:

1. load the base model (transformers),
2. `enable_multi_lora(model, adapters={name: folder}, num_slots=...)`: adapters are read from their folders
   when first used, and loaded into `num_slots` device slots (fewer slots than adapters: least recently used
   ones are evicted),
3. `mlm.generate(input_ids, attention_mask=..., adapter_names=[one name per row])`: rows with different
   adapters (or "__base__" for none) share every forward; left padding and the KV cache work as usual.

The result is checked against PEFT's own mixed-adapter generate (greedy, same tokens) unless --no-check.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lora_kernels.integrations.hf import enable_multi_lora

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model_and_adapters(folder: Path):
    """A random 2-layer Llama (GQA) and three random PEFT LoRA folders of different ranks under `folder`."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    adapters = {"sql": LoraConfig(r=8, lora_alpha=16, target_modules=PROJECTIONS, init_lora_weights=False),
                "chat": LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=PROJECTIONS,
                                   init_lora_weights=False),
                "math": LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)}
    for name, cfg in adapters.items():  # a fresh PeftModel per adapter, saved as its own folder
        peft_model = get_peft_model(LlamaForCausalLM(config), cfg)
        peft_model.save_pretrained(folder / name)
    return model, {name: folder / name for name in adapters}


def left_pad(prompts: list[list[int]], pad_id: int):
    """input_ids and attention_mask for prompts of different lengths, padded on the left (as generate wants)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def check_against_peft(mlm, model, adapters, batches, pad_id, args):
    """PEFT's own mixed-adapter generate on the same model and folders must give the same tokens."""
    outs = []
    for batch in batches:
        ids, mask = left_pad([prompt for _, prompt in batch], pad_id)
        outs.append((ids.to(args.device), mask.to(args.device), [n for n, _ in batch]))
    ours = [mlm.generate(input_ids=i, attention_mask=m, adapter_names=n, max_new_tokens=args.max_new_tokens,
                         do_sample=False) for i, m, n in outs]
    mlm.remove()  # the model's own modules again, for PEFT to wrap
    names = list(adapters)
    peft_model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(adapters[name], adapter_name=name)
    peft_model.eval()
    same = total = 0
    for (i, m, n), out in zip(outs, ours):
        ref = peft_model.generate(input_ids=i, attention_mask=m, adapter_names=n, max_new_tokens=args.max_new_tokens,
                                  do_sample=False)
        same += (ref == out).sum().item()
        total += ref.numel()
    print(f"PEFT's mixed-batch generate agrees on {100 * same / total:.1f}% of tokens")
    exact = model.dtype == torch.float32 and args.device == "cpu"  # elsewhere rounding may flip a near-tie
    if same < total * (1.0 if exact else 0.9):
        raise SystemExit("mismatch with PEFT's generate")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a transformers Llama/Qwen2/Mistral folder (default: a tiny random model)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=FOLDER", help="a PEFT LoRA folder")
    p.add_argument("--prompt", action="append", default=[], metavar="ADAPTER:TEXT", help="needs --model")
    p.add_argument("--num-slots", type=int, default=2, help="adapters resident on the device at once")
    p.add_argument("--batch-size", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-check", action="store_true", help="skip the comparison with PEFT's generate")
    args = p.parse_args()

    tmp = tempfile.TemporaryDirectory()
    tokenizer = None
    if args.model:
        from transformers import AutoTokenizer

        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        adapters = dict(a.split("=", 1) for a in args.adapter)
        requests = [(q.split(":", 1)[0], tokenizer(q.split(":", 1)[1])["input_ids"]) for q in args.prompt]
    else:
        model, adapters = tiny_model_and_adapters(Path(tmp.name))
        g = torch.Generator().manual_seed(1)
        names = ["sql", "chat", "__base__", "math", "sql", "math"]
        requests = [(n, torch.randint(3, 256, (3 + 2 * i,), generator=g).tolist()) for i, n in enumerate(names)]
    model = model.to(args.device)
    pad_id = model.generation_config.pad_token_id = model.config.pad_token_id or 0

    # The one call: the model now takes adapter_names=[...] (one per row) in forward and generate.
    mlm = enable_multi_lora(model, adapters=adapters, num_slots=args.num_slots)

    # Serve the requests in batches; each batch mixes adapters (at most num_slots distinct ones per batch).
    batches = [requests[i:i + args.batch_size] for i in range(0, len(requests), args.batch_size)]
    for batch in batches:
        ids, mask = left_pad([prompt for _, prompt in batch], pad_id)
        ids, mask = ids.to(args.device), mask.to(args.device)
        adapter_names = [name for name, _ in batch]
        out = mlm.generate(input_ids=ids, attention_mask=mask, adapter_names=adapter_names,
                           max_new_tokens=args.max_new_tokens, do_sample=False)
        for (name, prompt), tokens in zip(batch, out[:, ids.shape[1]:].tolist()):
            text = tokenizer.decode(tokens) if tokenizer else tokens
            print(f"[{name:>8}] prompt of {len(prompt):2d} tokens -> {text}")
    print(f"adapters: {mlm.adapter_names}; device slots: {mlm.pool.num_slots}; loads: {mlm.loader.stats['loads']}, "
          f"evictions: {mlm.loader.stats['evictions']}")
    if not args.no_check:
        check_against_peft(mlm, model, adapters, batches, pad_id, args)
    tmp.cleanup()


if __name__ == "__main__":
    main()
