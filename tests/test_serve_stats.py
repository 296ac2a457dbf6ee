"""serve-sim statistics and the policies added for issue 20: the oracle, several host workers, loads started at
arrival, the bootstrap CI, and the progress bar's terminal rule."""

import math
import sys

import numpy as np
import pytest
import torch

from lora_kernels.serve_sim import run as sr
from lora_kernels.serve_sim.scheduler import POLICIES, SchedulerConfig
from lora_kernels.serve_sim.sim import StepTiming, simulate
from lora_kernels.serve_sim.stats import bootstrap_ci, per_run, summarize_runs
from lora_kernels.serve_sim.trace import Request, generate_trace

from test_serve_sim import TieredEngine

# -- statistics ---------------------------------------------------------------------------------------------


def test_bootstrap_ci_is_deterministic_and_brackets_the_median():
    rng = np.random.default_rng(7)
    v = rng.normal(10.0, 2.0, 7)
    med, lo, hi = bootstrap_ci(v)
    assert med == pytest.approx(float(np.median(v))) and lo < med < hi
    assert (med, lo, hi) == bootstrap_ci(v)  # fixed RNG seed
    assert lo >= v.min() and hi <= v.max()  # a percentile CI of the median stays within the data
    # Wider spread, wider interval; one value or equal values: no width.
    assert np.subtract(*bootstrap_ci(3 * v)[:0:-1]) == pytest.approx(3 * (hi - lo))
    assert bootstrap_ci([2.5]) == (2.5, 2.5, 2.5) and bootstrap_ci([1.0] * 5) == (1.0, 1.0, 1.0)
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def test_bootstrap_ci_covers_the_true_median_about_95_percent():
    rng = np.random.default_rng(3)
    hits = sum(lo <= 0.0 <= hi for _, lo, hi in (bootstrap_ci(rng.standard_normal(15), seed=s) for s in range(300)))
    assert 0.85 <= hits / 300 <= 0.995  # percentile bootstrap of a median: near nominal coverage at n = 15


def _row(policy, seed, ttft, e2e, p99=None, load=0.8, dist="zipf:1.5"):
    return {"dist": dist, "load": load, "seed": seed, "policy": policy, "rate": 10.0, "ttft_p50_ms": ttft,
            "ttft_p99_ms": p99 or 2 * ttft, "e2e_p50_ms": e2e}


def test_ratios_to_the_oracle_and_reductions_against_blocking():
    rows = []
    for seed, (o, b, p) in enumerate([(4.0, 8.0, 5.0), (5.0, 20.0, 6.0), (6.0, 9.0, 6.6)]):
        rows += [_row("oracle", seed, o, 10 * o), _row("blocking", seed, b, 10 * b), _row("overlap", seed, p, 10 * p)]
    runs = per_run(rows)
    ov = [e for e in runs if e["policy"] == "overlap"]
    assert [e["ttft_p50_x"] for e in ov] == pytest.approx([1.25, 1.2, 1.1])
    assert [e["ttft_p50_red"] for e in ov] == pytest.approx([1 - 5 / 8, 1 - 6 / 20, 1 - 6.6 / 9])
    assert [e["e2e_p50_x"] for e in ov] == pytest.approx([1.25, 1.2, 1.1])
    stats = {s["policy"]: s for s in summarize_runs(rows)}
    assert stats["overlap"]["seeds"] == 3 and stats["overlap"]["ttft_p50_x"]["median"] == pytest.approx(1.2)
    assert stats["oracle"]["ttft_p50_x"] == {"median": 1.0, "lo": 1.0, "hi": 1.0}
    assert stats["blocking"]["e2e_p50_red"]["median"] == 0.0
    # A run without an oracle gives NaN ratios, not a crash.
    assert math.isnan(per_run([_row("overlap", 0, 5.0, 50.0)])[0]["ttft_p50_x"])


