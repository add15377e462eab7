#!/usr/bin/env bash
# Two harness builds against each other and against PyTorch eager on one GPU,
# in one call, alternating (before, after, PyTorch) twice: GPT-2 124M bf16,
# the first workload of suites/gpu.toml. Then the after build once more with
# the replica check forced on every step (HARNESS_REPLICA_CHECK_FORCE=1,
# HARNESS_REPLICA_CHECK_EVERY=1), to measure what the fingerprint costs.
# Usage: bench/compare_builds.sh BEFORE_BIN AFTER_BIN   (writes under $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1 AFTER=$2
source bench/gpu_env.sh
SUITE="$OUT/gpt2.toml"
# The [suite] table and the first workload and strategy of suites/gpu.toml.
awk '/^# The same small model/{exit} {print}' suites/gpu.toml > "$SUITE"
"$AFTER" env | tee "$OUT/env.txt"
for r in 1 2; do
  "$BEFORE" run "$SUITE" --out "$OUT/before-$r.json" --quiet > "$OUT/before-$r.txt" 2>&1 || { cat "$OUT/before-$r.txt"; exit 1; }
  "$AFTER" run "$SUITE" --out "$OUT/after-$r.json" --quiet > "$OUT/after-$r.txt" 2>&1 || { cat "$OUT/after-$r.txt"; exit 1; }
  python3 bench/pytorch_gpt.py --steps 100 --warmup 10 --json "$OUT/pytorch-eager-$r.json"
done
HARNESS_REPLICA_CHECK_FORCE=1 HARNESS_REPLICA_CHECK_EVERY=1 "$AFTER" run "$SUITE" --out "$OUT/after-replica-every-step.json" --quiet \
  > "$OUT/after-replica.txt" 2>&1 || { cat "$OUT/after-replica.txt"; exit 1; }
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
d = sys.argv[1]
def harness(pattern):
    out = []
    for p in sorted(glob.glob(os.path.join(d, pattern))):
        m = json.load(open(p))["entries"][0]["metrics"]
        out.append((m["tokens_per_s"], m["step"]["p50_ms"], m["memory"]["peak_device_allocated_bytes"] / 2**30))
    return out
before, after = harness("before-*.json"), harness("after-[0-9].json")
replica = harness("after-replica-every-step.json")
eager = [json.load(open(p))["tokens_per_s"] for p in sorted(glob.glob(os.path.join(d, "pytorch-eager-*.json")))]
mean = statistics.mean
print(f"{'build':<28} {'tokens/s (runs)':<28} {'step p50 ms':>12} {'peak GiB':>9} {'/ eager':>8}")
for name, rows in [("before", before), ("after", after), ("after, replica check every step", replica)]:
    tps = [r[0] for r in rows]
    print(f"{name:<28} {' '.join(f'{t:,.0f}' for t in tps):<28} {mean(r[1] for r in rows):12.2f} {max(r[2] for r in rows):9.2f} {mean(tps) / mean(eager):8.4f}")
print(f"{'pytorch eager':<28} {' '.join(f'{t:,.0f}' for t in eager):<28}")
print(f"after / before (tokens/s): {mean(r[0] for r in after) / mean(r[0] for r in before):.4f}")
print(f"replica check every step, step p50 against after: {mean(r[1] for r in replica) / mean(r[1] for r in after):.4f} (every 50 steps: 1/50 of the difference)")
PY
