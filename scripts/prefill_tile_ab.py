"""A/B of prefill tiles: standalone expand / shrink kernels (one program per (row tile, column tile), tall rows)
against the package's split and tall paths and a memcpy of the same bytes, per Llama-3-8B module, 8 segments x
1024 rows, distinct adapters, bf16, graph replay, 5 interleaved rounds. Every standalone kernel's output is
bit-compared with the package's split path (sgmv_shrink / sgmv_expand, triton backend). The standalone kernels are
the reference the tall path's table was set from (bench/RESULTS.md, sixth session); they are not in the package.

    python3 scripts/prefill_tile_ab.py [r16:qkv,gate_up,...]      (GPU)
    SMALL=1 TRITON_INTERPRET=1 python3 scripts/prefill_tile_ab.py  (CPU smoke: tiny shapes, fp32, no timing)
"""
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402
from lora_kernels import ops  # noqa: E402
from lora_kernels.batch_info import LoRABatchInfo  # noqa: E402
from lora_kernels.backends import triton as tb  # noqa: E402
from lora_kernels.backends.triton import plan as tplan  # noqa: E402

MODULES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
           "down": (14336, (4096,))}


@triton.jit
def _slot_rank(tslot, lora_ranks, pid_m):
    """Row tile pid_m's slot (clamped to 0 for slot -1) and rank (0 for slot -1)."""
    slot = tl.load(tslot + pid_m)
    active = slot >= 0
    s = tl.where(active, slot, 0)
    return s, tl.where(active, tl.load(lora_ranks + s), 0)


@triton.jit
def _tile_rows(trow0, tend, pid_m, BM: tl.constexpr):
    """Row tile pid_m's rows (int64) and their mask."""
    rows = tl.load(trow0 + pid_m) + tl.arange(0, BM)
    return rows.to(tl.int64), rows < tl.load(tend + pid_m)


