"""Does a row's `tl.dot` result depend on the tile height on this GPU?

Batch invariance (DESIGN §5) fixes every reduction order from the shapes. One order Triton does not
promise is the tensor-core instruction: a 16-row tile lowers to mma.sync and a 64-row one (sm90, 4 warps)
to wgmma. If both give the same bits for the same K chain, long segments may use taller tiles (fewer
re-reads of A and B) without changing any row's bits. This probe answers that on the device: the same
products, chained over BLOCK_K steps like the shrink (K = in_dim) and the expand (K = rank), at BLOCK_M 16,
32, 64 and 128 and 4 or 8 warps, compared with torch.equal; it prints the instruction each variant used.

    python3 scripts/triton_dot_bits.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chain(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           PREC: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    rm, cm = rows < M, cols < N
    xt = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=rm[:, None] & (kk < K)[None, :], other=0.0)
    wt = tl.load(w_ptr + cols[:, None] * K + kk[None, :], mask=cm[:, None] & (kk < K)[None, :], other=0.0)
    acc = tl.dot(xt, tl.trans(wt), input_precision=PREC)
    for k in range(BLOCK_K, K, BLOCK_K):
        km = (k + kk) < K
        xt = tl.load(x_ptr + rows[:, None] * K + (k + kk)[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        wt = tl.load(w_ptr + cols[:, None] * K + (k + kk)[None, :], mask=cm[:, None] & km[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PREC)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=rm[:, None] & cm[None, :])


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a TRITON_INTERPRET=1 dry run


def _run(x, w, bm, bn, bk, warps):
    M, K = x.shape
    N = w.shape[0]
    out = torch.full((M, N), float("nan"), device=x.device)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    k = _chain[(triton.cdiv(M, bm), triton.cdiv(N, bn))](x, w, out, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                        PREC=prec, num_warps=warps)
    ptx = getattr(k, "asm", {}).get("ptx", "") if k is not None else ""
    instr = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"
    return out, instr


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name() if DEV == "cuda" else "interpreter", "triton", triton.__version__)
    verdict = True
    # (what, M, N, K, BLOCK_N, BLOCK_K): shrink-like (K long, N = S*R) and expand-like (K = rank, N wide)
    shapes = [("shrink qkv r64", 300, 192, 4096, 64, 64), ("shrink r16", 300, 48, 4096, 64, 128),
              ("expand r64", 300, 256, 64, 128, 64), ("expand r16", 300, 256, 16, 128, 16)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32) if DEV == "cuda" else (torch.float32,):
        for what, M, N, K, bn, bk in shapes if dtype == torch.bfloat16 else shapes[::2]:
            x = torch.randn(M, K, device=DEV, dtype=dtype)
            w = torch.randn(N, K, device=DEV, dtype=dtype) * K ** -0.5
            ref, ref_instr = _run(x, w, 16, bn, bk, 4)
            parts = [f"16x4w {ref_instr}"]
            for bm, warps in ((32, 4), (64, 4), (64, 8), (128, 4)):
                out, instr = _run(x, w, bm, bn, bk, warps)
                same = torch.equal(out, ref)
                verdict &= same
                diff = (out - ref).abs().max().item()
                parts.append(f"{bm}x{warps}w {instr} {'EQUAL' if same else f'DIFF max {diff:.1e}'}")
            print(f"{str(dtype):15s} {what:15s} " + " | ".join(parts))
    print("row bits independent of BLOCK_M:", "YES" if verdict else "NO")


if __name__ == "__main__":
    main()
