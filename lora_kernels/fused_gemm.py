"""A Triton GEMM whose epilogue adds the LoRA expand: ``out = x Wᵀ (+ bias) + scaling · v B_slotᵀ`` per row.

Used by `lora_linear(mode="fused")` after the shrink has written v (fp32, [T, S*R]). Against cuBLAS plus a
separate expand it saves the expand's read and write of `out` (at prefill the LoRA's largest traffic) and a
launch; it pays only if this GEMM keeps up with cuBLAS, which `bench/bench_layer.py` measures per regime.

Each program computes one [BLOCK_M, BLOCK_N] tile of out (grouped tile order for L2 reuse): the main loop
over K, then, for every segment overlapping the tile's rows (segments are contiguous row ranges: batches
without a permutation only), for every slice overlapping the tile's columns, one ``v_tile B_tileᵀ`` of
inner size R with that segment's rows masked in, scaled and added. Rows of slot -1 / rank-0 segments and
rows outside every segment get the base alone. Tile shapes depend only on (N, K, dtype), never on the
batch, and a row's delta gets exact zeros from the other segments of its tile: batch-invariant.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _first_segment(seg_indptr, cap, m0):
    """The first segment s with seg_indptr[s + 1] > m0 (cap if none): binary search, indptr is sorted."""
    lo = 0
    hi = cap
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(seg_indptr + mid + 1) <= m0:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit
def _lora_epilogue(acc, m0, n0, rm, rn, v_ptr, b_ptr, seg_indptr, weight_indices, lora_ranks, scalings, cap, N, NR,
                   R, o1, o2, o3, S: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """acc + scaling · v[rows, slice] B[slot, cols, :rank]ᵀ for each segment and slice meeting the tile."""
    rj = tl.arange(0, BLOCK_R)
    total = tl.load(seg_indptr + cap)
    s = _first_segment(seg_indptr, cap, m0)
    m_end = tl.minimum(m0 + BLOCK_M, total)
    seg_start = tl.load(seg_indptr + s)
    while seg_start < m_end:
        seg_end = tl.load(seg_indptr + s + 1)
        slot = tl.load(weight_indices + s)
        rank = tl.load(lora_ranks + tl.maximum(slot, 0))
        if (slot >= 0) & (rank > 0) & (seg_end > seg_start):
            scale = tl.load(scalings + slot)
            rmask = (rm >= seg_start) & (rm < seg_end)
            jmask = rj < rank
            for i in tl.static_range(S):
                # Slice i covers columns [lo, hi) (o1..o3 are the inner slice offsets; S is a constexpr).
                if i == 0:
                    lo = 0
                elif i == 1:
                    lo = o1
                elif i == 2:
                    lo = o2
                else:
                    lo = o3
                if i == S - 1:
                    hi = N
                elif i == 0:
                    hi = o1
                elif i == 1:
                    hi = o2
                else:
                    hi = o3
                if (n0 < hi) & (n0 + BLOCK_N > lo):
                    cmask = (rn >= lo) & (rn < hi)
                    vt = tl.load(v_ptr + rm.to(tl.int64)[:, None] * NR + i * R + rj[None, :],
                                 mask=rmask[:, None] & jmask[None, :], other=0.0)
                    bt = tl.load(b_ptr + slot.to(tl.int64) * N * R + rn[:, None] * R + rj[None, :],
                                 mask=cmask[:, None] & jmask[None, :], other=0.0)
                    acc += scale * tl.dot(vt.to(bt.dtype), tl.trans(bt), input_precision=DOT_PREC)
        s += 1
        seg_start = tl.load(seg_indptr + s)
    return acc


@triton.jit(do_not_specialize=["M", "cap"])
def _gemm_lora_kernel(x_ptr, w_ptr, bias_ptr, v_ptr, b_ptr, out_ptr, seg_indptr, weight_indices, lora_ranks,
                      scalings, M, N, K, cap, NR, R, o1, o2, o3,
                      HAS_BIAS: tl.constexpr, S: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        xt = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        wt = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=DOT_PREC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    acc = _lora_epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, rm, rn, v_ptr, b_ptr, seg_indptr, weight_indices,
                         lora_ranks, scalings, cap, N, NR, R, o1, o2, o3, S, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_R)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _config(dtype: torch.dtype, n: int, k: int) -> dict:
    """Tile shape from (dtype, N, K) only: never from the batch, so a row's result is batch-invariant."""
    if _INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=256 if n >= 4096 else 128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def supports(x: torch.Tensor, weight: torch.Tensor, info, slice_offsets) -> bool:
    """Whether gemm_lora can run these inputs (else lora_linear falls back to the overlapped mode)."""
    return (info.permutation is None and len(slice_offsets) - 1 <= 4 and weight.is_contiguous()
            and (x.device.type == "cuda" or _INTERPRET))


def gemm_lora(x, weight, bias, v, lora_b, info, slice_offsets, out) -> torch.Tensor:
    """out = x weightᵀ (+ bias) + LoRA expand of v, in one kernel. Arguments validated by the caller
    (lora_linear); `supports` must hold. v: fp32 [T, S*R] from sgmv_shrink."""
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return out
    S = len(slice_offsets) - 1
    R = lora_b.shape[2]
    offs = list(slice_offsets[1:-1]) + [N] * (4 - S)
    cfg = _config(x.dtype, N, K)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _gemm_lora_kernel[grid](
        x, weight, bias if bias is not None else out, v, lora_b, out, info.seg_indptr, info.weight_indices,
        info.lora_ranks, info.scalings, M, N, K, info.weight_indices.shape[0], v.shape[1], R, offs[0], offs[1], offs[2],
        HAS_BIAS=bias is not None, S=S, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_R=max(16, triton.next_power_of_2(R)), **cfg)
    return out
