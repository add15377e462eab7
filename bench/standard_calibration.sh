#!/usr/bin/env bash
# Calibrates the standard suites' batch-size and checkpointing tracks on
# one GPU, in one call: suites/gpu-standard-calibration.toml (fixed
# micro-batches of the 1.3B preset at a constant learning rate; GPT-2 124M
# under seeded failures with and without checkpoints). Writes
# $OUT/calibration.tar.gz and prints bench/calibration_table.py's table
# last. Needs .carry/ (binary and plugins, see docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
WORK=${WORK:-/tmp/calibration}; rm -rf "$WORK"; mkdir -p "$WORK"
"$BIN" env > "$WORK/env.txt" 2>&1
"$BIN" run suites/gpu-standard-calibration.toml --out "$WORK/calibration.json" --quiet > "$WORK/run.txt" 2>&1
echo "harness run: rc=$?" >> "$WORK/run.txt"
tail -3 "$WORK/run.txt"
tar -C "$WORK" -czf "$OUT/calibration.tar.gz" --exclude='*.checkpoints' . 2>/dev/null
python3 bench/calibration_table.py "$WORK/calibration.json"
