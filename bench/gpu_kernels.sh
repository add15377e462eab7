#!/usr/bin/env bash
# Runs on a GPU machine (the device tool): suites/gpu-kernels.toml as it is
# (`kernels = "fused"`) and a copy with `kernels = "libtorch"` (same workload
# names: same seeds), and prints bench/kernels_compare.py's table (speed,
# memory, loss agreement).
# TRACE=1 also records one step of each entry (`harness run --trace`) and
# tabulates it with bench/trace_summary.py. Writes under ${OUT:-bench-out}.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
args=()
[ "${TRACE:-0}" = 1 ] && args+=(--trace)
sed 's/^kernels = "fused"/kernels = "libtorch"/' suites/gpu-kernels.toml > "$OUT/gpu-kernels-libtorch.toml"
for k in fused libtorch; do
  suite=suites/gpu-kernels.toml
  [ $k = libtorch ] && suite="$OUT/gpu-kernels-libtorch.toml"
  "$BIN" run "$suite" --out "$OUT/$k.json" --quiet "${args[@]}" > "$OUT/$k.txt" 2>&1 || { cat "$OUT/$k.txt"; exit 1; }
done
if [ "${TRACE:-0}" = 1 ]; then
  for t in "$OUT"/*.trace/*.json; do
    python3 bench/trace_summary.py "$t" --top 25 > "${t%.json}.txt"
    gzip -f "$t"
  done
fi
python3 bench/kernels_compare.py "$OUT/fused.json" "$OUT/libtorch.json"