# -- the oracle, host workers, loads at arrival ----------------------------------------------------------------


@pytest.mark.parametrize("dist", ["uniform", "zipf:1.2", "distinct"])
def test_oracle_runs_every_load_for_free_and_bounds_every_policy(dist):
    ranks = [1, 2, 4, 8, 3, 5, 7, 6]
    trace = generate_trace(60, 400.0, dist, 8, (4, 40), (1, 12), vocab=100, seed=1)
    res = {}
    for p in POLICIES:
        cfg = SchedulerConfig(p, num_slots=3, max_running=4, max_batch_tokens=48, chunk=16)
        eng = TieredEngine(ranks, cfg, host_slots=4)
        res[p] = simulate(trace, cfg, eng), eng
    oracle, eng = res["oracle"]
    assert oracle.loads == len(eng.loads) > 0 and oracle.host_reads > 0  # loads and reads really issued
    assert oracle.stall_s == 0 and all(e == s for lane, s, e, _ in oracle.timeline if lane != "compute")
    e2e = {p: np.mean([r.finished_at - r.req.arrival for r in r_.requests]) for p, (r_, _) in res.items()}
    assert e2e["oracle"] <= min(e2e.values()) + 1e-12


def test_host_stages_run_on_several_workers():
    """Two cold loads issued together: with one worker the second read waits for the first; with two they run
    at once (the copies stay FIFO on the one copy engine)."""
    tok = np.zeros(8, dtype=np.int64)
    trace = [Request(i, 0.0, a, 4, 1, tok[:4]) for i, a in enumerate([0, 1])]
    cfg = SchedulerConfig("blocking", num_slots=2, max_running=2, max_batch_tokens=16, chunk=16)
    spans = {}
    for workers in (1, 2):
        eng = TieredEngine([10, 30], cfg, host_slots=2)
        eng.host_workers = workers
        res = simulate(trace, cfg, eng)
        spans[workers] = sorted((lane, round(s, 6), round(e, 6)) for lane, s, e, _ in res.timeline if lane != "compute")
    assert spans[1] == [("copy", 5e-3, 6e-3), ("copy", 10e-3, 13e-3), ("host", 0, 5e-3), ("host", 5e-3, 10e-3)]
    assert spans[2] == [("copy", 5e-3, 6e-3), ("copy", 6e-3, 9e-3), ("host", 0, 5e-3), ("host", 0, 5e-3)]


def test_prefetch_starts_a_load_at_the_requests_arrival():
    """A long prefill step runs from t = 0; B arrives at 1 ms, mid-step, with an adapter on disk. overlap+prefetch
    starts B's load (read 5 ms + copy 1 ms) at its arrival, so it is ready at 7 ms; overlap issues it at the step's
    end. Both admit B at the first step boundary after its load is ready."""
    tok = np.zeros(64, dtype=np.int64)
    trace = [Request(0, 0.0, None, 48, 4, tok[:51]), Request(1, 1e-3, 1, 8, 2, tok[:9])]
    out = {}
    for p in ("overlap", "overlap+prefetch"):
        cfg = SchedulerConfig(p, num_slots=2, max_running=2, max_batch_tokens=48, chunk=48)
        eng = TieredEngine([10, 10], cfg, host_slots=2)
        eng.run_step = lambda plan: StepTiming(8e-3 if plan.num_tokens > 8 else 1e-3, 0.0)
        res = simulate(trace, cfg, eng)
        copy = [(s, e) for lane, s, e, _ in res.timeline if lane == "copy"]
        out[p] = copy, res.requests[1].admitted_at
    (copy, admitted) = out["overlap+prefetch"]
    assert copy == [pytest.approx((6e-3, 7e-3))] and admitted == pytest.approx(8e-3)  # joins right after the prefill
    (copy, admitted) = out["overlap"]
    assert copy == [pytest.approx((13e-3, 14e-3))] and admitted == pytest.approx(14e-3)  # 8 ms + 5 + 1, then 1 ms steps


