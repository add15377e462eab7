#!/usr/bin/env bash
# T5-large and ResNet-50 against their libtorch layers, in one call on one
# GPU: the build's CUDA unit tests (test binaries carried in .carry/tests,
# if any), T5-large (suites/gpu-t5.toml, STEPS steps) with each fused part
# of the family off and on, alternating (VARIANTS: NAME=ENV pairs, e.g.
# "libtorch-norms=HARNESS_FUSED_RMS_NORM=0 fused=HARNESS_FUSED_RMS_NORM=1";
# VARIANTS="" skips T5), the same for ResNet-50 (suites/gpu-vision.toml,
# RN_VARIANTS, e.g. "libtorch-bn=HARNESS_FUSED_BN=0 fused-bn=HARNESS_FUSED_BN=1";
# several settings of a variant joined by commas),
# then one traced step of each model (suites/gpu-trace-families.toml) and
# of the PyTorch references in eager mode (bench/pytorch_t5.py,
# bench/pytorch_resnet.py; PYTRACE="t5 resnet" by default), each
# summarised by bench/trace_summary.py. PYCOMPILE="resnet t5" adds
# torch.compile runs of those models, the whole model compiled in each of
# COMPILE_MODES (default "default"; e.g. "default max-autotune-no-cudagraphs
# reduce-overhead"), and the ratios are taken against the best. Writes
# $OUT/families.tar.gz and prints the table last. Needs .carry/harness
# (docs/benchmarks.md).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
W=${WORK:-/tmp/families}; rm -rf "$W"; mkdir -p "$W/trace.trace"
"$BIN" env > "$W/env.txt" 2>&1
for t in .carry/tests/*; do
  [ -x "$t" ] || continue
  "$t" cuda --test-threads=1 > "$W/gpu-tests-$(basename "$t").txt" 2>&1
  echo "$(basename "$t"): rc=$? $(grep -E '^test result' "$W/gpu-tests-$(basename "$t").txt" | tail -1)" >> "$W/gpu-tests.txt"
done
sed "s/^steps = 110/steps = ${STEPS:-50}/" suites/gpu-t5.toml > "$W/t5.toml"
for r in 1 2; do
  for v in ${VARIANTS-default=HARNESS_FUSED_RMS_NORM=1}; do
    name=${v%%=*}; setting=${v#*=}
    env "$setting" "$BIN" run "$W/t5.toml" --out "$W/harness-t5-$name-$r.json" -q > "$W/harness-t5-$name-$r.txt" 2>&1 \
      || tail -5 "$W/harness-t5-$name-$r.txt"
  done
done
for r in 1 2; do
  for v in ${RN_VARIANTS:-}; do
    name=${v%%=*}; setting=${v#*=}
    env ${setting//,/ } "$BIN" run suites/gpu-vision.toml --out "$W/harness-resnet-$name-$r.json" -q > "$W/harness-resnet-$name-$r.txt" 2>&1 \
      || tail -5 "$W/harness-resnet-$name-$r.txt"
  done
done
"$BIN" run suites/gpu-trace-families.toml --trace --out "$W/trace.json" > "$W/trace-run.txt" 2>&1 || tail -5 "$W/trace-run.txt"
for m in ${PYTRACE-t5 resnet}; do
  python3 "bench/pytorch_$m.py" --steps 10 --warmup 5 --json "$W/pytorch-eager-$m.json" --trace "$W/trace.trace/pytorch-eager-$m.json" > /dev/null 2>> "$W/py.txt"
done
for m in ${PYCOMPILE:-}; do
  for mode in ${COMPILE_MODES:-default}; do
    tag=${mode/#default/}
    start=$SECONDS
    python3 "bench/pytorch_$m.py" --compile --compile-mode "$mode" --steps 50 --warmup 10 \
      --json "$W/pytorch-compile${tag:+-$tag}-$m.json" > /dev/null 2>> "$W/py.txt" || echo "torch.compile of $m ($mode) failed"
    echo "torch.compile of $m ($mode): $((SECONDS - start)) s with its compile" >> "$W/compile-times.txt"
  done
done
for f in "$W"/trace.trace/*.json; do
  python3 bench/trace_summary.py "$f" --top 25 > "${f%.json}.txt" 2>&1
  gzip "$f"
done
tar -C "$W" -czf "$OUT/families.tar.gz" .
cat "$W/gpu-tests.txt" 2>/dev/null
for f in "$W"/trace.trace/*.txt; do echo "== $(basename "$f")"; grep -m1 "^step" "$f"; sed -n "/^GPU:/,\$p" "$f" | head -32; done
cat "$W/compile-times.txt" 2>/dev/null
[ -z "${VARIANTS-x}" ] || python3 bench/summarize.py "$W" t5-large-bf16 t5
[ -z "${RN_VARIANTS:-}" ] || python3 bench/summarize.py "$W" resnet50-bf16 resnet
for v in ${RN_VARIANTS:-}; do python3 bench/summarize.py "$W" resnet50-bf16 resnet "${v%%=*}" | sed -n '/^harness variant/,$p'; done
