"""What serve-sim records of every request's outputs, and the cross-policy comparison of those records.

After each timed step (outside the clock) the engine recomputes layer 0's qkv LoRA output of the step's
rows with every checked backend, from the token embeddings, the pool and the step's batch info: a row
depends only on its token, its adapter and the kernel, so a request's recorded outputs must not depend
on the policy that scheduled it. Per position an exact digest of the bits is kept, and for a sample of
positions the row itself (for a relative and absolute difference when digests differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lora_kernels import apply_lora


@dataclass
class Records:
    """Per request: digest of layer 0's qkv LoRA output per position, and sample rows for tolerance checks.

    digests[backend][rid]: int64 per processed position (exact bit pattern digest);
    rows[backend][rid]: {position: fp32 row of the LoRA output} for the positions in `sample`.
    """

    backends: tuple[str, ...]
    sample: str = "ends"  # "ends": first/last prompt and output positions; "all": every position
    digests: dict = field(default_factory=dict)
    rows: dict = field(default_factory=dict)
    _weights: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self):
        for b in self.backends:
            self.digests.setdefault(b, {})
            self.rows.setdefault(b, {})

    def positions(self, req) -> set[int]:
        if self.sample == "all":
            return set(range(req.num_positions))
        return {0, req.prompt_len - 1, req.num_positions - 1}

    def digest_weights(self, n: int, device) -> torch.Tensor:
        w = self._weights
        if w is None or w.numel() < n or w.device != torch.device(device):
            gen = torch.Generator().manual_seed(1234)
            self._weights = w = torch.randint(1, 1 << 20, (n,), generator=gen, dtype=torch.int64).to(device)
        return w[:n]

    def record_step(self, plan, x0: torch.Tensor, pool, info) -> None:
        """Recomputes layer 0's qkv LoRA output of the step's rows (`x0`: their embeddings) per backend and
        stores digests and sample rows under each request's id."""
        a, b, offs = pool.weights(0, "qkv_proj")
        outs = {}
        for backend in self.backends:
            out = torch.zeros(x0.shape[0], offs[-1], dtype=x0.dtype, device=x0.device)
            apply_lora(x0, out, a, b, info, offs, backend=backend)
            outs[backend] = out
        weights = self.digest_weights(offs[-1] * x0.element_size() // 2, x0.device)
        digests = {bk: digest(o, weights).cpu().numpy() for bk, o in outs.items()}
        row = 0
        for r, n in plan.batch:
            rid, pos = r.req.rid, r.pos
            keep = [p for p in range(pos, pos + n) if p in self.positions(r.req)]
            for bk in self.backends:
                d = self.digests[bk].setdefault(rid, np.zeros(r.req.num_positions, dtype=np.int64))
                d[pos:pos + n] = digests[bk][row:row + n]
                for p in keep:
                    self.rows[bk].setdefault(rid, {})[p] = outs[bk][row + p - pos].float().cpu()
            row += n


def digest(out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """int64 per row: Σ bits16[j] · w[j] over the row's 16-bit words — equal rows give equal digests, and
    any changed bit changes it (|terms| < 2^35, so the sum of ≤ 2^13 terms cannot overflow)."""
    words = out.contiguous().view(torch.int16).to(torch.int64)
    return (words * weights[: words.shape[1]]).sum(1)


def compare_records(records: dict[str, Records], backend: str) -> dict:
    """Exact comparison of every request's recorded digests across policies (first policy = reference), plus
    the largest relative (row norm) and absolute (element) difference of the sampled rows (0.0 when identical)."""
    names = list(records)
    ref = records[names[0]]
    mismatched, positions, max_rel, max_abs = set(), 0, 0.0, 0.0
    for name in names[1:]:
        other = records[name]
        for rid, d in ref.digests[backend].items():
            o = other.digests[backend].get(rid)
            positions += len(d)
            if o is None or not np.array_equal(d, o):
                mismatched.add(rid)
            for p, row in ref.rows[backend].get(rid, {}).items():
                orow = other.rows[backend].get(rid, {}).get(p)
                if orow is not None:
                    diff = orow.double() - row.double()
                    max_rel = max(max_rel, float(diff.norm() / row.double().norm().clamp_min(1e-30)))
                    max_abs = max(max_abs, float(diff.abs().max()))
    return {"backend": backend, "policies": names, "requests": len(ref.digests[backend]),
            "positions_compared": positions, "mismatched_requests": len(mismatched), "identical": not mismatched,
            "max_rel_diff": max_rel, "max_abs_diff": max_abs}
