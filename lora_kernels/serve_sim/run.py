"""A serving simulation from a flat configuration: validation, adapters, engine, the grid of runs, the check.

`SimConfig` holds what the CLI and bench/bench_serving.py set; `validate` turns every bad value into a
ValueError naming the option. `run_grid` replays, per popularity, one trace per seed at each load level
under every policy on one engine (each policy starts from an empty pool and host tier). A load level is a
fraction of the measured capacity: blocking's throughput with every request of the seed-0 trace queued
at t = 0 (or one fixed `rate`). The first trace's runs record every request's LoRA outputs, compared
across policies per backend. `stats.summarize_runs` turns the rows into medians and CIs over seeds.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lora_kernels.adapters.spec import ModelSpec
from lora_kernels.adapters.tp import rank0_first, shard_spec
from lora_kernels.ops import MAX_RANK, resolve_backend
from lora_kernels.serve_sim import folders
from lora_kernels.serve_sim.engine import ModelEngine, parse_host_budget
from lora_kernels.serve_sim.metrics import summarize
from lora_kernels.serve_sim.records import Records, compare_records
from lora_kernels.serve_sim.scheduler import POLICIES, SchedulerConfig
from lora_kernels.serve_sim.sim import SimResult, simulate
from lora_kernels.serve_sim.stats import summarize_runs
from lora_kernels.serve_sim.trace import generate_trace, parse_dist, parse_range

MODELS = {
    # A few-MB model for CPU runs (the default): the same four module groups, small dims.
    "tiny": lambda: ModelSpec(layers=2, hidden=256, intermediate=512, num_heads=4, num_kv_heads=2, head_dim=64),
    "llama3-8b": lambda: ModelSpec.preset("llama3-8b"),
    "mistral-7b": lambda: ModelSpec.preset("llama3-8b"),  # the same linear dims
    "llama2-7b": lambda: ModelSpec(layers=32, hidden=4096, intermediate=11008, num_heads=32, num_kv_heads=32,
                                   head_dim=128),
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
    rate: float | None = None  # one fixed rate in requests/s (Poisson); None: the `loads` levels
    loads: str = "0.5,0.8,0.95"  # load levels: fractions of the measured capacity (blocking, all queued at t = 0)
    seeds: int = 5  # trace seeds per (popularity, load): seed, seed + 1, ...
    requests: int = 48  # per trace; the CLI runs (loads x seeds + 1) traces per popularity under each policy
    dist: str = "zipf:1.5"  # adapter popularity; a comma list runs each
    input_len: str = "16:128"
    output_len: str = "4:32"
    chunk: int = 64
    max_running: int = 16
    max_batch_tokens: int = 256
    max_prefetch: int = 4
    admit_within: float = 0.25  # overlap policies: a load ready within this share of a step joins it (scheduler.py)
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
    host_workers: int | None = None  # host-stage threads (None: min(4, cores) where the stager takes a count)
    timed_layers: int | None = None  # run and time only this many layers per step, charged x layers/timed
    tp: int = 1  # tensor-parallel ranks (torchrun): each runs its shard of base layers and adapters (adapters/tp.py)
    # Layer-wise loads: the host stage reports each layer, its copy is issued per layer, and a step may start
    # before an adapter's last layers are in place, waiting on the GPU at each layer (off under --tp).
    layerwise: bool = True

    def dist_list(self) -> tuple[str, ...]:
        return tuple(d.strip() for d in self.dist.split(","))

    def load_list(self) -> tuple[float | None, ...]:
        return (None,) if self.rate is not None else tuple(float(x) for x in self.loads.split(","))

    def trace_seeds(self) -> tuple[int, ...]:
        return tuple(range(self.seed, self.seed + self.seeds))

    def spec(self) -> ModelSpec:
        s = MODELS[self.model]()
        return s if self.layers is None else s.with_layers(self.layers)

    def rank_list(self) -> tuple[int, ...]:
        return tuple(int(r) for r in self.ranks.split(","))


def _validate_numbers(cfg: SimConfig) -> None:
    if cfg.model not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)}, got {cfg.model!r}")
    for name in ("slots", "requests", "chunk", "max_running", "max_batch_tokens", "seeds", "tp"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    for name in ("layers", "lookahead", "host_workers", "timed_layers"):
        if getattr(cfg, name) is not None and getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.max_prefetch < 0:
        raise ValueError(f"--max-prefetch must be >= 0, got {cfg.max_prefetch}")
    if not 0 <= cfg.admit_within <= 1:
        raise ValueError(f"--admit-within must be in [0, 1] (a share of a step), got {cfg.admit_within}")
    if cfg.rate is not None and not (cfg.rate > 0):
        raise ValueError(f"--rate must be > 0 requests/s (inf: all at once), got {cfg.rate}")
    try:
        loads = [float(x) for x in cfg.loads.split(",")]
    except ValueError:
        loads = []
    if not loads or not all(0 < x < math.inf for x in loads):
        raise ValueError(f"--loads must be a comma list of fractions of the capacity > 0, e.g. 0.5,0.8,0.95, "
                         f"got {cfg.loads!r}")
    for d in cfg.dist_list():
        parse_dist(d)
    parse_host_budget(cfg.host_budget)
    parse_range(cfg.input_len, "--input-len")
    parse_range(cfg.output_len, "--output-len")
    if cfg.max_batch_tokens < cfg.chunk:
        raise ValueError(f"--max-batch-tokens={cfg.max_batch_tokens} must be >= --chunk={cfg.chunk}")
    bad = [p for p in cfg.policies if p not in POLICIES]
    if bad or not cfg.policies:
        raise ValueError(f"--policy must be 'all' or one of {POLICIES}, got {bad or 'none'}")


def _validate_ranks(cfg: SimConfig) -> int:
    """The pool's max rank, after checking --ranks, --adapters and --max-rank."""
    if cfg.adapter_dir is None:
        try:
            ranks = cfg.rank_list()
        except ValueError:
            ranks = ()
        if not ranks or min(ranks) < 1:
            raise ValueError(f"--ranks must be a comma-separated list of ranks >= 1, e.g. 8,16,32,64, got {cfg.ranks!r}")
        if cfg.adapters < 1 and any(parse_dist(d)[0] != "none" for d in cfg.dist_list()):
            raise ValueError(f"--adapters must be >= 1, got {cfg.adapters}")
    max_rank = cfg.max_rank
    if max_rank is None:
        max_rank = max(cfg.rank_list()) if cfg.adapter_dir is None else MAX_RANK
    if not 1 <= max_rank <= MAX_RANK:
        raise ValueError(f"--max-rank must be in 1..{MAX_RANK}, got {max_rank}")
    if cfg.adapter_dir is None and max(cfg.rank_list()) > max_rank:
        raise ValueError(f"--ranks {cfg.ranks}: rank {max(cfg.rank_list())} > --max-rank {max_rank}")
    return max_rank


