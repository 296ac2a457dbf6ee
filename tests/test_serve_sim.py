"""serve-sim: trace generator, scheduler and policies (with a scripted-cost engine), the real engine on the
CPU (outputs identical across policies and equal to a float64 reference), and the CLI's error lines."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from lora_kernels.adapters import load_peft_adapter
from lora_kernels.serve_sim import folders
from lora_kernels.serve_sim.run import SimConfig, run_sim, validate
from lora_kernels.serve_sim.scheduler import POLICIES, SchedulerConfig
from lora_kernels.serve_sim.sim import LoadTiming, StepTiming, simulate
from lora_kernels.serve_sim.trace import Request, generate_trace, parse_dist, parse_range

# -- trace ------------------------------------------------------------------------------------------------


def _trace(n=200, rate=50.0, dist="uniform", adapters=8, seed=0, inp=(4, 40), out=(1, 12)):
    return generate_trace(n, rate, dist, adapters, inp, out, vocab=100, seed=seed)


def test_trace_is_deterministic_and_well_formed():
    a, b = _trace(seed=3), _trace(seed=3)
    assert [(r.arrival, r.adapter, r.prompt_len, r.output_len) for r in a] == \
           [(r.arrival, r.adapter, r.prompt_len, r.output_len) for r in b]
    assert all(np.array_equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert a[0].arrival == 0.0 and all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))
    assert all(4 <= r.prompt_len <= 40 and 1 <= r.output_len <= 12 for r in a)
    assert all(len(r.tokens) == r.prompt_len + r.output_len - 1 and r.tokens.max() < 100 for r in a)
    gaps = np.diff([r.arrival for r in _trace(n=2000, rate=50.0)])
    assert abs(gaps.mean() - 1 / 50) < 0.1 / 50  # Poisson at the asked rate
    assert _trace(seed=4)[5].arrival != a[5].arrival


def test_popularity_distributions():
    distinct = [r.adapter for r in _trace(n=40, dist="distinct", adapters=8)]
    assert distinct == [i % 8 for i in range(40)]
    zipf = np.bincount([r.adapter for r in _trace(n=4000, dist="zipf:1.5", adapters=16)], minlength=16)
    uni = np.bincount([r.adapter for r in _trace(n=4000, dist="uniform", adapters=16)], minlength=16)
    assert zipf.max() / 4000 > 0.3 and uni.max() / 4000 < 0.1  # 1/ζ-ish head vs 1/16
    bursty = [r.adapter for r in _trace(n=4000, dist="bursty:8", adapters=16)]
    runs = 1 + sum(x != y for x, y in zip(bursty, bursty[1:]))
    assert 4000 / runs > 5  # long runs on one adapter (mean 8 minus merges of equal neighbours)
    assert all(r.adapter is None for r in _trace(dist="none"))


@pytest.mark.parametrize("bad", ["zipf", "zipf:0", "zipf:x", "bursty:0.5", "pareto", "uniform:2"])
def test_parse_dist_rejects(bad):
    with pytest.raises(ValueError, match="--dist"):
        parse_dist(bad)


def test_parse_range():
    assert parse_range("7", "--x") == (7, 7) and parse_range("3:9", "--x") == (3, 9)
    for bad in ("0", "9:3", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--x"):
            parse_range(bad, "--x")


# -- scheduler and policies with a scripted-cost engine -----------------------------------------------------


class ScriptedEngine:
    """Step time = 1 ms + 10 us per row; load time = 0.1 ms per rank unit. Checks every invariant it can see."""

    def __init__(self, ranks, cfg: SchedulerConfig):
        self.ranks, self.cfg = ranks, cfg
        self.log = []

    def reset(self):
        self.resident, self.next_pos, self.loads = set(), {}, []

    def issue_load(self, a, v):
        assert a not in self.resident
        if v is not None:
            self.resident.remove(v)
        self.resident.add(a)
        assert len(self.resident) <= self.cfg.num_slots
        self.loads.append((a, v))
        return a

    def issue_stage(self, a):
        raise AssertionError("no host tier: nothing to stage")

    def host_resident(self):
        return None  # no host tier: every adapter is in host memory

    def host_budget(self):
        return None

    def load_seconds(self, a):
        return LoadTiming(0.0, 1e-4 * self.ranks[a], False)

    def run_step(self, plan):
        assert 0 < len(plan.batch) <= self.cfg.max_running and plan.num_tokens <= self.cfg.max_batch_tokens
        for r, n in plan.batch:
            assert r.adapter is None or r.adapter in self.resident, "batch uses an adapter without a slot"
            assert self.next_pos.get(r.req.rid, 0) == r.pos, "positions skipped or repeated"
            if r.pos < r.req.prompt_len:  # fixed chunk boundaries
                assert r.pos % self.cfg.chunk == 0 and n == min(self.cfg.chunk, r.req.prompt_len - r.pos)
            else:
                assert n == 1
            self.next_pos[r.req.rid] = r.pos + n
        self.log.append([(r.req.rid, r.adapter, n) for r, n in plan.batch])
        return StepTiming(1e-3 + 1e-5 * plan.num_tokens, 0.0)


def _simulate(trace, policy, ranks, **kw):
    cfg = SchedulerConfig(policy, **{"num_slots": 3, "max_running": 4, "max_batch_tokens": 48, "chunk": 16, **kw})
    eng = ScriptedEngine(ranks, cfg)
    return simulate(trace, cfg, eng), eng


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dist", ["uniform", "zipf:1.2", "distinct", "bursty:4"])
def test_policies_run_every_request_and_keep_invariants(policy, dist):
    ranks = [1, 2, 4, 8, 3, 5, 7, 6]
    trace = _trace(n=60, rate=400.0, dist=dist, adapters=8, seed=1)
    res, eng = _simulate(trace, policy, ranks)
    assert all(r.finished_at is not None and r.req.arrival <= r.first_token_at <= r.finished_at for r in res.requests)
    assert all(eng.next_pos[r.req.rid] == r.req.num_positions for r in res.requests)
    assert res.loads == len(eng.loads) and res.tokens == sum(r.req.num_positions for r in res.requests)
    # A victim is never the adapter of a running request: check with the requests' admit/finish times.
    t_load = [t for lane, t, _, _ in res.timeline if lane == "copy"]
    assert len(t_load) == res.loads
    if policy == "blocking":
        assert res.step_stall_s > 0  # loads stall steps
    elif policy == "oracle":
        assert res.step_stall_s == 0  # free loads
    else:  # a step waits only for a load usable within admit_within (0.25) of its measured lower bound
        steps = [(t0, t1) for lane, t0, t1, kind in res.timeline if lane == "compute" and kind != "stall"]
        assert res.step_stall_s <= 0.25 * max(t1 - t0 for t0, t1 in steps) * len(steps)
        strict, _ = _simulate(trace, policy, ranks, admit_within=0.0)
        assert strict.step_stall_s == 0  # the overlap rule alone: a step never waits for a load


def test_victims_are_never_used_by_running_requests():
    ranks = [1, 2, 4, 8, 3, 5, 7, 6]
    for policy in POLICIES:
        trace = _trace(n=80, rate=300.0, dist="uniform", adapters=8, seed=2)
        cfg = SchedulerConfig(policy, 3, max_running=3, max_batch_tokens=48, chunk=16)
        eng = ScriptedEngine(ranks, cfg)
        running = {}  # rid -> adapter, maintained from the step log

        orig_issue, orig_step = eng.issue_load, eng.run_step

        def issue(a, v, running=running, orig=orig_issue):
            assert v is None or v not in running.values(), f"{policy}: evicted {v}, used by a running request"
            return orig(a, v)

        def step(plan, running=running, orig=orig_step):
            out = orig(plan)
            for r, n in plan.batch:
                running[r.req.rid] = r.adapter
                if r.pos + n >= r.req.num_positions:
                    running.pop(r.req.rid)
            return out

        eng.issue_load, eng.run_step = issue, step
        simulate(trace, cfg, eng)


def test_no_lora_trace_is_the_same_under_every_policy():
    trace = _trace(n=50, rate=300.0, dist="none")
    results = [_simulate(trace, p, [1])[0] for p in POLICIES]
    ttfts = [[r.first_token_at for r in res.requests] for res in results]
    assert ttfts[0] == ttfts[1] == ttfts[2] and all(res.loads == 0 for res in results)


def test_prefetch_hides_a_queued_requests_load():
    """Two requests, one running slot: B waits behind A. Prefetch loads B's adapter while A runs; overlap
    and blocking load it only when B can be admitted, after A finishes."""
    tok = np.zeros(40, dtype=np.int64)
    trace = [Request(0, 0.0, 0, 16, 5, tok[:20]), Request(1, 0.0, 1, 16, 5, tok[:20])]
    kw = dict(num_slots=2, max_running=1, max_batch_tokens=16, chunk=16)
    t = {p: _simulate(trace, p, [10, 30], **kw)[0] for p in POLICIES}
    step = 1e-3 + 16e-5
    decode = 1e-3 + 1e-5
    a_done = 1e-3 + step + 4 * decode  # A's load (1 ms, nothing else to run), prefill, 4 decodes
    assert t["overlap+prefetch"].requests[1].first_token_at == pytest.approx(a_done + step)
    assert t["overlap"].requests[1].first_token_at == pytest.approx(a_done + 3e-3 + step)  # idle while loading
    assert t["blocking"].requests[1].first_token_at == pytest.approx(a_done + 3e-3 + step)  # stalled step
    assert t["blocking"].step_stall_s == pytest.approx(4e-3)
    assert t["overlap+prefetch"].stall_s == pytest.approx(1e-3)  # only A's first load (GPU idle)


class TieredEngine(ScriptedEngine):
    """ScriptedEngine with a host tier of `host_slots` adapters (LRU): a load or stage of an adapter not in it
    reads it (`read_s`); a load then copies it (0.1 ms per rank unit)."""

    def __init__(self, ranks, cfg, host_slots, read_s=5e-3):
        super().__init__(ranks, cfg)
        self.host_slots, self.read_s = host_slots, read_s

    def reset(self):
        super().reset()
        self.host, self.stages = [], []

    def _host_stage(self, a):
        cold = a not in self.host
        if not cold:
            self.host.remove(a)
        self.host.append(a)
        del self.host[: -self.host_slots]
        return cold

    def issue_load(self, a, v):
        super().issue_load(a, v)
        return a, self._host_stage(a)

    def issue_stage(self, a):
        cold = self._host_stage(a)
        self.stages += [a] if cold else []  # reads only (a stage of an adapter in host memory is a touch)
        return None, cold

    def host_resident(self):
        return set(self.host)

    def host_budget(self):
        return float(self.host_slots), [1] * len(self.ranks)

    def load_seconds(self, handle):
        a, cold = handle
        return LoadTiming(self.read_s if cold else 0.0, 0.0 if a is None else 1e-4 * self.ranks[a], cold)


def test_prefetch_reads_a_disk_only_adapter_ahead():
    """One slot, two requests, host memory for 3 adapters, empty: every load starts with a 5 ms folder read.
    While A runs, overlap+prefetch reads B's disk-only adapter into host memory (its slot is A's, so no GPU
    load can start), and B's load is then only the 1 ms copy; overlap and blocking read it after A finishes.
    With host memory for 1 adapter there is no room to stage beside it: nothing is staged."""
    tok = np.zeros(40, dtype=np.int64)
    trace = [Request(0, 0.0, 0, 16, 5, tok[:20]), Request(1, 0.0, 1, 16, 5, tok[:20])]
    runs = {}
    for p in POLICIES:
        cfg = SchedulerConfig(p, num_slots=1, max_running=1, max_batch_tokens=16, chunk=16)
        eng = TieredEngine([10, 10], cfg, host_slots=3)
        runs[p] = simulate(trace, cfg, eng), eng
    step, decode, read, copy = 1e-3 + 16e-5, 1e-3 + 1e-5, 5e-3, 1e-3
    a_done = read + copy + step + 4 * decode  # A: read + copy (nothing else can run), prefill, 4 decodes
    res, eng = runs["overlap+prefetch"]
    assert eng.stages == [1] and res.staged == 1 and res.host_reads == 2
    assert ("host", read, 2 * read, "read") in res.timeline  # B's read right after A's, while A runs
    assert res.requests[1].first_token_at == pytest.approx(a_done + copy + step)
    for p in ("overlap", "blocking"):
        res, eng = runs[p]
        assert eng.stages == [] and res.staged == 0 and res.host_reads == 2
        assert res.requests[1].first_token_at == pytest.approx(a_done + read + copy + step)
    assert runs["blocking"][0].step_stall_s == pytest.approx(2 * (read + copy))  # both loads stall a step
    cfg = SchedulerConfig("overlap+prefetch", num_slots=1, max_running=1, max_batch_tokens=16, chunk=16)
    res = simulate(trace, cfg, TieredEngine([10, 10], cfg, host_slots=1))
    assert res.staged == 0 and res.requests[1].first_token_at == pytest.approx(a_done + read + copy + step)


@pytest.mark.parametrize("host_slots", [2, 3, 6])
@pytest.mark.parametrize("dist", ["uniform", "zipf:1.2", "distinct", "bursty:4"])
def test_host_prefetch_does_not_thrash(dist, host_slots):
    """Staged adapters stay in the LRU host memory until their load: under overlap+prefetch no folder is read
    more often than loads need (reads <= loads), although most reads are staged ahead."""
    ranks = [1, 2, 4, 8, 3, 5, 7, 6]
    cfg = SchedulerConfig("overlap+prefetch", num_slots=3, max_running=4, max_batch_tokens=48, chunk=16)
    res = simulate(_trace(n=80, rate=400.0, dist=dist, adapters=8, seed=1), cfg,
                   TieredEngine(ranks, cfg, host_slots=host_slots))
    assert res.host_reads <= res.loads and (res.staged > 0 or dist.startswith("bursty"))


def test_host_hit_skips_the_read_and_reads_are_charged_fifo():
    """A host-memory hit costs only the copy; two cold loads issued together share the one host worker."""
    tok = np.zeros(40, dtype=np.int64)
    trace = [Request(i, 0.0, a, 4, 1, tok[:4]) for i, a in enumerate([0, 1, 0])]
    cfg = SchedulerConfig("blocking", num_slots=2, max_running=1, max_batch_tokens=16, chunk=16)
    eng = TieredEngine([10, 10], cfg, host_slots=2)
    eng.reset()
    eng.host = [0]  # adapter 0 is in host memory from the start
    eng.reset = lambda: None
    res = simulate(trace, cfg, eng)
    assert res.host_reads == 1 and res.loads == 2  # 0: a copy only (hit); 1: read + copy; 0 again: resident
    step = 1e-3 + 4e-5
    assert res.requests[0].first_token_at == pytest.approx(1e-3 + step)
    assert res.requests[1].first_token_at == pytest.approx(1e-3 + step + 5e-3 + 1e-3 + step)
    # Two cold loads issued at t = 0: the second read waits for the first, its copy for its read.
    trace = [Request(i, 0.0, a, 4, 1, tok[:4]) for i, a in enumerate([0, 1])]
    cfg = SchedulerConfig("blocking", num_slots=2, max_running=2, max_batch_tokens=16, chunk=16)
    res = simulate(trace, cfg, TieredEngine([10, 30], cfg, host_slots=2))
    host = [(s, e) for lane, s, e, kind in res.timeline if lane == "host" and kind == "read"]
    copy = [(s, e) for lane, s, e, kind in res.timeline if lane == "copy" and kind == "load"]
    assert [t for se in host + copy for t in se] == pytest.approx([0, 5e-3, 5e-3, 10e-3, 5e-3, 6e-3, 10e-3, 13e-3])
    assert res.requests[0].first_token_at == pytest.approx(13e-3 + 1e-3 + 8e-5)


def test_scheduler_config_rejects():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig("eager", 4)
    with pytest.raises(ValueError, match="num_slots"):
        SchedulerConfig("overlap", 0)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SchedulerConfig("overlap", 4, max_batch_tokens=8, chunk=16)


# -- the real engine on the CPU: identical outputs across policies, equal to a float64 reference -----------

TINY = dict(model="tiny", layers=1, adapters=5, slots=2, ranks="4,8,16", rate=400.0, requests=14,
            input_len="3:20", output_len="1:5", chunk=8, max_running=4, max_batch_tokens=24, device="cpu",
            backend="torch", sample="all", host_budget="50%", seeds=1)  # ~2.5 of 5 adapters in host memory, the rest on disk


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    # Whole loads: blocking's stall then covers every folder read (a layer-wise load's copy starts at the read's
    # last layer, before the stage's own bookkeeping ends). Layer-wise runs: test_layerwise_outputs_identical_...
    cfg = SimConfig(**TINY, dist="uniform", cache_dir=str(tmp_path_factory.mktemp("cache")), layerwise=False)
    return run_sim(cfg)


def test_layerwise_outputs_identical_across_policies(tmp_path):
    """Layer-wise loads (the default; 3 layers here): every policy's outputs are the same bits."""
    cfg = SimConfig(**{**TINY, "layers": 3}, dist="uniform", cache_dir=str(tmp_path))
    assert cfg.layerwise
    report = run_sim(cfg)
    chk = report.check["torch"]
    assert chk["identical"] and chk["requests"] == 14 and chk["positions_compared"] > 0
    assert all(res.loads > 0 for res in report.results["uniform"].values())


