#!/usr/bin/env bash
# The CPU class's timing band (docs/rules.md, "Reproduction"): one
# submission's track of suites/cpu-standard.toml run N times as independent
# runs (each a fresh `harness run`, as a submitter's run and the operator's
# reruns are), then every pair compared with bench/reproduce_tolerance.py.
# The score's largest relative difference over the pairs is what an honest
# rerun on this kind of machine differs by.
# Usage: bench/reproduce_cpu.sh OUT N TRACK KIND=ARTIFACT [KEY=VALUE...]
#   e.g. bench/reproduce_cpu.sh /tmp/cal 4 compression compressor=target/plugins/topk.wasm
# (harness from $HARNESS_BIN, default target/release/harness, in ./x env)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$1 N=$2 T=$3 P=$4; shift 4
BIN=${HARNESS_BIN:-target/release/harness}
cfg=(); for kv in "$@"; do cfg+=(--plugin-config "$kv"); done
mkdir -p "$OUT"
"$BIN" env > "$OUT/env.txt"
runs=()
for i in $(seq 1 "$N"); do
  start=$SECONDS
  "$BIN" run suites/cpu-standard.toml --track "$T" --plugin "$P" "${cfg[@]}" --out "$OUT/run$i.json" -q > "$OUT/run$i.txt" 2>&1 || { tail -n 20 "$OUT/run$i.txt"; exit 1; }
  echo "run $i: $((SECONDS - start)) s (load $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$OUT/runs.txt"
  runs+=("$OUT/run$i.json")
done
python3 bench/reproduce_tolerance.py "${runs[@]}" | tee "$OUT/tolerance.txt" | tail -n 8
