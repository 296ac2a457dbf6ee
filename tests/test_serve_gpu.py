"""serve-sim on the GPU: the timing gate, the step-time estimate from fewer layers, the oracle and the output
check with the kernels' backends (reported; the torch backend must be identical)."""

import math
import os

import pytest
import torch

from lora_kernels.serve_sim import run as sr
from lora_kernels.serve_sim.scheduler import POLICIES


@pytest.mark.gpu
# The torch backend is checked in every run below (rep.check["torch"], identical across policies) and runs the
# whole grid in CI on the CPU. As the grid's timed backend on the GPU it is slow: reference.py reads the segment
# bounds to the host (a sync) inside the forward, so steps wait out the timing gate's sleep kernel and are
# re-timed behind longer gates (gate.py). It had not finished after 140 s on the H200, where [auto] and
# [triton] take 7 s and 2 s. The cuda backend's outputs are in every run's check as well.
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_serve_sim_grid_on_gpu(tmp_path, backend):
    cfg = sr.SimConfig(model="tiny", layers=2, adapters=6, slots=3, ranks="8,16", requests=16, seeds=2, loads="0.8",
                       dist="zipf:1.5,distinct", input_len="8:64", output_len="2:8", chunk=32, max_running=8,
                       max_batch_tokens=64, device="cuda", backend=backend, cache_dir=str(tmp_path))
    rep = sr.run_sim(cfg)
    assert rep.check["torch"]["identical"] and rep.check["torch"]["max_abs_diff"] == 0.0
    chk = rep.check[rep.config.backend]
    assert chk["max_rel_diff"] < 1e-2  # reported for triton/cuda/auto (bf16): equal up to rounding at worst
    assert {r["policy"] for r in rep.rows} == set(POLICIES) and len(rep.rows) == 2 * 2 * len(POLICIES)
    assert sum(r["unfed_steps"] for r in rep.rows) <= 2  # steps whose timing may hold host gaps (after 4 tries)
    for s in rep.stats:
        assert math.isfinite(s["ttft_p50_x"]["median"]) and s["ttft_p50_x"]["lo"] <= s["ttft_p50_x"]["hi"]
    oracle = [r for r in rep.rows if r["policy"] == "oracle"]
    assert all(r["stall_ms"] == 0 and r["loads"] > 0 for r in oracle)


@pytest.mark.gpu
def test_timed_layers_estimate_tracks_the_full_step(tmp_path):
    """One of 4 layers timed x4 against all 4 timed, on the same trace: mean step time within 35% (tiny-model
    steps are launch-bound, so this checks the plumbing on the GPU, not the bench's accuracy, which the bench
    reports step by step)."""
    from lora_kernels.serve_sim.sim import simulate

    cfg = sr.validate(sr.SimConfig(model="tiny", layers=4, adapters=4, slots=4, ranks="8", requests=8, rate=math.inf,
                                   input_len="32:64", output_len="2:4", chunk=64, max_batch_tokens=256,
                                   device="cuda", backend="torch", check=False, cache_dir=str(tmp_path)))
    engine = sr.make_engine(cfg, sr.adapter_folders(cfg))
    try:
        sr.warm_up(cfg, engine)
        runs = {1: [], None: []}
        for _ in range(5):  # interleaved; the fastest of 5: other processes on the GPU (xdist) only add time, and
            for k in runs:  # a median of 3 still moved by 1.5x under 12 of them (H200, session 6)
                engine.timed_layers = k
                res = simulate(sr.make_trace(cfg, 4), sr.scheduler_config(cfg, "oracle"), engine)
                runs[k].append(res.busy_s / res.steps)
        times = {k: min(v) for k, v in runs.items()}
        if os.environ.get("PYTEST_XDIST_WORKER") and not 0.65 < times[1] / times[None] < 1.35:
            # Beside 11 other test processes on one GPU the fastest of 5 still moved by 1.64x (H200 suites of
            # 74fcf68 and 4fa878b; alone it passed): the ratio needs the GPU to itself, as scripts/device_check.sh
            # runs the suite (no -n).
            pytest.skip(f"step times disturbed by other processes on the GPU: {runs}")
        assert 0.65 < times[1] / times[None] < 1.35, runs
    finally:
        engine.close()
        torch.cuda.synchronize()
