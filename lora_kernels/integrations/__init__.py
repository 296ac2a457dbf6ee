"""Integrations with other libraries. Each submodule imports its library only when it is itself imported, so
`import lora_kernels` never pulls in transformers or PEFT.

- `lora_kernels.integrations.hf`: a transformers causal LM (Llama, Qwen2, Mistral layouts) runs batches whose
  rows use different PEFT LoRA adapters through the package's pool, batch-info builder and `apply_lora`.
"""
