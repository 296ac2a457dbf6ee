"""Mode table of `lora_linear(mode="auto")` on CUDA: (max pool rank, max rows, mode), first match wins.

Placeholder until `bench/bench_layer.py --write-table` measures it on a GPU (it rewrites this file; never
edit it by hand): the shrink overlapped with the base GEMM everywhere.
"""

TABLE = [
    (2**31, 2**31, "overlap"),
]