def validate(cfg: SimConfig) -> SimConfig:
    """Checks every option; returns cfg with defaults filled in. Raises ValueError naming the option."""
    _validate_numbers(cfg)
    shard_spec(cfg.spec(), 0, cfg.tp)  # --tp must divide the model's heads and intermediate size
    max_rank = _validate_ranks(cfg)
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
    # "auto" stays "auto" on CUDA, so that apply_lora picks per batch (its regime) as an engine's call would.
    name = cfg.backend or os.environ.get("LORA_KERNELS_BACKEND") or "auto"
    backend = "auto" if name == "auto" and dev.type == "cuda" else resolve_backend(name, dev)
    for b in cfg.check_backends:
        resolve_backend(b, dev)
    return dataclasses.replace(cfg, max_rank=max_rank, device=str(dev), dtype=dtype, backend=backend)


def adapter_folders(cfg: SimConfig, progress=None) -> list[Path]:
    if cfg.adapter_dir is not None:
        found = folders.list_adapter_dir(Path(cfg.adapter_dir))
        return found[: cfg.adapters] if cfg.adapters >= 1 else found
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    return folders.ensure_adapters(cfg.spec(), cfg.adapters, cfg.rank_list(), cfg.dtype, cfg.seed, cache, progress)


def make_trace(cfg: SimConfig, num_adapters: int, vocab: int = 4096, *, dist: str | None = None,
               rate: float | None = None, seed: int | None = None):
    return generate_trace(cfg.requests, cfg.rate if rate is None else rate, dist or cfg.dist_list()[0], num_adapters,
                          parse_range(cfg.input_len, "--input-len"), parse_range(cfg.output_len, "--output-len"),
                          vocab, cfg.seed if seed is None else seed)


