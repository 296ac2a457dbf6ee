#!/usr/bin/env bash
# The one command a device run uses: build against the machine's own torch, run the GPU tests, run the
# benchmarks; logs and JSON go to $OUT (or ./out).  Usage: scripts/device_check.sh [build|test|bench|all]...
#   PYTEST_ARGS="tests -k 'triton or cuda'" narrows the tests (default: tests);
#   GIT_COMMIT=<hash> names the commit in the JSON lines where the copy has no .git; BENCHES="bench/bench_kernels.py" narrows the benchmarks.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16}
# The device image points CC/CXX at /opt/gcc, whose g++ links parts of libstdc++ statically: that copy beside
# torch's shared one segfaults (std::codecvt) on the first TORCH_CHECK message. The system compiler links it
# dynamically (checked on the H200 image, 2026-11-22: tests/test_extension.py::test_cpp_check_raises...).
if [ -x /usr/bin/g++ ] && [ -x /usr/bin/gcc ]; then export CC=/usr/bin/gcc CXX=/usr/bin/g++; fi
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
status=0
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
if want build || want test || want bench; then
  t0=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  python3 -c "import torch, lora_kernels as lk, lora_kernels._build_meta as m; print('build ok:', torch.__version__, 'cuda', torch.version.cuda, 'archs', m.CUDA_ARCHS, 'HAS_CUDA_EXT', lk.HAS_CUDA_EXT, torch.ops.lora_kernels)" 2>&1 | tee -a "$OUT/build.log"
  echo "build took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
fi
if want test; then
  # eval keeps quoted arguments such as -k 'loader or peft' whole.
  eval "python3 -m pytest -q -ra -p no:cacheprovider ${PYTEST_ARGS:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -40
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if want bench; then
  for b in ${BENCHES:-$(ls bench/bench_*.py 2>/dev/null)}; do
    echo "== $b"
    python3 "$b" --json "$OUT/$(basename "$b" .py).jsonl" 2>&1 | tee "$OUT/$(basename "$b" .py).log" || status=1
  done
fi
exit $status