@triton.jit
def _stream_expand(v_ptr, b_ptr, out_ptr, tslot, trow0, tend, lora_ranks, scalings, R, NR, OUT, off1, off2, off3,
                   N_COL, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BASE_FIRST: tl.constexpr,
                   GROUP_COLS: tl.constexpr, DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    if GROUP_COLS:
        pid_m = pid // N_COL
        pid_n = pid % N_COL
    else:
        n_rt = tl.num_programs(0) // N_COL
        pid_n = pid // n_rt
        pid_m = pid % n_rt
    s, rank = _slot_rank(tslot, lora_ranks, pid_m)
    if rank > 0:
        rows64, rmask = _tile_rows(trow0, tend, pid_m, BM)
        n = pid_n * BN + tl.arange(0, BN)
        n0 = pid_n * BN
        i = (n0 >= off1).to(tl.int32) + (n0 >= off2).to(tl.int32) + (n0 >= off3).to(tl.int32)
        j = tl.arange(0, BR)
        optr = out_ptr + rows64[:, None] * OUT + n[None, :]
        if BASE_FIRST:
            base = tl.load(optr, mask=rmask[:, None], other=0.0)
        vt = tl.load(v_ptr + rows64[:, None] * NR + i * R + j[None, :], mask=rmask[:, None] & (j < R)[None, :],
                     other=0.0)
        vt = tl.where((j < rank)[None, :], vt, 0.0).to(b_ptr.dtype.element_ty)
        bt = tl.load(b_ptr + s.to(tl.int64) * OUT * R + n[:, None] * R + j[None, :], mask=(j < R)[None, :],
                     other=0.0)
        bt = tl.where((j < rank)[None, :], bt, 0.0)
        scale = tl.load(scalings + s)
        acc = tl.dot(vt, tl.trans(bt), input_precision=DOT_PREC)
        if not BASE_FIRST:
            base = tl.load(optr, mask=rmask[:, None], other=0.0)
        tl.store(optr, (base.to(tl.float32) + scale * acc).to(out_ptr.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _stream_shrink(x_ptr, a_ptr, v_ptr, tslot, trow0, tend, lora_ranks, K, R, NR, k_chunk, N_COL,
                   SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid // N_COL
    pid_n = pid % N_COL
    s, rank = _slot_rank(tslot, lora_ranks, pid_m)
    rows64, rmask = _tile_rows(trow0, tend, pid_m, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    cmask = cols < NR
    live = cmask & ((cols % R) < rank)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if rank > 0:
        a_rows = a_ptr + (s.to(tl.int64) * NR + cols[:, None]) * K
        x_rows = x_ptr + rows64[:, None] * K
        for sp in range(SPLIT):
            kb = sp * k_chunk
            ke = tl.minimum(kb + k_chunk, K)
            c = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(kb, ke, BK):
                kk = k + tl.arange(0, BK)
                km = kk < ke
                at = tl.load(a_rows + kk[None, :], mask=live[:, None] & km[None, :], other=0.0)
                xt = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
                c = tl.dot(xt, tl.trans(at), c, input_precision=DOT_PREC)
            if sp == 0:
                acc = c
            else:
                acc += c
    acc = tl.where(live[None, :], acc, 0.0)
    tl.store(v_ptr + rows64[:, None] * NR + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])


def tall_tiles(seg_lens, slots, bm):
    s, r0, e = [], [], []
    start = 0
    for n, sl in zip(seg_lens, slots):
        for a in range(start, start + n, bm):
            s.append(sl)
            r0.append(a)
            e.append(start + n)
        start += n
    dev = DEV
    return (torch.tensor(s, dtype=torch.int32, device=dev), torch.tensor(r0, dtype=torch.int32, device=dev),
            torch.tensor(e, dtype=torch.int32, device=dev))


def med_range(xs):
    return statistics.median(xs), min(xs), max(xs)


SMALL = bool(int(__import__("os").environ.get("SMALL", "0")))
DEV = "cpu" if SMALL else "cuda"


def main():
    global MODULES
    torch.manual_seed(0)
    dev = DEV
    dt = torch.float32 if SMALL else torch.bfloat16
    if SMALL:
        MODULES = {"qkv": (64, (128, 64, 64)), "down": (256, (64,))}
    else:
        bw = common.copy_bandwidth_gbs()
        print(f"# {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s  triton {triton.__version__}", flush=True)
    seg_lens, slots_used = ([100, 37, 129] if SMALL else [1024] * 8), ([3, -1, 5] if SMALL else list(range(8)))
    T = sum(seg_lens)
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    results = []
    for R in (16, 64):
        for mname, (K, widths) in MODULES.items():
            if only and f"r{R}:{mname}" not in only and mname not in only:
                continue
            S = len(widths)
            offsets = tuple([0] + list(itertools.accumulate(widths)))
            OUT, NR = offsets[-1], S * R
            slots = 32
            ranks = torch.full((slots,), R, dtype=torch.int32, device=dev)
            scal = torch.rand(slots, device=dev) + 0.5
            info = LoRABatchInfo.from_segments(seg_lens, slots_used, ranks, scal)
            x = torch.randn(T, K, device=dev, dtype=dt)
            a = torch.randn(slots, NR, K, device=dev, dtype=dt) * 0.02
            b = torch.randn(slots, OUT, R, device=dev, dtype=dt) * 0.02
            out0 = torch.randn(T, OUT, device=dev, dtype=dt)
            # reference bits: package shrink (v fp32) and expand
            v_ref = ops.sgmv_shrink(x, a, info, S, backend="triton")
            ref_out = out0.clone()
            ops.sgmv_expand(v_ref, b, info, offsets, ref_out, backend="triton")
            out = out0.clone()
            copy_dst = torch.empty_like(out)
            cands = {}
            # memcpy of the expand's bytes (out read + written) and of the shrink's (x read; v tiny)
            cands["memcpy out"] = lambda: copy_dst.copy_(out)
            xc = torch.empty(T * K // 2, device=dev, dtype=dt)
            cands["memcpy x"] = lambda: xc.copy_(x.view(-1)[: T * K // 2])
            cands["pkg expand split"] = lambda: tb.BACKEND.sgmv_expand(v_ref, b, info, offsets, out)
            # package tall expand (the apply path's expand at prefill)
            sp = tplan.shrink_plan(K, S, R, dt, False, out.device)
            # (v in the adapters' dtype, as the package's tall path keeps it)
            tall_s, tall_e = tb._tall_steps(sp, x.shape, NR, R, offsets, dt, dt, info.max_tiles)
            w, rk, sc = info.work, info.lora_ranks, info.scalings
            v_tall = v_ref.to(dt)
            cands["pkg expand tall"] = lambda: tall_e(v_tall, b, out, w, rk, sc, w)
            vt_buf = torch.empty_like(v_ref)
            vt_tall = torch.empty_like(v_tall)
            cands["pkg shrink tall"] = lambda: tall_s(x, a, vt_tall, w, rk, w)
            cands["pkg shrink split"] = lambda: tb.BACKEND.sgmv_shrink(x, a, info, S, vt_buf)
            prec = "ieee" if dt == torch.float32 else "tf32"
            offs = list(offsets[1:-1]) + [OUT] * (4 - S)
            checks = {}
            for bm, bn, nw, ns, bf, gc in [(64, 64, 4, 1, 1, 1), (64, 128, 4, 1, 1, 1), (64, 128, 8, 1, 1, 1),
                                           (128, 64, 4, 1, 1, 1), (128, 128, 8, 1, 1, 1), (64, 256, 8, 1, 1, 1),
                                           (64, 128, 4, 1, 0, 1), (64, 128, 4, 1, 1, 0), (128, 128, 4, 1, 1, 1),
                                           (32, 128, 4, 1, 1, 1)]:
                if any(wd % bn for wd in widths):
                    continue
                tt = tall_tiles(seg_lens, slots_used, bm)
                ncol = OUT // bn
                grid = (tt[0].numel() * ncol,)
                br = max(16, R)
                name = f"exp expand bm{bm} bn{bn} w{nw} s{ns} basefirst{bf} colmajor{gc}"

                def run(o=None, bm=bm, bn=bn, nw=nw, ns=ns, bf=bf, gc=gc, tt=tt, ncol=ncol, grid=grid, br=br):
                    _stream_expand[grid](v_ref, b, out if o is None else o, tt[0], tt[1], tt[2], ranks, scal, R, NR,
                                         OUT, offs[0], offs[1], offs[2], ncol, BM=bm, BN=bn, BR=br, BASE_FIRST=bf,
                                         GROUP_COLS=gc, DOT_PREC=prec, num_warps=nw, num_stages=ns)
                chk = out0.clone()
                run(chk)
                checks[name] = torch.equal(chk, ref_out) if not SMALL else float((chk - ref_out).abs().max())
                cands[name] = run
            # shrink candidates: the table's split / k_chunk / BLOCK_K (the same chains, so the same bits)
            split, k_chunk, bk = sp.split, sp.k_chunk, sp.kw["BLOCK_K"]
            for bm, bn, nw, ns in [(64, 64, 4, 3), (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 4),
                                   (128, 128, 8, 3), (64, 256, 8, 3), (32, 128, 4, 3), (64, 64, 4, 2)]:
                bn_eff = min(bn, triton.next_power_of_2(NR))
                tt = tall_tiles(seg_lens, slots_used, bm)
                ncol = triton.cdiv(NR, bn_eff)
                grid = (tt[0].numel() * ncol,)
                name = f"exp shrink bm{bm} bn{bn_eff} w{nw} s{ns}"
                if name in cands:
                    continue

                def run_s(o=None, bm=bm, bn=bn_eff, nw=nw, ns=ns, tt=tt, ncol=ncol, grid=grid):
                    _stream_shrink[grid](x, a, vt_buf if o is None else o, tt[0], tt[1], tt[2], ranks, K, R, NR,
                                         k_chunk, ncol, SPLIT=split, BM=bm, BN=bn, BK=bk, DOT_PREC=prec, num_warps=nw,
                                         num_stages=ns)
                chk = torch.full_like(v_ref, float("nan"))
                try:
                    run_s(chk)
                except Exception as e:  # noqa: BLE001 (an experiment: report and go on)
                    print(f"  {name}: {type(e).__name__} {str(e)[:200]}")
                    continue
                checks[name] = torch.equal(chk, v_ref) if not SMALL else float((chk - v_ref).abs().max())
                cands[name] = run_s
            if SMALL:
                print(f"r{R} {mname}", {n: c for n, c in checks.items()})
                continue
            timers = {}
            for name, fn in cands.items():
                try:
                    timers[name] = common.GraphTimer([fn], inner=5)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name}: capture failed {type(e).__name__} {str(e)[:200]}")
            times = {n: [] for n in timers}
            for _ in range(5):
                for n, t in timers.items():
                    times[n].append(t.time_us(reps=10, warmup=2))
            ref_e = statistics.median(times["memcpy out"])
            ref_s = statistics.median(times["memcpy x"])
            print(f"\n## r{R} {mname}: T {T}, K {K}, OUT {OUT}, NR {NR}; memcpy(out) {ref_e:.1f} us "
                  f"memcpy(x) {ref_s:.1f} us; shrink split {split} k_chunk {k_chunk} BLOCK_K {bk}", flush=True)
            for n in timers:
                m, lo, hi = med_range(times[n])
                ref = ref_s if "shrink" in n or n == "memcpy x" else ref_e
                print(f"  {n:50s} {m:9.1f} us [{lo:.1f}, {hi:.1f}]  x ref {m / ref:5.2f}  "
                      f"bits {checks.get(n, '-')}")
                results.append((R, mname, n, m, m / ref, checks.get(n)))
            del timers, cands
            torch.cuda.empty_cache()


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"# done in {time.time() - t0:.0f} s")
