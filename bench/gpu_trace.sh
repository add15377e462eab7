#!/usr/bin/env bash
# Where a training step's time goes on one GPU, in one call: runs
# suites/gpu-trace.toml with `harness run --trace` (one step of each
# workload recorded by libtorch's profiler: operators, kernels, phases and
# plugin calls), then the same models in PyTorch eager and torch.compile
# (bench/pytorch_gpt.py --trace), and prints bench/trace_summary.py's table
# for each. Writes
# $OUT/trace.tar.gz (the traces, gzipped, and the run). Needs .carry/ (the
# harness binary, see docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
WORK=${WORK:-/tmp/trace}; rm -rf "$WORK"; mkdir -p "$WORK"
"$BIN" env > "$WORK/env.txt" 2>&1
"$BIN" run suites/gpu-trace.toml --trace --out "$WORK/trace.json" > "$WORK/run.txt" 2>&1
echo "harness run: rc=$?" >> "$WORK/run.txt"
# The same model in PyTorch, eager and compiled, one traced step each.
for preset in gpt2-124m:16 1.3b:8; do
  p=${preset%:*}; b=${preset#*:}
  python3 bench/pytorch_gpt.py --preset "$p" --batch "$b" --steps 5 --json "$WORK/pytorch-eager-$p.json" --trace "$WORK/trace.trace/pytorch-eager-$p.json" > /dev/null 2>> "$WORK/run.txt"
  python3 bench/pytorch_gpt.py --preset "$p" --batch "$b" --steps 5 --compile --json "$WORK/pytorch-compile-$p.json" --trace "$WORK/trace.trace/pytorch-compile-$p.json" > /dev/null 2>> "$WORK/run.txt"
done
for f in "$WORK"/trace.trace/*.json; do
  echo "== $(basename "$f")"
  python3 bench/trace_summary.py "$f" --top 15 | tee "${f%.json}.txt"
  gzip -k "$f"
done
tar -C "$WORK" -czf "$OUT/trace.tar.gz" --exclude='*.trace/*.json' . 2>/dev/null
tail -3 "$WORK/run.txt"
