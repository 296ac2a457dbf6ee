#!/usr/bin/env bash
# Nsight Compute over one layer (qkv, o, gate_up, down) per regime and backend: each kernel's duration, DRAM and
# SM throughput, DRAM bytes read and written, occupancy, registers and top warp stalls, as markdown tables
# (bench/profile/ncu_summary.py).
# The evidence issues 19 and 21 ask for: the worst kernel of each regime and what limits it.
#
#   scripts/ncu_regimes.sh [BACKENDS] [CASES]
#     BACKENDS  comma-separated (default triton,cuda)
#     CASES     ';'-separated bench_kernels case names, each optionally "NAME|ORDER" (default: one per regime)
# Files in $OUT (or ./out): ncu_<backend>_<n>.csv and ncu_regimes.md. Needs the extension built
# (scripts/device_check.sh build).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
backends=${1:-triton,cuda}
regimes="r16 decode 1x1 distinct|unsorted;r16 decode 64x1 uniform|sorted;r64 decode 256x1 uniform|sorted"
regimes="$regimes;r16 prefill 8x1024 distinct|unsorted;r64 prefill 8x1024 distinct|unsorted"
cases=${2:-$regimes}
all=$(python3 bench/profile/ncu_summary.py --metrics-all)
safe=$(python3 bench/profile/ncu_summary.py --metrics)
md="$OUT/ncu_regimes.md"
commit=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
{ nvidia-smi --query-gpu=name --format=csv,noheader; date -u; echo "$commit"; } >"$md"
IFS=';' read -ra list <<<"$cases"
for b in ${backends//,/ }; do
  n=0
  for c in "${list[@]}"; do
    name=${c%%|*}; order=${c#*|}; [ "$order" = "$c" ] && order=sorted
    n=$((n + 1)); csvf="$OUT/ncu_${b}_${n}.csv"
    for metrics in "$all" "$safe"; do
      timeout 150 ncu --csv --page raw --metrics "$metrics" --nvtx --nvtx-include "layer/" --clock-control none \
        python3 scripts/cuda_kernel_probe.py layer "$b" "$name" "$order" >"$csvf" 2>&1
      rc=$?
      grep -q "Failed to find metric\|==ERROR==" "$csvf" || break
    done
    echo "ncu $b '$name' $order rc=$rc"
    { echo; python3 bench/profile/ncu_summary.py "$b, $name, $order" <"$csvf"; } >>"$md"
  done
done
cat "$md"
