"""The simulated model: a stack of decoder layers reduced to their linear layers, each with its LoRA.

Per layer, the base GEMMs of qkv_proj, o_proj, gate_up_proj and down_proj of a `ModelSpec` (random
weights), each followed by `apply_lora` on that layer's pool tensors, with RMS norms, residual adds and
SiLU-gating between them. Attention is replaced by passing the q slice on to o_proj, so every row depends
only on its own token: a request's outputs cannot depend on how it was batched, which is what the
cross-policy output check relies on. Layer 0's input is the token embedding itself (no norm), so its LoRA
outputs depend only on the token, the adapter and the kernel.
"""

from __future__ import annotations

import torch

from lora_kernels import apply_lora
from lora_kernels.adapters import GpuAdapterPool, ModelSpec


class LinearStack:
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, backend: str | None,
                 vocab: int = 4096, seed: int = 0):
        self.spec, self.dtype, self.backend = spec, dtype, backend
        gen = torch.Generator(device=device).manual_seed(seed)

        def rand(*shape, scale):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        # The embedding is the generator's first draw (tests rebuild it to compute a float64 reference).
        self.embed = rand(vocab, spec.hidden, scale=1.0)
        self.weights = [{g.name: rand(g.out_total, g.in_dim, scale=g.in_dim ** -0.5) for g in spec.groups}
                        for _ in range(spec.layers)]
        self.q_dim = spec.num_heads * spec.head_dim

    def _rms(self, h: torch.Tensor) -> torch.Tensor:
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(self.dtype)

    def _linear(self, pool: GpuAdapterPool, layer: int, group: str, x: torch.Tensor, info) -> torch.Tensor:
        out = x @ self.weights[layer][group].T
        a, b, offs = pool.weights(layer, group)
        apply_lora(x, out, a, b, info, offs, backend=self.backend)
        return out

    def forward(self, ids: torch.Tensor, info, pool: GpuAdapterPool, layers: int | None = None,
                before_layer=None) -> torch.Tensor:
        """The hidden states after every layer for token ids `ids` (one per row). With `layers` = k below the
        model's L, only the last k layers run, on the embeddings (a step-time sample: layer 0 alone would
        lack the input norm that every other layer has). before_layer(l) runs before layer l's first kernel
        (a layer-wise loader's `wait_layer`)."""
        h = self.embed[ids]
        inter = self.spec.intermediate
        total = self.spec.layers
        for layer in range(total) if layers is None or layers >= total else range(total - layers, total):
            if before_layer is not None:
                before_layer(layer)
            x = h if layer == 0 else self._rms(h)
            qkv = self._linear(pool, layer, "qkv_proj", x, info)
            h = h + self._linear(pool, layer, "o_proj", qkv[:, : self.q_dim].contiguous(), info)
            gu = self._linear(pool, layer, "gate_up_proj", self._rms(h), info)
            act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
            h = h + self._linear(pool, layer, "down_proj", act, info)
        return h
