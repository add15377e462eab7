#!/usr/bin/env bash
# Runs on a GPU machine (the device tool): harness's suites/gpu.toml and the
# same model in PyTorch (bench/pytorch_gpt.py), alternating twice, then
# torch.compile once, and prints a comparison table. Needs a harness binary
# built elsewhere ($HARNESS_BIN, default .carry/harness) and PyTorch 2.11.
# Writes everything under ${OUT:-bench-out}. COMPILE=0 skips the
# torch.compile run (e.g. when comparing two harness builds in one call).
# Another model: SUITE, PYARGS (bench/pytorch_gpt.py's model arguments) and
# WORKLOAD (the harness workload to compare), e.g. SUITE=suites/gpu1-1.3b.toml
# PYARGS="--preset 1.3b --batch 8" WORKLOAD=gpt-1.3b-bf16; another family:
# PYBENCH (default bench/pytorch_gpt.py), e.g. SUITE=suites/gpu-t5.toml
# PYBENCH=bench/pytorch_t5.py WORKLOAD=t5-large-bf16.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
SUITE=${SUITE:-suites/gpu.toml}
"$BIN" env | tee "$OUT/env.txt"
for r in 1 2; do
  "$BIN" run "$SUITE" --out "$OUT/harness-$r.json" --quiet > "$OUT/harness-$r.txt" 2>&1 || { cat "$OUT/harness-$r.txt"; exit 1; }
  python3 "${PYBENCH:-bench/pytorch_gpt.py}" ${PYARGS:-} --steps 100 --warmup 10 --json "$OUT/pytorch-eager-$r.json"
done
if [ "${COMPILE:-1}" != 0 ]; then
  python3 "${PYBENCH:-bench/pytorch_gpt.py}" ${PYARGS:-} --compile --steps 100 --warmup 10 --json "$OUT/pytorch-compile.json" || echo "torch.compile run failed"
fi
python3 bench/summarize.py "$OUT" "${WORKLOAD:-gpt2-124m-bf16}"