# -- progress bar ------------------------------------------------------------------------------------------------


def test_progress_bar_only_on_a_terminal(monkeypatch, capsys):
    for tty, enabled, shown in ((True, True, True), (False, True, False), (True, False, False)):
        monkeypatch.setattr(sys.stdout, "isatty", lambda tty=tty: tty, raising=False)
        with sr.progress_bar(3, enabled, "runs") as bar:
            bar.update(3)
        err = capsys.readouterr().err
        assert ("runs" in err) == shown, (tty, enabled, err)


def test_make_stager_reads_back_the_workers_it_runs(monkeypatch):
    """The simulator places host stages on as many workers as the stager really runs: the count is passed where
    the constructor takes one and read back from the stager (one for the one-worker stager)."""
    from lora_kernels.serve_sim import engine as engine_mod

    stager, n = engine_mod.make_stager(object(), 3)
    assert n == 1 or n == 3  # 3 once HostStager takes a worker count, else its one worker
    stager.close()

    class Stager:
        def __init__(self, store, num_workers=2):
            self.num_workers = num_workers

    monkeypatch.setattr(engine_mod, "HostStager", Stager)
    assert engine_mod.make_stager(object(), 5)[1] == 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton runs CPU tensors only in its interpreter, which conftest "
                    "turns on where there is no GPU; test_serve_gpu.py checks the backends on the GPU")
def test_cli_reports_every_checked_backend(tmp_path):
    """--check-backends torch,triton (Triton in its interpreter here): both compared across policies; torch identical,
    and the Triton figure reported (max difference) whatever it is."""
    from lora_kernels.serve_sim.run import SimConfig, run_sim

    rep = run_sim(SimConfig(model="tiny", layers=1, adapters=3, slots=2, ranks="4,8", requests=5, rate=500.0, seeds=1,
                            input_len="2:9", output_len="1:3", chunk=8, max_batch_tokens=16, device="cpu",
                            backend="torch", check_backends=("torch", "triton"), cache_dir=str(tmp_path)))
    assert set(rep.check) == {"torch", "triton"} and rep.check["torch"]["identical"]
    assert rep.check["triton"]["positions_compared"] == rep.check["torch"]["positions_compared"] > 0
    assert rep.check["triton"]["max_rel_diff"] < 1e-4  # fp32 on the CPU


def test_timed_layers_runs_the_last_k_layers_and_scales_the_time(tmp_path):
    """timed_layers = 1 of 4: each step's forward runs one layer (the last, so it has its input norm) and the
    step is charged its measured time x 4; the recorded outputs are those of the full engine."""
    cfg = sr.validate(sr.SimConfig(model="tiny", layers=4, adapters=3, slots=3, ranks="4", requests=4, rate=math.inf,
                                   input_len="3:9", output_len="1:3", chunk=8, max_batch_tokens=32, device="cpu",
                                   backend="torch", check=False, cache_dir=str(tmp_path), timed_layers=1))
    engine = sr.make_engine(cfg, sr.adapter_folders(cfg))
    layers_run, seen = set(), []
    forward, linear = engine.model.forward, engine.model._linear

    def spy(ids, info, pool, layers=None, before_layer=None):
        seen.append(layers)
        return forward(ids, info, pool, layers, before_layer)

    def spy_linear(pool, layer, group, x, info):
        layers_run.add(layer)
        return linear(pool, layer, group, x, info)

    engine.model.forward, engine.model._linear = spy, spy_linear
    engine.timer.timed = lambda fn, gate, stream: (0.5e-3, fn())
    try:
        res = simulate(sr.make_trace(cfg, 3), sr.scheduler_config(cfg, "oracle"), engine)
    finally:
        engine.close()
    assert set(seen) == {1} and layers_run == {3}
    assert res.busy_s == pytest.approx(res.steps * 2e-3)
