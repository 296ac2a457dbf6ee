"""One serving simulation from a flat configuration: validation, adapters, engine, the policies, the check.

`SimConfig` holds what the CLI and bench/bench_serving.py set; `validate` turns every bad value into a
ValueError naming the option; `run_sim` replays one trace under each policy on one engine (each policy
starts from an empty pool) and compares every request's recorded LoRA outputs across policies.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lora_kernels.adapters.spec import ModelSpec
from lora_kernels.ops import MAX_RANK, resolve_backend
from lora_kernels.serve_sim import folders
from lora_kernels.serve_sim.engine import ModelEngine, Records, parse_host_budget
from lora_kernels.serve_sim.metrics import compare, summarize
from lora_kernels.serve_sim.scheduler import POLICIES, SchedulerConfig
from lora_kernels.serve_sim.sim import SimResult, simulate
from lora_kernels.serve_sim.trace import generate_trace, parse_dist, parse_range

MODELS = {
    # A few-MB model for CPU runs (the default): the same four module groups, small dims.
    "tiny": dict(layers=2, hidden=256, intermediate=512, num_heads=4, num_kv_heads=2, head_dim=64),
    "llama3-8b": dict(layers=32, hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8, head_dim=128),
    "llama2-7b": dict(layers=32, hidden=4096, intermediate=11008, num_heads=32, num_kv_heads=32, head_dim=128),
    "mistral-7b": dict(layers=32, hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8, head_dim=128),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class SimConfig:
    model: str = "tiny"
    layers: int | None = None  # None: the model's own
    adapters: int = 16
    slots: int = 4
    ranks: str = "8,16,32"  # adapter k has ranks[k % len(ranks)]
    max_rank: int | None = None  # pool max rank (None: the largest adapter rank)
    rate: float = 10.0  # requests per second (Poisson)
    requests: int = 80
    dist: str = "zipf:1.5"
    input_len: str = "16:128"
    output_len: str = "4:32"
    chunk: int = 64
    max_running: int = 16
    max_batch_tokens: int = 256
    max_prefetch: int = 4
    lookahead: int | None = None
    # Host memory for packed adapters: 'all' (every adapter packed at start: loads are copies only), 'P%'
    # of the adapters' packed bytes, or a size ('512MB'); the rest are read from their folders on demand.
    # 25% of 16 adapters ~ 4 adapters = the slots, as vLLM's default max_cpu_loras = max_loras.
    host_budget: str = "25%"
    policies: tuple[str, ...] = POLICIES
    dtype: str | None = None  # None: fp32 on CPU, bf16 on CUDA
    device: str | None = None
    backend: str | None = None
    adapter_dir: str | None = None  # existing PEFT folders instead of generated ones
    cache_dir: str | None = None
    seed: int = 0
    check: bool = True
    check_backends: tuple[str, ...] = ("torch",)
    sample: str = "ends"

    def spec(self) -> ModelSpec:
        s = ModelSpec(**MODELS[self.model])
        return s if self.layers is None else s.with_layers(self.layers)

    def rank_list(self) -> tuple[int, ...]:
        return tuple(int(r) for r in self.ranks.split(","))


def validate(cfg: SimConfig) -> SimConfig:
    """Checks every option; returns cfg with defaults filled in. Raises ValueError naming the option."""
    if cfg.model not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)}, got {cfg.model!r}")
    if cfg.layers is not None and cfg.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {cfg.layers}")
    for name in ("slots", "requests", "chunk", "max_running", "max_batch_tokens"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_prefetch < 0:
        raise ValueError(f"--max-prefetch must be >= 0, got {cfg.max_prefetch}")
    if cfg.lookahead is not None and cfg.lookahead < 1:
        raise ValueError(f"--lookahead must be >= 1, got {cfg.lookahead}")
    if not (cfg.rate > 0):
        raise ValueError(f"--rate must be > 0 requests/s (inf: all at once), got {cfg.rate}")
    kind, _ = parse_dist(cfg.dist)
    parse_host_budget(cfg.host_budget)
    parse_range(cfg.input_len, "--input-len")
    parse_range(cfg.output_len, "--output-len")
    if cfg.max_batch_tokens < cfg.chunk:
        raise ValueError(f"--max-batch-tokens={cfg.max_batch_tokens} must be >= --chunk={cfg.chunk}")
    bad = [p for p in cfg.policies if p not in POLICIES]
    if bad or not cfg.policies:
        raise ValueError(f"--policy must be 'all' or one of {POLICIES}, got {bad or 'none'}")
    if cfg.adapter_dir is None:
        try:
            ranks = cfg.rank_list()
        except ValueError:
            ranks = ()
        if not ranks or min(ranks) < 1:
            raise ValueError(f"--ranks must be a comma-separated list of ranks >= 1, e.g. 8,16,32,64, got {cfg.ranks!r}")
        if cfg.adapters < 1 and kind != "none":
            raise ValueError(f"--adapters must be >= 1, got {cfg.adapters}")
    max_rank = cfg.max_rank
    if max_rank is None:
        max_rank = max(cfg.rank_list()) if cfg.adapter_dir is None else MAX_RANK
    if not 1 <= max_rank <= MAX_RANK:
        raise ValueError(f"--max-rank must be in 1..{MAX_RANK}, got {max_rank}")
    if cfg.adapter_dir is None and max(cfg.rank_list()) > max_rank:
        raise ValueError(f"--ranks {cfg.ranks}: rank {max(cfg.rank_list())} > --max-rank {max_rank}")
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device must be cpu or cuda, got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    dtype = cfg.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    backend = resolve_backend(cfg.backend, dev)
    for b in cfg.check_backends:
        resolve_backend(b, dev)
    return dataclasses.replace(cfg, max_rank=max_rank, device=str(dev), dtype=dtype, backend=backend)


def adapter_folders(cfg: SimConfig, progress=None) -> list[Path]:
    if cfg.adapter_dir is not None:
        found = folders.list_adapter_dir(Path(cfg.adapter_dir))
        return found[: cfg.adapters] if cfg.adapters >= 1 else found
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    return folders.ensure_adapters(cfg.spec(), cfg.adapters, cfg.rank_list(), cfg.dtype, cfg.seed, cache, progress)


def make_trace(cfg: SimConfig, num_adapters: int, vocab: int = 4096):
    return generate_trace(cfg.requests, cfg.rate, cfg.dist, num_adapters, parse_range(cfg.input_len, "--input-len"),
                          parse_range(cfg.output_len, "--output-len"), vocab, cfg.seed)


def make_engine(cfg: SimConfig, paths: list[Path]) -> ModelEngine:
    return ModelEngine(cfg.spec(), paths, num_slots=cfg.slots, max_rank=cfg.max_rank, dtype=DTYPES[cfg.dtype],
                       device=torch.device(cfg.device), backend=cfg.backend, max_tokens=cfg.max_batch_tokens,
                       max_segments=cfg.max_running, seed=cfg.seed, host_budget=cfg.host_budget)


def scheduler_config(cfg: SimConfig, policy: str) -> SchedulerConfig:
    return SchedulerConfig(policy, cfg.slots, max_running=cfg.max_running, max_batch_tokens=cfg.max_batch_tokens,
                           chunk=cfg.chunk, max_prefetch=cfg.max_prefetch, lookahead=cfg.lookahead)


class Progress:
    """One self-overwriting line on stderr (at most 10 updates a second)."""

    def __init__(self, stream=sys.stderr, enabled: bool = True):
        self.stream, self.last = stream, 0.0
        self.enabled = enabled and stream.isatty()  # a log file gets no carriage-return frames
        self.label = ""

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if not self.enabled or (done < total and now - self.last < 0.1):
            return
        self.last = now
        width = 30
        fill = int(width * done / max(total, 1))
        self.stream.write(f"\r{self.label:<18} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


@dataclass
class Report:
    config: SimConfig
    rows: list[dict]
    results: dict[str, SimResult]
    records: dict[str, Records] = field(default_factory=dict)
    check: dict = field(default_factory=dict)
    unfed_steps: dict = field(default_factory=dict)
    adapter_ranks: list[int] = field(default_factory=list)
    host: dict = field(default_factory=dict)  # host tier: budget_mb, adapters_mb, budget_adapters

    def to_json(self) -> dict:
        return {"config": dataclasses.asdict(self.config), "host": self.host, "policies": self.rows,
                "vs_blocking": compare(self.rows), "check": self.check, "unfed_steps": self.unfed_steps,
                "clock": "simulated: measured step times (CUDA events / CPU thread time), host-stage wall times "
                         "(worker thread) and copy times, each stage on its own FIFO resource"}


def host_info(engine: ModelEngine) -> dict:
    cap = engine.store.capacity_bytes
    return {"budget_mb": None if cap is None else cap / 2 ** 20, "adapters_mb": sum(engine.packed_bytes) / 2 ** 20,
            "budget_adapters": engine.host_capacity_adapters()}


def compare_records(records: dict[str, Records], backend: str) -> dict:
    """Exact comparison of every request's recorded digests across policies (first policy = reference),
    plus the largest relative difference of the sampled rows (0.0 when identical)."""
    names = list(records)
    ref = records[names[0]]
    mismatched, positions, max_rel = set(), 0, 0.0
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
                    rel = float((orow.double() - row.double()).norm() / row.double().norm().clamp_min(1e-30))
                    max_rel = max(max_rel, rel)
    return {"backend": backend, "requests": len(ref.digests[backend]), "positions_compared": positions,
            "mismatched_requests": len(mismatched), "identical": not mismatched, "max_rel_diff": max_rel}


def run_sim(cfg: SimConfig, progress: Progress | None = None) -> Report:
    cfg = validate(cfg)
    if progress is not None:
        progress.label = "adapters"
    paths = adapter_folders(cfg, progress)
    engine = make_engine(cfg, paths)
    trace = make_trace(cfg, len(paths))
    report = Report(cfg, [], {}, adapter_ranks=engine.ranks, host=host_info(engine))
    backends = tuple(dict.fromkeys(cfg.check_backends + (cfg.backend,))) if cfg.check else ()
    threads = torch.get_num_threads()
    if engine.device.type == "cpu":
        # Small CPU matmuls run fastest on one thread, and a busy machine's other processes then cost
        # the measured step times least (two threads contending for two cores ran 15x slower).
        torch.set_num_threads(1)
    try:
        _run_policies(cfg, engine, trace, report, backends, progress)
    finally:
        torch.set_num_threads(threads)
        engine.close()
    if cfg.check and len(report.records) > 1:
        report.check = {b: compare_records(report.records, b) for b in backends}
    return report


def _run_policies(cfg, engine, trace, report, backends, progress) -> None:
    # Warm-up (discarded): first calls allocate, compile and fill caches; without it the first policy's
    # early steps would be timed slower than the others'.
    engine.record = None
    simulate(trace[: min(len(trace), 8)], scheduler_config(cfg, cfg.policies[0]), engine)
    for policy in cfg.policies:
        engine.record = Records(backends, cfg.sample) if cfg.check else None
        if progress is not None:
            progress.label = policy
        res = simulate(trace, scheduler_config(cfg, policy), engine, progress)
        report.results[policy] = res
        report.rows.append(summarize(res))
        report.unfed_steps[policy] = engine.unfed_steps
        if engine.record is not None:
            report.records[policy] = engine.record
