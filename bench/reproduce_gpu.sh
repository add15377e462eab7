#!/usr/bin/env bash
# What two honest runs of one submission differ by on GPUs, to set the
# reproduction tolerance (docs/rules.md, "Reproduction"): a committed GPU
# bundle reproduced on this host (`harness reproduce`), that rerun bundled
# (`harness submit`) and reproduced again, then every evaluation and timing
# figure of the three runs compared pairwise (bench/reproduce_tolerance.py).
# Usage: bench/reproduce_gpu.sh BUNDLE   (harness from $HARNESS_BIN; writes under $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
B=$1
source bench/gpu_env.sh
"$BIN" env | tee "$OUT/env.txt"
"$BIN" reproduce "$B" --out "$OUT/first" -q > "$OUT/first.txt" 2>&1 || true
tail -n 30 "$OUT/first.txt"
r1=$(ls -d "$OUT"/first/reruns/*/ | head -n 1)
"$BIN" submit "$r1/result.json" --out "$OUT/rerun1.bundle" > "$OUT/submit.txt" 2>&1 || { cat "$OUT/submit.txt"; }
"$BIN" reproduce "$OUT/rerun1.bundle" --out "$OUT/second" -q > "$OUT/second.txt" 2>&1 || true
tail -n 30 "$OUT/second.txt"
r2=$(ls -d "$OUT"/second/reruns/*/ | head -n 1)
python3 bench/reproduce_tolerance.py "$B/result.json" "$r1/result.json" "$r2/result.json" | tee "$OUT/tolerance.txt"
