"""Shared check of what a pool slot holds after a load (CPU and GPU adapter tests)."""

import torch


def check_slot(pool, slot, w):
    """The slot holds `w` bit for bit where the kernels read, and zeroed A rows for untargeted groups."""
    R, r = pool.max_rank, w.rank
    assert int(pool.lora_ranks[slot]) == r
    assert float(pool.scalings[slot]) == torch.tensor(w.scaling, dtype=torch.float32).item()
    for layer in range(pool.spec.layers):
        for g in pool.spec.groups:
            a, b = pool.lora_a[layer][g.name][slot], pool.lora_b[layer][g.name][slot]
            if (layer, g.name) not in w.lora_a:
                assert all(a[i * R:i * R + r].abs().sum() == 0 for i in range(g.num_slices)), (layer, g.name)
                continue
            src_a, src_b = w.lora_a[(layer, g.name)].to(a.device), w.lora_b[(layer, g.name)].to(b.device)
            for i in range(g.num_slices):
                assert torch.equal(a[i * R:i * R + r], src_a[i * r:(i + 1) * r]), (layer, g.name, i)
            assert torch.equal(b[:, :r], src_b), (layer, g.name)
