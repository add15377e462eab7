#!/usr/bin/env bash
# The operator's workflow on GPUs, and what two honest runs of one
# submission differ by there (docs/rules.md, "Reproduction"): a track run
# with a plugin entered, bundled (`harness submit`), reproduced twice by
# `harness reproduce` (the first signed with a fresh operator key, checked
# with `harness verify --reproduction`), then every evaluation and timing
# figure of the three runs compared pairwise (bench/reproduce_tolerance.py).
# Usage: bench/reproduce_gpu.sh SUITE TRACK GPUS KIND=ARTIFACT [KEY=VALUE...]
#   e.g. bench/reproduce_gpu.sh suites/h100.toml compression 2 compressor=topk.wasm ratio=0.05
# (harness from $HARNESS_BIN; writes under $OUT; the secret key is removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
S=$1 T=$2 G=$3 P=$4; shift 4
source bench/gpu_env.sh
cfg=(); for kv in "$@"; do cfg+=(--plugin-config "$kv"); done
"$BIN" env | tee "$OUT/env.txt"
"$BIN" run "$S" --track "$T" --gpus "$G" --plugin "$P" "${cfg[@]}" --out "$OUT/claim.json" -q > "$OUT/claim.txt" 2>&1 || { tail -n 20 "$OUT/claim.txt"; exit 1; }
"$BIN" submit "$OUT/claim.json" --out "$OUT/claim.bundle" 2>&1 | tee "$OUT/submit.txt"
"$BIN" keygen "$OUT/operator.key" | tee "$OUT/keygen.txt"
"$BIN" reproduce "$OUT/claim.bundle" --key "$OUT/operator.key" --out "$OUT/first" -q > "$OUT/first.txt" 2>&1 || true
"$BIN" reproduce "$OUT/claim.bundle" --out "$OUT/second" -q > "$OUT/second.txt" 2>&1 || true
rm -f "$OUT/operator.key"
grep -v '^[│╞└┌├╭╰]' "$OUT/first.txt" | tail -n 16
grep -v '^[│╞└┌├╭╰]' "$OUT/second.txt" | tail -n 4
rec=$(ls "$OUT"/first/*.reproduction.json | head -n 1)
"$BIN" verify "$OUT/claim.bundle" --reproduction "$rec" --public-key "$OUT/operator.key.pub" | tee "$OUT/verify-record.txt" || true
python3 bench/reproduce_tolerance.py "$OUT/claim.json" "$OUT"/first/reruns/*/result.json "$OUT"/second/reruns/*/result.json | tee "$OUT/tolerance.txt"