def test_outputs_identical_across_policies(cpu_report):
    chk = cpu_report.check["torch"]
    assert chk["identical"] and chk["requests"] == 14 and chk["max_rel_diff"] == 0.0 == chk["max_abs_diff"]
    results = cpu_report.results["uniform"]
    assert chk["policies"] == list(POLICIES)
    assert chk["positions_compared"] == 3 * sum(r.req.num_positions for r in results["blocking"].requests)
    assert all(res.loads > 0 and res.host_reads > 0 for res in results.values())
    assert results["blocking"].evictions > 0  # 5 adapters over 2 slots: slots were reused
    blocking = results["blocking"]
    assert blocking.step_stall_s >= blocking.host_read_s > 0  # blocking waits for its folder reads in the step
    assert cpu_report.host["budget_adapters"] == pytest.approx(2.5)


def test_engine_host_tier_reads_folders_evicts_and_stages(tmp_path, monkeypatch):
    """Host memory for one adapter: a cold load reads its folder off the scheduler thread (a layer-wise read is
    started there and runs on the extension's reader threads; otherwise the stager's worker reads it) and copies
    it into the slot bit for bit; a host-only stage reads a disk-only adapter without taking a slot and evicts
    the first from host memory (LRU), so that loading the first again reads its folder again."""
    import threading

    from lora_kernels.adapters import reader
    from lora_kernels.serve_sim.run import adapter_folders, make_engine

    cfg = validate(SimConfig(**{**TINY, "adapters": 3, "ranks": "8", "host_budget": "34%"}, cache_dir=str(tmp_path)))
    paths = adapter_folders(cfg)
    engine = make_engine(cfg, paths)
    reads = []
    orig_read, orig_start = reader.read_packed, reader.start_packed

    def spy_read(adapter_id, path, *args, **kw):
        reads.append((folders.Path(path).name, threading.current_thread().name))
        return orig_read(adapter_id, path, *args, **kw)

    def spy_start(adapter_id, spec, *args, plan, **kw):
        started = orig_start(adapter_id, spec, *args, plan=plan, **kw)
        if started is not None:  # else read_packed reads it on the worker, recorded there
            reads.append((plan.folder.name, "started on " + threading.current_thread().name))
        return started

    monkeypatch.setattr(reader, "read_packed", spy_read)
    monkeypatch.setattr(reader, "start_packed", spy_start)
    try:
        engine.reset()
        assert engine.host_resident() == set() and engine.host_capacity_adapters() == pytest.approx(1.02, rel=1e-4)
        t = engine.load_seconds(engine.issue_load(0, None))
        assert t.cold and t.host_s > 0 and reads == [("adapter_000", reads[0][1])]
        native = engine.layerwise and reader._native_start is not None
        where = "started on " + threading.current_thread().name if native else "lora-host-stage"
        assert reads[0][1].startswith(where) and engine.host_resident() == {0}
        t = engine.load_seconds(engine.issue_stage(1))  # prefetch into host memory: no slot taken
        assert t.cold and t.h2d_s == 0 and engine.loader.slot_of("adapter_001") is None
        assert engine.host_resident() == {1}  # adapter 0 dropped (LRU): it lives only on disk again
        t = engine.load_seconds(engine.issue_load(1, None))
        assert not t.cold and t.host_s == 0 and len(reads) == 2  # host hit: the copy only
        t = engine.load_seconds(engine.issue_load(2, 0))
        t = engine.load_seconds(engine.issue_load(0, 1))  # back from disk
        assert t.cold and [name for name, _ in reads] == ["adapter_000", "adapter_001", "adapter_002", "adapter_000"]
        w = load_peft_adapter(paths[0], cfg.spec(), dtype=torch.float32)
        slot = engine.loader.slot_of("adapter_000")
        for (layer, g), a in w.lora_a.items():
            pa, pb, _ = engine.pool.weights(layer, g)
            n = cfg.spec().group(g).num_slices
            assert all(torch.equal(pa[slot][i * 8:(i + 1) * 8], a[i * 8:(i + 1) * 8]) for i in range(n))
            assert torch.equal(pb[slot][:, :8], w.lora_b[(layer, g)])
    finally:
        engine.close()


