"""Host time per `BatchInfoBuilder.build` (median, p99) against the version a user would write.

Batches: `decode` (every request 1 token) and `mixed` (chunked prefill: ~1 request in 4 is a prefill chunk
of 16-512 tokens, the rest decode, within the token budget); 1-1024 requests; eager and graph mode;
sort_by_adapter off and on. Slots follow a Zipf(1.2) popularity over 32 adapters, 10% without LoRA.
The baseline (`naive_build`) is Python lists -> torch.tensor(..., device=cuda) + cumsum + max().item().
Targets: <= 20 us for 256 decode requests in graph mode, <= 40 us for 256 mixed requests (issue 4), sorted
or not (SGMV v3: sorted prep within the same budgets, the work list included).

    python bench/bench_batch_info.py [--quick] [--json out.jsonl]
"""

from __future__ import annotations

import numpy as np
import torch

import common
from lora_kernels import BatchInfoBuilder, LoRABatchInfo, batch_info

MAX_TOKENS, MAX_SEGMENTS, NUM_SLOTS = 16384, 1024, 32
SIZES = (1, 16, 64, 256, 1024)
TARGETS = {("decode", 256, True): 20.0, ("mixed", 256, True): 40.0, ("mixed", 256, False): 40.0}  # any sort


def naive_build(counts, slots, lora_ranks, scalings) -> LoRABatchInfo:
    """What a user writes without a builder: a tensor per field, and a device read for the grid size."""
    device = lora_ranks.device
    seg_lens = torch.tensor(counts, dtype=torch.int32, device=device)
    weight_indices = torch.tensor(slots, dtype=torch.int32, device=device)
    seg_indptr = torch.zeros(len(counts) + 1, dtype=torch.int32, device=device)
    seg_indptr[1:] = torch.cumsum(seg_lens, 0)
    max_seg_len = int(seg_lens.max().item())  # the sync
    return LoRABatchInfo(seg_lens, seg_indptr, weight_indices, None, len(counts), max_seg_len,
                         int(sum(counts)), lora_ranks, scalings)


def make_batch(kind: str, n: int, rng: np.random.Generator, max_tokens: int = MAX_TOKENS):
    """(counts, slots) as Python lists, the form a scheduler holds them in."""
    p = 1.0 / np.arange(1, NUM_SLOTS + 1) ** 1.2
    slots = rng.choice(NUM_SLOTS, n, p=p / p.sum())
    slots[rng.random(n) < 0.1] = -1
    if kind == "decode":
        counts = np.ones(n, np.int64)
    else:
        counts = np.where(rng.random(n) < 0.25, rng.integers(16, 513, n), 1)
        if n == 1:
            counts[0] = rng.integers(16, 513)
        while counts.sum() > max_tokens:  # shrink the prefill chunks into the token budget
            counts = np.where(counts > 1, np.maximum(counts * 3 // 4, 2), counts)
    return [int(c) for c in counts], [int(s) for s in slots]


def primitives(device: torch.device, reps: int) -> list[dict]:
    """Host µs of the calls one build is made of, to see where the time goes."""
    import lora_kernels.batch_info as bi

    lst = list(range(256))
    arr = np.empty(1024, np.int32)
    pinned = torch.empty(4096, dtype=torch.int32, pin_memory=device.type == "cuda")
    src, dst = pinned[:3073], torch.empty(3073, dtype=torch.int32, device=device)
    cases = {
        "numpy: 256 Python ints into int32": lambda: arr.__setitem__(slice(0, 256), lst),
        "numpy: min of 256 int32": lambda: bi._min(arr[:256]),
        "numpy: cumsum of 1024 int32": lambda: np.cumsum(arr, dtype=np.int32, out=arr),
        "torch: copy_ 12 KB pinned -> device, non_blocking": lambda: dst.copy_(src, non_blocking=True),
        "torch: narrow + .to(device) 12 KB": lambda: pinned.narrow(0, 0, 3073).to(device, non_blocking=True),
        "torch: empty(device) + copy_ 12 KB": lambda: torch.empty(3073, dtype=torch.int32, device=device).copy_(
            src, non_blocking=True),
        "torch: split_with_sizes into 3": lambda: dst.split_with_sizes((1024, 1024, 1025)),
        "LoRABatchInfo(...)": lambda: LoRABatchInfo(dst, dst, dst, None, 1, 1, 1, dst, dst),
    }
    if device.type == "cuda":
        ev = torch.cuda.Event()
        stream = torch.cuda.current_stream()
        cases.update({
            "torch.cuda.current_stream()": torch.cuda.current_stream,
            "raw current stream handle": lambda: bi._raw_stream(device.index or 0),
            "Event.record(stream)": lambda: ev.record(stream),
            "Event.query()": ev.query,
        })
    arr[:] = 1
    return [{"bench": "batch_info_primitive", "call": k, **common.time_host_us(f, reps=reps)} for k, f in cases.items()]


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps = 200 if args.quick else 2000
    ranks = torch.full((NUM_SLOTS,), 16, dtype=torch.int32, device=device)
    scalings = torch.ones(NUM_SLOTS, device=device)
    builders = {mode: BatchInfoBuilder(MAX_TOKENS, MAX_SEGMENTS, ranks, scalings, cuda_graph=mode != "eager")
                for mode in ("eager", "graph")}
    if device.type == "cuda" and batch_info._fill_record is not None:  # the one-call graph build (opt-in)
        batch_info.NATIVE_COPY = True
        builders["graph native"] = BatchInfoBuilder(MAX_TOKENS, MAX_SEGMENTS, ranks, scalings, cuda_graph=True)
        batch_info.NATIVE_COPY = False
    rng = np.random.default_rng(0)
    rows = []
    for kind in ("decode", "mixed"):
        for n in SIZES:
            counts, slots = make_batch(kind, n, rng)
            variants = {(mode, sort): (lambda b=builders[mode], s=sort: b.build(counts, slots, sort_by_adapter=s))
                        for mode in builders for sort in (False, True)}
            variants["naive"] = lambda: naive_build(counts, slots, ranks, scalings)
            stalls = {m: b.stalls for m, b in builders.items()}
            times = common.time_host_interleaved_us(variants, reps=reps)
            naive = times.pop("naive")
            for (mode, sort), t in times.items():
                row = {"bench": "batch_info", "kind": kind, "requests": n, "tokens": sum(counts),
                       "mode": mode, "sort": sort, **t,
                       "naive_median_us": naive["median_us"], "naive_p99_us": naive["p99_us"],
                       "speedup": naive["median_us"] / t["median_us"]}
                target = TARGETS.get((kind, n, mode != "eager"))
                if target is not None:
                    row["target_us"] = target
                    row["target_met"] = t["median_us"] <= target
                row["stalls"] = builders[mode].stalls - stalls[mode]  # over all the rows of this batch
                rows.append(row)
    if device.type == "cuda":
        torch.cuda.synchronize()
    common.print_table(rows, ["kind", "requests", "tokens", "mode", "sort", "median_us", "p99_us",
                              "naive_median_us", "speedup", "stalls", "target_us", "target_met"])
    print(f"device: {common.device_name()}; builder capacity {MAX_SEGMENTS} requests / {MAX_TOKENS} tokens; "
          f"{reps} builds per row, the 5 variants of a batch timed in 5 interleaved rounds")
    prims = primitives(device, reps)
    common.print_table(prims, ["call", "median_us", "p99_us"])
    common.write_jsonl(args.json, rows + prims)


if __name__ == "__main__":
    main()
