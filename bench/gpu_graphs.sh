#!/usr/bin/env bash
# Runs on a GPU machine: a suite with the training step captured as a CUDA
# graph (the default) and with every step eager (HARNESS_CUDA_GRAPH=0), the
# same binary, alternating RUNS times (default 2), then prints per entry the
# throughput of both, their ratio, how many steps replayed the graph, and how
# far apart the two runs' training losses are (same seed, same maths).
# SUITE (default suites/gpu.toml); results under ${OUT:-bench-out}.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
SUITE=${SUITE:-suites/gpu.toml}
NAME=${NAME:-$(basename "$SUITE" .toml)}
for r in $(seq 1 "${RUNS:-2}"); do
  for mode in eager graph; do
    flag=1; [ "$mode" = eager ] && flag=0
    HARNESS_CUDA_GRAPH=$flag "$BIN" run "$SUITE" --out "$OUT/$NAME-$mode-$r.json" --quiet > "$OUT/$NAME-$mode-$r.txt" 2>&1 ||
      { echo "$NAME $mode run $r failed:"; tail -20 "$OUT/$NAME-$mode-$r.txt"; }
  done
done
python3 "$(dirname "$0")/graph_table.py" "$OUT" "$NAME"
