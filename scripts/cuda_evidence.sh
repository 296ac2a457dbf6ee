#!/usr/bin/env bash
# Device evidence for the `cuda` backend: build, its GPU tests, the kernel benchmark (triton vs cuda),
# PDL on/off at decode batch 1, SASS (tensor-core instructions, 16-byte loads, local memory),
# compute-sanitizer memcheck, racecheck, synccheck, initcheck on every kernel path (scripts/sanitize.sh), and Nsight Compute on the main kernels.
# Files in $OUT (or ./out): build.log pytest.log bench_kernels.{log,jsonl} evidence.log sass_main.txt
# sanitize_<tool>.log ncu.log. Steps run in priority order; each has its own time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16}
E="$OUT/evidence.log"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; date -u; git rev-parse --short HEAD; } | tee "$E"
t0=$(date +%s)
OUT="$OUT" bash scripts/device_check.sh build >/dev/null || { tail -40 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" | tee -a "$E"
timeout 300 python3 -m pytest -q --maxfail=15 -p no:cacheprovider tests/test_cuda_backend.py tests/test_extension.py \
  >"$OUT/pytest.log" 2>&1; echo "pytest rc=$? $(tail -1 "$OUT/pytest.log")" | tee -a "$E"
grep -E "^(FAILED|ERROR)|Error|^E " "$OUT/pytest.log" | head -12
timeout 220 python3 bench/bench_kernels.py --backends triton,cuda --json "$OUT/bench_kernels.jsonl" \
  >"$OUT/bench_kernels.log" 2>&1; echo "bench rc=$?" | tee -a "$E"
for pdl in 0 1; do LORA_KERNELS_PDL=$pdl timeout 45 python3 scripts/cuda_kernel_probe.py pdl 2>&1 | tail -2; done | tee -a "$E"
SO=$(ls lora_kernels/_C*.so)
cuobjdump --dump-sass "$SO" >/tmp/sass.txt 2>&1
python3 - /tmp/sass.txt "$OUT/sass_main.txt" <<'PY' | tee -a "$E"
import re, sys
fn, stats, keep = None, {}, []
main = ("sgmv_expand_mma_kernelI13__nv_bfloat16fE", "sgmv_shrink_mma_kernelI13__nv_bfloat16fE")
for line in open(sys.argv[1]):
    m = re.search(r"Function : (\S+)", line)
    if m:
        fn = m.group(1); stats[fn] = dict(HMMA=0, LDG128=0, LDGSTS=0, LDSM=0, LOCAL=0)
    if fn is None:
        continue
    if any(k in fn for k in main):
        keep.append(line)
    s = stats[fn]
    s["HMMA"] += "HMMA" in line
    s["LDG128"] += bool(re.search(r"LDG\.E\.\S*128", line))
    s["LDGSTS"] += "LDGSTS" in line
    s["LDSM"] += "LDSM" in line
    s["LOCAL"] += bool(re.search(r"\b(LDL|STL)", line))
open(sys.argv[2], "w").writelines(keep)
for fn, s in stats.items():
    if "sgmv" in fn and "bfloat16f" in fn:
        print(fn[13:80], s)
print("sgmv functions with local memory (LDL/STL):", [f for f, s in stats.items() if s["LOCAL"] and "sgmv" in f],
      "of", sum("sgmv" in f for f in stats))
PY
timeout 240 bash scripts/sanitize.sh memcheck,racecheck,synccheck,initcheck -- tests/test_cuda_backend.py -k small \
  2>&1 | tee -a "$E"
timeout 90 ncu --clock-control none -k regex:sgmv_ -c 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  python3 scripts/cuda_kernel_probe.py ncu >"$OUT/ncu.log" 2>&1; echo "ncu rc=$?" | tee -a "$E"
grep -E "  sgmv_|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput" "$OUT/ncu.log" \
  | cut -c1-100 | head -24 | tee -a "$E"
grep -vE "^\s*$" "$OUT/bench_kernels.log" | tail -44 | cut -c1-190