def test_recorded_lora_outputs_match_float64_reference(cpu_report):
    """Every recorded layer-0 qkv LoRA row equals scaling·(x Aᵢᵀ)Bᵢᵀ per slice computed in float64 straight
    from the PEFT folder (not through the pool or loader)."""
    cfg = cpu_report.config
    spec = cfg.spec()
    paths = folders.ensure_adapters(spec, cfg.adapters, cfg.rank_list(), cfg.dtype, cfg.seed, folders.Path(cfg.cache_dir))
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    embed = torch.randn(4096, spec.hidden, generator=gen).double()  # ModelEngine's first draw
    group = spec.group("qkv_proj")
    rec = cpu_report.records["overlap+prefetch"]
    checked = 0
    for r in cpu_report.results["uniform"]["overlap+prefetch"].requests:
        w = load_peft_adapter(paths[r.req.adapter], spec)
        a, b = w.lora_a[(0, "qkv_proj")].double(), w.lora_b[(0, "qkv_proj")].double()
        for pos, row in rec.rows["torch"][r.req.rid].items():
            x = embed[int(r.req.tokens[pos])]
            ref = torch.cat([w.scaling * (x @ a[i * w.rank:(i + 1) * w.rank].T) @ b[lo:hi].T
                             for i, (lo, hi) in enumerate(zip(group.slice_offsets, group.slice_offsets[1:]))])
            assert float((row.double() - ref).norm() / ref.norm()) < 1e-5
            checked += 1
    assert checked == sum(r.req.num_positions for r in cpu_report.results["uniform"]["blocking"].requests)


