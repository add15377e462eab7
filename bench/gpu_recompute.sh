#!/usr/bin/env bash
# Activation recomputation on one GPU, in one call: suites/gpu-recompute.toml
# (GPT-2 124M and the 1.3B preset, bf16, recompute none / all / every 2nd
# layer: peak device memory and tokens/s) and suites/gpu-recompute-growth.toml
# (memory-growth with and without recomputation: the largest micro-batch
# reached). Writes $OUT/recompute.tar.gz and prints a table last. Needs
# .carry/ (binary and plugins, see docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
WORK=${WORK:-/tmp/recompute}; rm -rf "$WORK"; mkdir -p "$WORK"
"$BIN" env > "$WORK/env.txt" 2>&1
for s in gpu-recompute gpu-recompute-growth; do
  "$BIN" run "suites/$s.toml" --out "$WORK/$s.json" > "$WORK/$s.txt" 2>&1
  echo "harness run $s: rc=$?" >> "$WORK/$s.txt"
  tail -2 "$WORK/$s.txt"
done
tar -C "$WORK" -czf "$OUT/recompute.tar.gz" . 2>/dev/null
python3 bench/recompute_table.py "$WORK"/gpu-recompute.json "$WORK"/gpu-recompute-growth.json