def make_engine(cfg: SimConfig, paths: list[Path]) -> ModelEngine:
    tp_rank = torch.distributed.get_rank() if cfg.tp > 1 else 0
    return ModelEngine(cfg.spec(), paths, num_slots=cfg.slots, max_rank=cfg.max_rank, dtype=DTYPES[cfg.dtype],
                       device=torch.device(cfg.device), backend=cfg.backend, max_tokens=cfg.max_batch_tokens,
                       max_segments=cfg.max_running, seed=cfg.seed, host_budget=cfg.host_budget,
                       host_workers=cfg.host_workers, timed_layers=cfg.timed_layers, tp_rank=tp_rank, tp_size=cfg.tp,
                       layerwise=cfg.layerwise and cfg.tp == 1)


def scheduler_config(cfg: SimConfig, policy: str) -> SchedulerConfig:
    return SchedulerConfig(policy, cfg.slots, max_running=cfg.max_running, max_batch_tokens=cfg.max_batch_tokens,
                           chunk=cfg.chunk, max_prefetch=cfg.max_prefetch, lookahead=cfg.lookahead,
                           admit_within=cfg.admit_within)


def progress_bar(total: int, enabled: bool, desc: str):
    """A tqdm bar on stderr, shown only when `enabled` and stdout is a terminal (quiet under --json and in logs)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True, leave=False,
                disable=not (enabled and sys.stdout.isatty()))


@dataclass
class Report:
    config: SimConfig
    rows: list[dict] = field(default_factory=list)  # one per (dist, load, seed, policy) run
    capacity: dict = field(default_factory=dict)  # dist -> {"req_s", and the capacity run's summary}
    results: dict = field(default_factory=dict)  # dist -> policy -> SimResult of the first seed at the middle load
    shown: dict = field(default_factory=dict)  # dist -> {"load", "rate", "seed"} of those results
    records: dict = field(default_factory=dict)  # policy -> Records of the first run
    check: dict = field(default_factory=dict)  # backend -> compare_records(...)
    adapter_ranks: list[int] = field(default_factory=list)
    host: dict = field(default_factory=dict)  # host tier: budget_mb, adapters_mb, budget_adapters, workers

    @property
    def stats(self) -> list[dict]:
        return summarize_runs(self.rows)

    def to_json(self) -> dict:
        return {"config": dataclasses.asdict(self.config), "host": self.host, "capacity": self.capacity,
                "runs": self.rows, "stats": self.stats, "check": self.check,
                "clock": "simulated: measured step times (CUDA events / CPU thread time), host-stage wall times "
                         "(worker threads) and copy times, each stage on its own FIFO resource; the oracle's "
                         "loads run but take no simulated time"}


def host_info(engine: ModelEngine) -> dict:
    cap = engine.store.capacity_bytes
    arena = engine.store.arena
    return {"budget_mb": None if cap is None else cap / 2 ** 20, "adapters_mb": sum(engine.packed_bytes) / 2 ** 20,
            "budget_adapters": engine.host_capacity_adapters(), "workers": engine.host_workers,
            "arena_mb": None if arena is None else arena.nbytes / 2 ** 20}


def warm_up(cfg: SimConfig, engine) -> None:
    """First calls allocate, compile and fill caches; without this run (discarded) the first policy's early
    steps would be timed slower than the others'."""
    engine.record = None
    trace = make_trace(cfg, len(engine.ranks), rate=math.inf)[:8]
    simulate(trace, scheduler_config(cfg, cfg.policies[0]), engine)


def run_count(cfg: SimConfig) -> int:
    """Simulations `run_grid` runs (capacity runs included)."""
    per_dist = len(cfg.load_list()) * cfg.seeds * len(cfg.policies) + (cfg.rate is None)
    return len(cfg.dist_list()) * per_dist


