"""Serving traces: Poisson arrivals at a request rate, input/output lengths, and adapter popularity.

Popularity (`dist`), over adapters 0..num_adapters-1:
    uniform      every request picks an adapter uniformly at random
    zipf:A       P(k-th most popular) ∝ k^-A; popularity order is a seeded shuffle of the ids, so
                 popularity is independent of the adapters' ranks
    distinct     round robin: consecutive requests never share an adapter (every request misses a
                 cache smaller than num_adapters)
    bursty[:B]   runs of consecutive requests on one adapter (run lengths geometric, mean B, default
                 8), each run's adapter uniform
    none         no request uses LoRA (the base model's cost alone)

A trace is a list of `Request`s sorted by arrival time; everything is drawn from one seeded
generator, so a (config, seed) pair always gives the same trace, token ids included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Request:
    """One request: arrives at `arrival` seconds, prompt of `prompt_len` tokens, `output_len` tokens out.

    `tokens` holds the ids of every position the model processes: the prompt, then the output tokens
    fed back in decode (teacher forcing), prompt_len + output_len - 1 in all.
    """

    rid: int
    arrival: float
    adapter: int | None
    prompt_len: int
    output_len: int
    tokens: np.ndarray = field(compare=False, repr=False)  # int64[num_positions]

    @property
    def num_positions(self) -> int:
        return self.prompt_len + self.output_len - 1


def parse_dist(spec: str) -> tuple[str, float]:
    """'uniform' | 'zipf:A' | 'distinct' | 'bursty[:B]' | 'none' -> (kind, parameter); raises ValueError."""
    kind, _, arg = spec.partition(":")
    if kind in ("uniform", "distinct", "none") and not arg:
        return kind, 0.0
    if kind in ("zipf", "bursty"):
        try:
            value = float(arg) if arg else (8.0 if kind == "bursty" else float("nan"))
        except ValueError:
            value = float("nan")
        if kind == "zipf" and not value > 0:
            raise ValueError(f"--dist zipf needs an exponent > 0, e.g. zipf:1.5, got {spec!r}")
        if kind == "bursty" and not value >= 1:
            raise ValueError(f"--dist bursty:B needs a mean run length B >= 1, got {spec!r}")
        return kind, value
    raise ValueError(f"--dist must be uniform, zipf:A, distinct, bursty[:B] or none, got {spec!r}")


def parse_range(spec: str, name: str) -> tuple[int, int]:
    """'N' or 'LO:HI' (inclusive, LO >= 1) -> (lo, hi); raises ValueError naming the option."""
    try:
        parts = [int(p) for p in spec.split(":")]
    except ValueError:
        parts = []
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise ValueError(f"{name} must be N or LO:HI with 1 <= LO <= HI, got {spec!r}")
    return parts[0], parts[1]


def _adapters(kind: str, param: float, n: int, num_adapters: int, rng: np.random.Generator) -> list[int | None]:
    if kind == "none" or num_adapters == 0:
        return [None] * n
    if kind == "uniform":
        return rng.integers(0, num_adapters, n).tolist()
    if kind == "distinct":
        return [i % num_adapters for i in range(n)]
    if kind == "zipf":
        weights = np.arange(1, num_adapters + 1, dtype=np.float64) ** -param
        order = rng.permutation(num_adapters)
        return order[rng.choice(num_adapters, n, p=weights / weights.sum())].tolist()
    out: list[int | None] = []  # bursty
    while len(out) < n:
        out += [int(rng.integers(0, num_adapters))] * int(rng.geometric(1.0 / param))
    return out[:n]


def generate_trace(num_requests: int, rate: float, dist: str, num_adapters: int, input_len: tuple[int, int],
                   output_len: tuple[int, int], vocab: int, seed: int = 0) -> list[Request]:
    """`num_requests` requests with Poisson arrivals at `rate` per second (rate = inf: all at time 0)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if num_adapters < 1 and parse_dist(dist)[0] != "none":
        raise ValueError(f"num_adapters must be >= 1 for dist {dist!r}, got {num_adapters}")
    kind, param = parse_dist(dist)
    rng = np.random.default_rng(seed)
    gaps = np.zeros(num_requests) if np.isinf(rate) else rng.exponential(1.0 / rate, num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]  # the first request arrives at t = 0
    prompts = rng.integers(input_len[0], input_len[1] + 1, num_requests)
    outputs = rng.integers(output_len[0], output_len[1] + 1, num_requests)
    adapters = _adapters(kind, param, num_requests, num_adapters, rng)
    trace = []
    for i in range(num_requests):
        n = int(prompts[i]) + int(outputs[i]) - 1
        tokens = rng.integers(0, vocab, n)
        trace.append(Request(i, float(arrivals[i]), adapters[i], int(prompts[i]), int(outputs[i]), tokens))
    return trace
