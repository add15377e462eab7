#!/usr/bin/env bash
# Runs on a GPU machine (the device tool): $SUITE (default
# suites/gpu-kernels.toml; suites/gpu-kernels-vit.toml for ViT) as it is
# (`kernels = "fused"`) and a copy with `kernels = "libtorch"` (same workload
# names: same seeds), then the libtorch copy again (how far libtorch drifts
# from itself) and an fp32 copy (no bf16 rounding), and prints bench/kernels_compare.py's table (speed, memory,
# loss agreement). TRACE=1 then runs both once more with `harness run
# --trace` (one step of each entry; separate runs, so that the profiler
# does not touch the timed ones) and tabulates the traces with
# bench/trace_summary.py. Writes under ${OUT:-bench-out}.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
SUITE=${SUITE:-suites/gpu-kernels.toml}
sed 's/^kernels = "fused"/kernels = "libtorch"/' "$SUITE" > "$OUT/gpu-kernels-libtorch.toml"
run() {  # NAME SUITE [ARGS]
  local name=$1 suite=$2; shift 2
  "$BIN" run "$suite" --out "$OUT/$name.json" --quiet "$@" > "$OUT/$name.txt" 2>&1 || { cat "$OUT/$name.txt"; exit 1; }
}
run fused "$SUITE"
run libtorch "$OUT/gpu-kernels-libtorch.toml"
run libtorch-again "$OUT/gpu-kernels-libtorch.toml"
sed 's/^precision = "bf16"/precision = "fp32"/' "$SUITE" > "$OUT/gpu-kernels-fp32.toml"
run fp32 "$OUT/gpu-kernels-fp32.toml"
if [ "${TRACE:-0}" = 1 ]; then
  run traced-fused "$SUITE" --trace
  run traced-libtorch "$OUT/gpu-kernels-libtorch.toml" --trace
  for t in "$OUT"/traced-*.trace/*.json; do
    python3 bench/trace_summary.py "$t" --top 25 > "${t%.json}.txt"
    gzip -f "$t"
  done
fi
python3 bench/kernels_compare.py "$OUT/fused.json" "$OUT/libtorch.json" "$OUT/libtorch-again.json" "$OUT/fp32.json"
