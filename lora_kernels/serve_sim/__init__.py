"""The serving-trace replay (`lora-kernels serve-sim`): a trace of multi-LoRA requests run through the real
kernels, batch-info builder and adapter loader under three adapter-loading policies.

    trace.py      Poisson arrivals, length ranges, adapter popularity
    scheduler.py  continuous batching with chunked prefill; blocking / overlap / overlap+prefetch
    sim.py        the simulated clock driven by measured step and copy times
    engine.py     the model's linear layers + apply_lora + AdapterLoader, timed
    folders.py    random PEFT adapter folders in a cache directory
    metrics.py    TTFT / E2E / throughput / stall figures;  plot.py: timeline and CDF picture
    run.py        configuration, validation and one full run
"""
