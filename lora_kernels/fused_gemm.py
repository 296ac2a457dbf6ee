"""A Triton GEMM whose epilogue adds the LoRA expand: ``out = x Wᵀ (+ bias) + scaling · v B_slotᵀ`` per row.

Used by `lora_linear(mode="fused")` after the shrink has written v (fp32, [T, S*R]). Against cuBLAS plus a
separate expand it saves the expand's read and write of `out` (at prefill the LoRA's largest traffic) and a
launch; it pays only if this GEMM keeps up with cuBLAS, which `bench/bench_layer.py` measures per regime.

Each program computes one [BLOCK_M, BLOCK_N] tile of out (grouped tile order for L2 reuse): the main loop
over K, then, for every segment overlapping the tile's rows (segments are contiguous row ranges: batches
without a permutation only), for every slice overlapping the tile's columns, one ``v_tile B_tileᵀ`` of
inner size R with that segment's rows masked in, scaled and added. Rows of slot -1 / rank-0 segments and
rows outside every segment get the base alone. Tile shapes depend only on (dtype, kernel), never on the
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
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, R_CHUNK: tl.constexpr):
    """acc + scaling · v[rows, slice] B[slot, cols, :rank]ᵀ for each segment and slice meeting the tile."""
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
                    # The rank in chunks of R_CHUNK (fewer live registers beside the GEMM tile); the other
                    # segments' rows are masked to 0 in vt, so they add exact zeros to acc.
                    for c in tl.static_range(BLOCK_R // R_CHUNK):
                        rj = c * R_CHUNK + tl.arange(0, R_CHUNK)
                        jmask = rj < rank
                        vt = tl.load(v_ptr + rm.to(tl.int64)[:, None] * NR + i * R + rj[None, :],
                                     mask=rmask[:, None] & jmask[None, :], other=0.0)
                        bt = tl.load(b_ptr + slot.to(tl.int64) * N * R + rn[:, None] * R + rj[None, :],
                                     mask=cmask[:, None] & jmask[None, :], other=0.0)
                        acc = tl.dot((vt * scale).to(bt.dtype), tl.trans(bt), acc, input_precision=DOT_PREC)
        s += 1
        seg_start = tl.load(seg_indptr + s)
    return acc


@triton.jit
def _tile(t, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile t -> (pid_m, pid_n), grouped GROUP_M row tiles at a time so W tiles are reused from L2."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    group = t // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (t % (GROUP_M * grid_n)) % size_m
    pid_n = (t % (GROUP_M * grid_n)) // size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["M", "cap"])
def _gemm_lora_kernel(x_ptr, w_ptr, bias_ptr, v_ptr, b_ptr, out_ptr, seg_indptr, weight_indices, lora_ranks,
                      scalings, M, N, K, cap, NR, R, o1, o2, o3,
                      HAS_BIAS: tl.constexpr, S: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
                      R_CHUNK: tl.constexpr):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
                         lora_ranks, scalings, cap, N, NR, R, o1, o2, o3, S, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_R,
                         R_CHUNK)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "cap"])
def _gemm_lora_tma_kernel(x_desc, w_desc, out_desc, bias_ptr, v_ptr, b_ptr, seg_indptr, weight_indices, lora_ranks,
                          scalings, M, N, K, cap, NR, R, o1, o2, o3,
                          HAS_BIAS: tl.constexpr, S: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
                          R_CHUNK: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """The same tile computation, persistent (one program per SM walks the tiles by a fixed stride) with
    TMA loads and stores (sm90+). Out-of-range tile parts load as zeros and are not stored."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _tile(t, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            xt = x_desc.load([m0, k])
            wt = w_desc.load([n0, k])
            acc = tl.dot(xt, wt.T, acc, input_precision=DOT_PREC)
        rm = m0 + tl.arange(0, BLOCK_M)
        rn = n0 + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        acc = _lora_epilogue(acc, m0, n0, rm, rn, v_ptr, b_ptr, seg_indptr, weight_indices, lora_ranks, scalings,
                             cap, N, NR, R, o1, o2, o3, S, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_R, R_CHUNK)
        out_desc.store([m0, n0], acc.to(out_desc.dtype))


# The persistent TMA kernel on sm90+ (and in the interpreter, which runs it too); LORA_KERNELS_FUSED_TMA=0, or
# setting this to False, keeps the pointer kernel (any GPU, any alignment).
USE_TMA = os.environ.get("LORA_KERNELS_FUSED_TMA", "1") != "0"
_NUM_SMS: dict[int, int] = {}


def _config(dtype: torch.dtype, n: int, k: int, block_r: int, tma: bool) -> dict:
    """Tile shape from (dtype, N, K, rank bucket) only, never from the batch: a row's result is
    batch-invariant. Checked offline for sm90 (triton.compile to a cubin, no GPU): the TMA kernel uses
    164 KB of shared memory and no local-memory spills at ranks 16 and 64 (bf16)."""
    if _INTERPRET:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
    if tma:  # 4 stages of 32 KB + the 32 KB output tile; the epilogue's rank chunks are small
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def supports(x: torch.Tensor, weight: torch.Tensor, info, slice_offsets) -> bool:
    """Whether gemm_lora can run these inputs (else lora_linear falls back to the overlapped mode)."""
    return (info.permutation is None and len(slice_offsets) - 1 <= 4 and weight.is_contiguous()
            and (x.device.type == "cuda" or _INTERPRET))


def _tma_ok(x, weight, out) -> bool:
    if not USE_TMA:
        return False
    if not _INTERPRET and torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    size = x.element_size()
    return all(t.data_ptr() % 16 == 0 for t in (x, weight, out)) and (x.shape[1] * size) % 16 == 0 \
        and (out.shape[1] * size) % 16 == 0


def _num_programs(device: torch.device) -> int:
    if _INTERPRET:
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


def gemm_lora(x, weight, bias, v, lora_b, info, slice_offsets, out) -> torch.Tensor:
    """out = x weightᵀ (+ bias) + LoRA expand of v, in one kernel. Arguments validated by the caller
    (lora_linear); `supports` must hold. v: fp32 [T, S*R] from sgmv_shrink."""
    M, K = x.shape
    N = weight.shape[0]
    if M == 0 or N == 0:
        return out
    S = len(slice_offsets) - 1
    R = lora_b.shape[2]
    bias = None if bias is None else bias.contiguous()  # the kernels read it with stride 1
    offs = list(slice_offsets[1:-1]) + [N] * (4 - S)
    block_r = max(16, triton.next_power_of_2(R))
    tma = _tma_ok(x, weight, out)
    cfg = _config(x.dtype, N, K, block_r, tma)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    meta = dict(HAS_BIAS=bias is not None, S=S, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
                BLOCK_R=block_r, R_CHUNK=min(block_r, 32), **cfg)
    lora_args = (bias if bias is not None else out, v, lora_b) + (out,) * (not tma) + (
        info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings, M, N, K, info.weight_indices.shape[0],
        v.shape[1], R, offs[0], offs[1], offs[2])
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
                 TensorDescriptor.from_tensor(out, [bm, bn]))
        nprog = _num_programs(x.device)
        _gemm_lora_tma_kernel[(nprog,)](*descs, *lora_args, NUM_PROGRAMS=nprog, **meta)
    else:
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _gemm_lora_kernel[grid](x, weight, *lora_args, **meta)
    return out
