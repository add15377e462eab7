#!/usr/bin/env bash
# Two harness builds against each other and against PyTorch on one GPU, in
# one call, alternating (before, after, PyTorch eager) twice, then
# torch.compile once: one workload, by default GPT-2 124M bf16 (the first
# workload of suites/gpu.toml). Prints each build's tokens/s and its ratios
# to PyTorch eager and torch.compile.
# Usage: bench/compare_builds.sh BEFORE_BIN AFTER_BIN   (writes under $OUT)
# Another model: SUITE (its only workload; e.g. suites/gpu1-1.3b.toml) and
# PYARGS (bench/pytorch_gpt.py's model arguments, e.g. "--preset 1.3b
# --batch 8"), or another family: PYBENCH (e.g. bench/pytorch_t5.py). COMPILE=0 skips torch.compile. REPLICA=1 also runs the after
# build with the replica check forced on every step
# (HARNESS_REPLICA_CHECK_FORCE=1, HARNESS_REPLICA_CHECK_EVERY=1), to
# measure what the fingerprint costs.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1 AFTER=$2
source bench/gpu_env.sh
if [ -n "${SUITE:-}" ]; then
  cp "$SUITE" "$OUT/suite.toml"
else
  # The [suite] table and the first workload and strategy of suites/gpu.toml.
  awk '/^# The same small model/{exit} {print}' suites/gpu.toml > "$OUT/suite.toml"
fi
"$AFTER" env | tee "$OUT/env.txt"
run() {  # NAME BIN [ENV...]
  local name=$1 bin=$2; shift 2
  env "$@" "$bin" run "$OUT/suite.toml" --out "$OUT/$name.json" --quiet > "$OUT/$name.txt" 2>&1 || { cat "$OUT/$name.txt"; exit 1; }
}
for r in 1 2; do
  run "before-$r" "$BEFORE"
  run "after-$r" "$AFTER"
  python3 "${PYBENCH:-bench/pytorch_gpt.py}" ${PYARGS:-} --steps 100 --warmup 10 --json "$OUT/pytorch-eager-$r.json"
done
if [ "${COMPILE:-1}" != 0 ]; then
  python3 "${PYBENCH:-bench/pytorch_gpt.py}" ${PYARGS:-} --compile --steps 100 --warmup 10 --json "$OUT/pytorch-compile.json" || echo "torch.compile run failed"
fi
if [ "${REPLICA:-0}" = 1 ]; then
  run after-replica-every-step "$AFTER" HARNESS_REPLICA_CHECK_FORCE=1 HARNESS_REPLICA_CHECK_EVERY=1
fi
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
d = sys.argv[1]
def harness(pattern):
    out = []
    for p in sorted(glob.glob(os.path.join(d, pattern))):
        m = json.load(open(p))["entries"][0]["metrics"]
        out.append((m["tokens_per_s"], m["step"]["p50_ms"], m["memory"]["peak_device_allocated_bytes"] / 2**30, m.get("mfu") or 0))
    return out
def pytorch(pattern):
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(d, pattern)))]
mean = statistics.mean
eager, compiled = pytorch("pytorch-eager-*.json"), pytorch("pytorch-compile.json")
eager_tps = mean(r["tokens_per_s"] for r in eager)
print(f"{'run':<32} {'tokens/s (runs)':<24} {'ms/step':>8} {'MFU':>6} {'peak GiB':>9} {'/ eager':>8} {'/ compile':>9}")
builds = [("before", harness("before-*.json")), ("after", harness("after-[0-9].json"))]
replica = harness("after-replica-every-step.json")
if replica:
    builds.append(("after, replica check every step", replica))
for name, rows in builds:
    tps = mean(r[0] for r in rows)
    vs_compile = f"{tps / compiled[0]['tokens_per_s']:9.4f}" if compiled else f"{'-':>9}"
    print(f"{name:<32} {' '.join(f'{r[0]:,.0f}' for r in rows):<24} {mean(r[1] for r in rows):8.2f} {mean(r[3] for r in rows):6.1%}"
          f" {max(r[2] for r in rows):9.2f} {tps / eager_tps:8.4f} {vs_compile}")
def runs(rows, key):
    return " ".join(f"{r[key]:,.0f}" for r in rows)
for name, rows in [("pytorch eager", eager), ("pytorch torch.compile", compiled)]:
    if rows:
        ms = mean(r["ms_per_step"] for r in rows)
        mfu = mean(r["achieved_tflops"] for r in rows) / 989.4
        peak = max(r["peak_allocated_bytes"] for r in rows) / 2**30
        print(f"{name:<32} {runs(rows, 'tokens_per_s'):<24} {ms:8.2f} {mfu:6.1%} {peak:9.2f}")
after, before = builds[1][1], builds[0][1]
print(f"after / before (tokens/s): {mean(r[0] for r in after) / mean(r[0] for r in before):.4f}")
if replica:
    print(f"replica check every step, step p50 against after: {mean(r[1] for r in replica) / mean(r[1] for r in after):.4f}")
PY
