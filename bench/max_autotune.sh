#!/usr/bin/env bash
# torch.compile's max-autotune-no-cudagraphs mode on ResNet-50 (B256) and
# T5-large (16 x 512 + 512) against harness, on a host of four GPUs, in two
# calls on the same warm machine. A device call is capped at 600 s and the
# T5-large autotuning alone takes longer than that on one GPU, so:
#
#   bench/max_autotune.sh tune      (call 1) T5-large's autotuning spread
#       over GPUs 0-2 (TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1,
#       TORCHINDUCTOR_AUTOTUNE_MULTI_DEVICE=1), ResNet-50's on GPU 3, both at
#       once, each under TUNE_S seconds (default 540). Inductor's caches in
#       /tmp keep what they tuned; a run that finishes writes its JSON too.
#   bench/max_autotune.sh measure   (call 2) the same two PyTorch runs again,
#       one after the other, from the warm caches (T5 finishes its autotuning
#       first if call 1 did not), then harness's ResNet-50 on GPU 3 and T5-large
#       on GPU 0, the GPUs the PyTorch runs used; prints the table.
#
# MODELS="t5" (or "resnet") runs one model only; T5_GPUS (default 0,1,2) and
# RN_GPU (default 3) choose the GPUs; harness runs on the first of T5_GPUS
# for T5 and on RN_GPU for ResNet-50, the GPUs the PyTorch runs time on.
# On a one-GPU machine (MODELS=t5 T5_GPUS=0) run `tune` twice: a run ended
# by its limit leaves the shapes it autotuned in inductor's local cache, and
# the next one starts from them (T5-large on an H100: 20 shapes, then 7).
#
# Where the autotuning runs changes how long compiling takes, not the kernels
# chosen: every choice is still timed on an idle GPU of the same kind. Only the
# measure phase's runs, one at a time, are the comparison.
set -euo pipefail
cd "$(dirname "$0")/.."
PHASE=${1:?usage: bench/max_autotune.sh tune|measure}
source bench/gpu_env.sh
MODE=max-autotune-no-cudagraphs
MODELS=${MODELS:-t5 resnet}
T5_ENV=(CUDA_VISIBLE_DEVICES=${T5_GPUS:-0,1,2} TORCHINDUCTOR_AUTOTUNE_IN_SUBPROC=1 TORCHINDUCTOR_AUTOTUNE_MULTI_DEVICE=1)
RN_ENV=(CUDA_VISIBLE_DEVICES=${RN_GPU:-3})
report() {  # JSON: one line as soon as a run ends, so a call cut short still says what it measured
  python3 - "$1" <<'PY'
import json, os, sys
p = sys.argv[1]
if not os.path.exists(p):
    sys.exit(0)
r = json.load(open(p))
if "entries" in r:
    m = r["entries"][0]["metrics"]
    tp, ms, peak = m["tokens_per_s"], m["step"]["p50_ms"], m["memory"]["peak_device_allocated_bytes"]
else:
    tp, ms, peak = r["tokens_per_s"], r["ms_per_step"], r["peak_allocated_bytes"]
print(f"{os.path.basename(p):<26} {tp:>12,.0f} /s {ms:>9.2f} ms {peak / 2**30:>7.2f} GiB", flush=True)
PY
}
t5() {  # NAME LIMIT_S
  env "${T5_ENV[@]}" timeout "$2" python3 bench/pytorch_t5.py --compile --compile-mode $MODE --steps 30 --warmup 5 \
    --json "$OUT/$1-t5-mat.json" > "$OUT/$1-t5-mat.txt" 2>&1 || echo "$1 T5 max-autotune: rc $?"
  report "$OUT/$1-t5-mat.json"
}
resnet() {  # NAME LIMIT_S
  env "${RN_ENV[@]}" timeout "$2" python3 bench/pytorch_resnet.py --compile --compile-mode $MODE --steps 50 --warmup 10 \
    --json "$OUT/$1-resnet-mat.json" > "$OUT/$1-resnet-mat.txt" 2>&1 || echo "$1 ResNet-50 max-autotune: rc $?"
  report "$OUT/$1-resnet-mat.json"
}
harness() {  # MODEL
  local suite=suites/gpu-vision.toml envs=("${RN_ENV[@]}")
  if [ "$1" = t5 ]; then
    sed 's/^steps = 110/steps = 50/' suites/gpu-t5.toml > "$OUT/t5.toml"
    local gpus=${T5_GPUS:-0,1,2}
    suite=$OUT/t5.toml envs=(CUDA_VISIBLE_DEVICES=${gpus%%,*})
  fi
  env "${envs[@]}" "$BIN" run "$suite" --out "$OUT/harness-$1.json" --quiet > "$OUT/harness-$1.txt" 2>&1 \
    || { tail -20 "$OUT/harness-$1.txt"; echo "harness $1 failed"; }
  report "$OUT/harness-$1.json"
}
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv > "$OUT/gpus.csv"
case $PHASE in
  tune)
    for m in $MODELS; do "$m" tune "${TUNE_S:-540}" & done
    wait
    ;;
  measure)
    # Harness first: its runs are short, so a call cut short still has them.
    for m in $MODELS; do harness "$m"; done
    for m in $MODELS; do
      if [ "$m" = t5 ]; then t5 measure "${T5_S:-400}"; else resnet measure "${RN_S:-240}"; fi
    done
    ;;
  *) echo "unknown phase $PHASE" >&2; exit 2 ;;
esac
du -sh /tmp/torchinductor_* 2>/dev/null || true
