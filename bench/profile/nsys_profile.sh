#!/usr/bin/env bash
# Profiles the workload loop (bench/profile/workload.py) with Nsight Systems: NVTX ranges around batch
# preparation and each layer's LoRA ops, capture limited to torch.cuda.profiler.start/stop
# (--capture-range=cudaProfilerApi). Then exports SQLite and counts synchronizing CUDA calls inside the
# "batch_prep" ranges (nsys_sync_check.py; exit 1 if any) and prints nsys's API/NVTX summaries.
# Without nsys on PATH it runs the torch.profiler path (torch_profile.py) instead.
#   usage: bench/profile/nsys_profile.sh [OUT_DIR] [workload args: --steps N --baseline --graph]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-out/profile}"
[ $# -gt 0 ] && shift
mkdir -p "$out"
if ! command -v nsys >/dev/null 2>&1; then
  echo "nsys not found: running the torch.profiler check instead" >&2
  exec python3 "$here/torch_profile.py" --out "$out" "$@"
fi
rep="$out/lora_batch_prep"
nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop --trace=cuda,nvtx,osrt \
  --force-overwrite=true -o "$rep" python3 "$here/workload.py" "$@"
nsys export --type=sqlite --force-overwrite=true -o "$rep.sqlite" "$rep.nsys-rep"
nsys stats --report cuda_api_sum,nvtx_sum --format table "$rep.nsys-rep" || true
python3 "$here/nsys_sync_check.py" "$rep.sqlite"
