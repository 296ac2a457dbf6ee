"""A/B of launch-time switches: bench_kernels with extra variants `BACKEND@K=V[+K2=V2...]`, each the plain backend with
the environment variables K=V set around every apply_lora call (a C++ or Python switch read at each launch, as the
temporary knobs of an A/B are), bit-compared with the plain backend's output in every module before timing.

    python3 scripts/env_ab.py --backends triton,cuda,cuda@LK_FORM=1,cuda@LK_FORM=2 --cases "r16 prefill"

Prints `# bits <module> <variant>: equal | DIFFER` lines, then bench_kernels' table (graph replay, L2 flushed,
interleaved rounds); a graph captured under a variant keeps the choice its switches made at capture.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_kernels as bk  # noqa: E402

_plain_apply, _plain_check = bk.apply, bk.check_variants


def apply(backend, x, out, a, b, info, offsets):
    """bench_kernels.apply, with `backend@K=V+...`'s variables set around the call."""
    if "@" not in backend:
        return _plain_apply(backend, x, out, a, b, info, offsets)
    base, switches = backend.split("@", 1)
    env = dict(s.split("=", 1) for s in switches.split("+"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        _plain_apply(base, x, out, a, b, info, offsets)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check_variants(mod, names):
    """bench_kernels' tolerance check, then each switched variant against its plain backend, bit for bit."""
    _plain_check(mod, names)
    x, out, a, b = mod.sets[0][:4]
    for v in [n for n in names if "@" in n]:
        backend, order = v.split()
        plain, switched = out.clone(), out.clone()
        apply(backend.split("@")[0], x, plain, a, b, mod.infos[order], mod.offsets)
        apply(backend, x, switched, a, b, mod.infos[order], mod.offsets)
        print(f"# bits {mod.name} {v}: {'equal' if torch.equal(plain, switched) else 'DIFFER'}", flush=True)


if __name__ == "__main__":
    bk.apply, bk.check_variants = apply, check_variants
    sys.argv[0] = "bench_kernels.py"
    bk.main()