def test_check_detects_a_wrong_adapter(tmp_path, monkeypatch):
    """Fault injection: under one policy the loader gets adapter 1's weights when adapter 2 is asked for.
    The cross-policy comparison must flag exactly the requests that use adapter 2."""
    from lora_kernels.serve_sim import engine as engine_mod

    cfg = SimConfig(**{**TINY, "host_budget": "all"}, dist="uniform", cache_dir=str(tmp_path),
                    policies=("blocking", "overlap"))
    orig = engine_mod.ModelEngine.issue_load
    calls = {"policy": 0}

    def reset(self, _orig=engine_mod.ModelEngine.reset):
        calls["policy"] += self.record is not None  # the warm-up runs without records
        return _orig(self)

    def faulty(self, adapter, victim):
        if calls["policy"] == 2 and adapter == 2:
            self.keys[2], saved = self.keys[1], self.keys[2]
            try:
                wrong = self.store.get(self.keys[1])  # adapter 1's weights, labelled as adapter 2's
                self.store._packed[saved] = dataclasses.replace(wrong, adapter_id=saved, plans={})
            finally:
                self.keys[2] = saved
        return orig(self, adapter, victim)

    monkeypatch.setattr(engine_mod.ModelEngine, "reset", reset)
    monkeypatch.setattr(engine_mod.ModelEngine, "issue_load", faulty)
    rep = run_sim(cfg)
    users = {r.req.rid for r in rep.results["uniform"]["blocking"].requests if r.req.adapter == 2}
    assert users, "the trace must use adapter 2"
    chk = rep.check["torch"]
    assert not chk["identical"] and chk["mismatched_requests"] == len(users)


