#!/usr/bin/env bash
# A native plugin that ends a rank's process on a 2-GPU run, by each route
# (`exit`, `_exit`, `exit_group`, a thread of its own calling `exit`): the
# run must end with exit code 4 naming the plugin, and keep the entry
# finished before it. Runs on a 2-GPU machine (the device tool's
# nvidia-h100-x2); needs the hostile fixture's native library
# (target/plugins/libhostile.so, or .carry/plugins on the device).
# Usage: bench/native_exit_gpu.sh [HARNESS_BIN]   (writes under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
HARNESS_BIN=${1:-${HARNESS_BIN:-.carry/harness}}
source bench/gpu_env.sh
for mode in exit _exit exit_group thread-exit; do
  d=$OUT/native-exit-$mode; mkdir -p "$d"
  cat > "$d/suite.toml" <<SUITE
[suite]
name = "exit2"
device = "cuda"
seed = 1
warmup_steps = 1
world_size = 2

[[workload]]
name = "mlp"
model = { kind = "mlp", preset = "tiny" }
data = { kind = "synthetic", vocab = 256, branching = 4 }
batch = 8
seq_len = 16
steps = 6
optimizer = { kind = "sgd", lr = 0.1 }

[[plugin]]
name = "quitter"
path = "$PWD/target/plugins/libhostile.so"

[[strategy]]
name = "first"

[[strategy]]
name = "exit"
compressor = "quitter"
compressor_config = { mode = "$mode" }
SUITE
  timeout 300 "$BIN" run "$d/suite.toml" --out "$d/r.json" -q > "$d/out.txt" 2> "$d/err.txt"
  rc=$?
  first=$(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print([e['status'] for e in r['entries'] if e['id']=='mlp/first/r0'], 'complete', r['complete'])" "$d/r.json" 2>&1)
  echo "$mode: exit $rc; first entry $first; $(grep -o 'rank [0-9]: .*' "$d/err.txt" | head -1 | cut -c1-200)"
done
