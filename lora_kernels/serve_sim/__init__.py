"""The serving-trace replay (`lora-kernels serve-sim`): a trace of multi-LoRA requests run through the real
kernels, batch-info builder and adapter loader under three adapter-loading policies and an oracle
(loads that cost no time), over several trace seeds and load levels.

    trace.py      Poisson arrivals, length ranges, adapter popularity
    scheduler.py  continuous batching with chunked prefill; blocking / overlap / overlap+prefetch / oracle
    sim.py        the simulated clock driven by measured step and copy times
    engine.py     the adapter tiers, loads and steps (AdapterLoader, HostStager)
    model.py      the model: linear layers + apply_lora;  gate.py: step timing;  records.py: output check
    stats.py      ratios to the oracle, reductions vs blocking, median + bootstrap CI over seeds
    folders.py    random PEFT adapter folders in a cache directory
    metrics.py    TTFT / E2E / throughput / stall figures of a run;  plot.py: load plot with CI bands, timelines
    run.py        configuration, validation and the grid of runs
"""