# -- configuration errors and the CLI ---------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(slots=0), "--slots"), (dict(ranks="8,64", max_rank=32), "rank 64 > --max-rank 32"),
    (dict(model="gpt-5"), "--model"), (dict(dist="zipf:-1"), "--dist"), (dict(rate=0), "--rate"),
    (dict(max_rank=1000), "--max-rank"), (dict(chunk=512, max_batch_tokens=64), "--max-batch-tokens"),
    (dict(policies=("fast",)), "--policy"), (dict(input_len="5:2"), "--input-len"),
    (dict(host_budget="0%"), "--host-budget"), (dict(host_budget="lots"), "--host-budget"),
])
def test_validate_names_the_option(kw, match):
    with pytest.raises(ValueError, match=match):
        validate(SimConfig(device="cpu", **kw))


def _cli(capsys, *argv):
    from lora_kernels.cli import main

    try:
        code = main(["serve-sim", "--no-progress", *argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, match", [
    (["--slots", "0"], "--slots must be >= 1"),
    (["--ranks", "8,16,64", "--max-rank", "32"], "rank 64 > --max-rank 32"),
    (["--model", "llama9"], "--model must be one of"),
    (["--adapter-dir", "/nonexistent/adapters"], "--adapter-dir /nonexistent/adapters: cannot read it"),
    (["--slots", "two"], "argument --slots: invalid int value"),
])
def test_cli_bad_configuration_is_one_error_line(capsys, argv, match):
    code, out, err = _cli(capsys, "--device", "cpu", *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lora-kernels: error: ") and match in lines[0], err


def test_cli_adapter_dir_with_too_large_rank(capsys, tmp_path):
    spec = SimConfig(layers=1).spec()
    folders.write_adapter(tmp_path / "a0", spec, 16, torch.float32, seed=0)
    code, _, err = _cli(capsys, "--device", "cpu", "--layers", "1", "--adapter-dir", str(tmp_path), "--max-rank", "8")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "above the pool's max rank 8" in err


def test_cli_json_run(capsys, tmp_path):
    code, out, err = _cli(capsys, "--device", "cpu", "--backend", "torch", "--layers", "1", "--adapters", "4",
                          "--slots", "2", "--requests", "8", "--rate", "200", "--input-len", "4:20", "--seeds", "2",
                          "--output-len", "2:4", "--chunk", "8", "--max-batch-tokens", "32", "--cache-dir",
                          str(tmp_path), "--json")
    assert code == 0, err
    assert err == ""  # no progress bar under --json
    rep = json.loads(out)
    assert [(r["seed"], r["policy"]) for r in rep["runs"]] == [(s, p) for s in (0, 1) for p in POLICIES]
    assert rep["check"]["torch"]["identical"] and rep["runs"][0]["requests"] == 8 and rep["capacity"] == {}
    by = {s["policy"]: s for s in rep["stats"]}
    assert set(by) == set(POLICIES) and all(s["seeds"] == 2 for s in by.values())
    assert by["oracle"]["ttft_p50_x"]["median"] == 1.0 and by["blocking"]["ttft_p50_red"]["median"] == 0.0


def test_cli_loads_table_and_plot(capsys, tmp_path):
    """Default mode: capacity measured, three load levels, the table of ratios to the oracle with CIs, pictures."""
    plot = tmp_path / "serve.png"
    code, out, err = _cli(capsys, "--device", "cpu", "--backend", "torch", "--layers", "1", "--adapters", "4",
                          "--slots", "2", "--requests", "10", "--input-len", "4:20", "--seeds", "2", "--dist",
                          "zipf:1.5,distinct", "--output-len", "2:4", "--chunk", "8", "--max-batch-tokens", "32",
                          "--cache-dir", str(tmp_path), "--plot", str(plot))
    assert code == 0, err
    for dist in ("zipf:1.5", "distinct"):
        assert f"{dist}: capacity" in out
    assert out.count("overlap+prefetch") >= 6 and "x oracle" in out and "identical" in out
    assert plot.stat().st_size > 10_000
    assert (tmp_path / "serve_timeline_zipf15.png").is_file() and (tmp_path / "serve_timeline_distinct.png").is_file()
