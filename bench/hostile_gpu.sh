#!/usr/bin/env bash
# The hostile-input tests on a GPU (issue 61's GPU run): the suites of
# tests/cli/hostile_suites.rs, hostile_secrets.rs and sandbox.rs train on
# CUDA (HARNESS_TEST_DEVICE=cuda; suites of more ranks than
# HARNESS_TEST_GPUS stay on the CPU and say so), and hostile_files.rs and
# hostile_paths.rs, which train nothing, run beside them. One test per
# process, each timed; the GPU's peak memory is sampled while it runs.
# On the device machine, from the checkout's root, with in .carry/: the
# stripped `harness` and `cli` (the tests, `cargo test --release -p harness
# --test cli --no-run`) binaries and plugins/ (those the tests name). The
# test binary finds the harness binary and the plugins under the path it
# was built in (/work/main here), which is linked to this checkout.
# Usage: bench/hostile_gpu.sh [GPUS=1]
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
GPUS=${1:-1}
built=$(grep -a -m1 -o '/[A-Za-z0-9_/.+-]*/target/release/harness' .carry/cli | sed 's,/target/release/harness$,,')
[ -e "$built" ] || { mkdir -p "$(dirname "$built")" && ln -s "$PWD" "$built"; }
mkdir -p target/release && cp .carry/harness target/release/harness
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
target/release/harness env > "$OUT/env.txt" 2>&1
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >> "$OUT/gpu-memory.txt" &
smi=$!
tests=$(.carry/cli --list 2>/dev/null | sed -n 's/: test$//p' | grep -E '^(hostile_|sandbox::)')
printf '| test | result | seconds | GPU memory used, peak MiB |\n| --- | --- | ---: | ---: |\n' > "$OUT/table.md"
for t in $tests; do
  : > "$OUT/gpu-memory.txt"
  start=$EPOCHREALTIME
  HARNESS_TEST_DEVICE=cuda HARNESS_TEST_GPUS=$GPUS timeout 300 .carry/cli --exact "$t" --nocapture > "$OUT/$t.txt" 2>&1
  rc=$?
  # A test stopped by the timeout leaves the harness it started running on
  # the GPUs (and its binary busy): end it before the next test.
  pkill -9 -f 'target/release/harness ' 2>/dev/null || true
  took=$(awk "BEGIN {print $EPOCHREALTIME - $start}")
  peak=$(sort -n "$OUT/gpu-memory.txt" | tail -1)
  res=ok; [ $rc = 0 ] || res="FAILED ($rc)"
  grep -q "running 1 test" "$OUT/$t.txt" || res="did not run"
  printf '| `%s` | %s | %.1f | %s |\n' "$t" "$res" "$took" "${peak:--}" | tee -a "$OUT/table.md"
done
kill $smi 2>/dev/null
tar -C "$OUT" -czf "$OUT/hostile-gpu.tar.gz" --exclude='*.tar.gz' . 2>/dev/null
echo; cat "$OUT/table.md"