def _rates(cfg: SimConfig, engine, report: Report, dist: str, on_run, bar) -> list[tuple[float | None, float]]:
    """(load, rate) per load level; measures the capacity first (blocking, seed-0 trace all queued at t = 0)."""
    if cfg.rate is not None:
        return [(None, cfg.rate)]
    trace = make_trace(cfg, len(engine.ranks), dist=dist, rate=math.inf)
    res = simulate(trace, scheduler_config(cfg, "blocking"), engine)
    row = {**summarize(res), "dist": dist, "load": math.inf, "rate": math.inf, "seed": cfg.seed}
    capacity = cfg.requests / res.makespan
    report.capacity[dist] = {"req_s": capacity, **row}
    if on_run is not None:
        on_run(row, res)
    bar.update(1)
    return [(f, f * capacity) for f in cfg.load_list()]


def run_grid(cfg: SimConfig, engine, report: Report, on_run: Callable[[dict, SimResult], None] | None = None,
             bar=None, stop: Callable[[], bool] | None = None) -> Report:
    """Every (popularity, load, seed) trace under every policy; rows into `report` (see the module docstring).
    Seed-major: the capacities first, then seed by seed every popularity and load, so that `stop()` (checked
    before each seed; True ends the grid) leaves every cell with the same seeds. `engine` is a `ModelEngine`
    or a wrapper of one; `on_run(row, result)` is called after each run."""
    backends = tuple(dict.fromkeys(cfg.check_backends + (cfg.backend,))) if cfg.check else ()
    bar = bar if bar is not None else progress_bar(run_count(cfg), False, "")
    rates = {}
    for dist in cfg.dist_list():
        bar.set_postfix_str(f"{dist} capacity")
        rates[dist] = _rates(cfg, engine, report, dist, on_run, bar)
    for si, seed in enumerate(cfg.trace_seeds()):
        if stop is not None and stop():
            break
        for dist in cfg.dist_list():
            for li, (load, rate) in enumerate(rates[dist]):
                trace = make_trace(cfg, len(engine.ranks), dist=dist, rate=rate, seed=seed)
                record = bool(backends) and dist == cfg.dist_list()[0] and li == si == 0
                keep = li == len(rates[dist]) // 2 and si == 0
                for policy in cfg.policies:
                    bar.set_postfix_str(f"seed {seed} {dist} load {load} {policy}")
                    _run_one(cfg, engine, report, trace, policy, dict(dist=dist, load=load, rate=rate, seed=seed),
                             Records(backends, cfg.sample) if record else None, keep, on_run)
                    bar.update(1)
    engine.record = None
    if len(report.records) > 1:
        report.check = {b: compare_records(report.records, b) for b in backends}
    return report


def _run_one(cfg, engine, report: Report, trace, policy: str, where: dict, record, keep: bool, on_run) -> None:
    engine.record = record
    res = simulate(trace, scheduler_config(cfg, policy), engine)
    row = {**summarize(res), **where, "unfed_steps": engine.unfed_steps, "unfed_loads": engine.unfed_loads}
    report.rows.append(row)
    if record is not None:
        report.records[policy] = record
    if keep:
        report.results.setdefault(where["dist"], {})[policy] = res
        report.shown[where["dist"]] = where
    if on_run is not None:
        on_run(row, res)


def run_sim(cfg: SimConfig, progress: bool = False) -> Report:
    """Validates `cfg`, prepares adapters and the engine, runs the grid; a progress bar on a terminal."""
    cfg = validate(cfg)
    with progress_bar(cfg.adapters, progress, "adapters") as bar:
        # under --tp rank 0 fills the adapter cache first, the other ranks then reuse it
        paths = rank0_first(lambda: adapter_folders(cfg, lambda done, total: bar.update(done - bar.n)))
    engine = make_engine(cfg, paths)
    report = Report(cfg, adapter_ranks=engine.ranks, host=host_info(engine))
    threads = torch.get_num_threads()
    if engine.device.type == "cpu":
        # Small CPU matmuls run fastest on one thread, and a busy machine's other processes then cost
        # the measured step times least (two threads contending for two cores ran 15x slower).
        torch.set_num_threads(1)
    try:
        warm_up(cfg, engine)
        with progress_bar(run_count(cfg), progress, "serve-sim") as bar:
            run_grid(cfg, engine, report, bar=bar)
    finally:
        torch.set_num_threads(threads)
        engine.close()
    return report
