#!/usr/bin/env bash
# Where data parallelism loses its time, one lever at a time, in one call:
# GPT PRESET bf16 on 1 GPU (autograd's own gradients, then the gradient
# buckets with HARNESS_LOCAL_GRADS=0) and on N GPUs (DDP as shipped; with the
# all-reduce after the backward pass, HARNESS_OVERLAP=0; with the flat
# gradient buffers, HARNESS_LOCAL_GRADS=0; ZeRO-2; averaging in bf16; with NCCL's protocol or
# channel count set; with larger buckets), then one traced run whose step
# bench/trace_summary.py breaks down. Prints a table last (with the phases'
# medians in ms: forward, backward, the wait after it, the optimizer).
# Usage: bench/scaling_levers.sh PRESET N [VARIANTS]
#   PRESET: gpt2-124m (batch 16, 60 steps) or 1.3b (batch 8, 25 steps).
#   VARIANTS (default all): any of one one-gN (1 GPU on GPU N, to see how
#   the GPUs of the host differ) one-long (1 GPU, GPU 0, three times the
#   steps) concurrent (one-long on every GPU at once, no communication: what
#   the host's GPUs do side by side, the most a data-parallel step could
#   scale; its rows give each GPU's tokens/s over one-long's) one-buckets ddp (harness's default) local
#   (HARNESS_CE_GATHER=0: autograd's own gradients all-reduced) flat zero1 zero2 no-overlap
#   bf16 (reduce_dtype = "bf16") net (nccl_transport = "network") net-bf16 simple ch8 ch32
#   bucketN (bucket_mb = N, e.g. bucket25, PyTorch DDP's; the others leave
#   the size to harness) bf16-bN zero2-bN flat-bN (the same at N MiB
#   buckets) ce
#   (HARNESS_CE_GATHER=1: symmetric flat buffers, the all-gather half on the
#   copy engines) ce-bN, ce-ctasN (ce with NCCL_MAX_CTAS=N: the reduce-scatter on N SMs), split (the same reduce-scatter and all-gather with
#   NCCL_CTA_POLICY=0, both on SMs) trace-ce flat-z ce-z zero2-z (flat, ce, zero2 with
#   HARNESS_UNZEROED_GRADS=0: every gradient buffer zeroed at a step's start) ctasN
#   (NCCL_MAX_CTAS=N) ctaeff (NCCL_CTA_POLICY=1, efficiency)
#   ll128 (NCCL_PROTO=LL128) trace trace-one (1 GPU) trace-zero1 trace-zero2; the traces'
#   steps are broken down by bench/trace_summary.py and bench/dp_trace.py.
#   Any variant takes more environment as VARIANT+VAR=VALUE[+VAR=VALUE...],
#   e.g. ce+NCCL_MAX_CTAS=8. The variants of the levers that left harness
#   (prio, smN, smN-gG, cer; byname, byname-tail, tailN, zero2-byname) are
#   gone with them (results/retired-levers/).
# ROUNDS=N (default 1) runs the variants N times, interleaved (round r > 1 as
# VARIANT@r), divides by the median of the `one` runs and prints each
# variant's median scaling and range last. With one-g1 .. one-g(N-1) among
# the variants, the N-GPU runs are also divided by the mean of the GPUs'
# 1-GPU runs (GPU 0 alone may be faster or slower than the others).
# Each run is stopped after $RUN_TIMEOUT seconds (default 300).
# Needs $HARNESS_BIN (default .carry/harness). Writes under $OUT/levers-PRESET/.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
source bench/gpt_suite.sh
preset=${1:?usage: bench/scaling_levers.sh PRESET N [VARIANTS]}
n=${2:?usage: bench/scaling_levers.sh PRESET N [VARIANTS]}
variants=${3:-"one one-buckets ddp flat zero2 no-overlap bf16 prio bf16-prio zero2-prio net net-bf16 simple ch8 ch32 bucket100 trace"}
case "$preset" in
  gpt2-124m) batch=16; steps=60; warm=10 ;;
  1.3b) batch=8; steps=25; warm=5 ;;
  *) echo "unknown preset $preset" >&2; exit 2 ;;
esac
dir="$OUT/levers-$preset"
mkdir -p "$dir"

# suite NAME WORLD BUCKET_MB [STRATEGY-NAME [STRATEGY-TOML]]
suite() {
  gpt_suite "levers-$preset-${1//[^A-Za-z0-9_-]/-}" "GPT $preset bf16 on $2 GPU(s), lever $1 (bench/scaling_levers.sh)" "$preset" "$2" "$batch" "$steps" "$warm" "$3" \
    "$(printf '[[strategy]]\nname = "%s"\nbaseline = true\n%s' "${4:-ddp}" "${5:-}")" > "$dir/$1.toml"
  echo "$dir/$1.toml"
}

# run NAME [ENV...] -- ARGS: one harness run, its wall time recorded.
run() {
  local name=$1; shift
  local t0; t0=$(date +%s)
  timeout "${RUN_TIMEOUT:-300}" env "$@" "${extra[@]}" "$BIN" run "$dir/$name.toml" --out "$dir/$name.json" --quiet ${TRACE:+--trace} > "$dir/$name.txt" 2>&1 || tail -5 "$dir/$name.txt"
  echo "$name: $(( $(date +%s) - t0 )) s" >&2
}

gpus=$(seq -s, 0 $((n - 1)))
for round in $(seq 1 "${ROUNDS:-1}"); do
for v in $variants; do
  # Round 1 runs as VARIANT, later rounds as VARIANT@ROUND.
  name=$v
  [ "$round" -eq 1 ] || name="$v@$round"
  # VARIANT+VAR=VALUE+...: the variant with more environment for harness.
  extra=()
  [[ "$v" != *+* ]] || IFS=+ read -ra extra <<< "${v#*+}"
  case "${v%%+*}" in
    one) suite "$name" 1 auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES=0 ;;
    one-g[0-9]*) suite "$name" 1 auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="${v#one-g}" ;;
    one-long) steps=$((steps * 3)) suite "$name" 1 auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES=0 ;;
    concurrent)
      for g in $(seq 0 $((n - 1))); do
        steps=$((steps * 3)) suite "$name-g$g" 1 auto >/dev/null
        run "$name-g$g" CUDA_VISIBLE_DEVICES="$g" &
      done
      wait ;;
    one-buckets) suite "$name" 1 auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES=0 HARNESS_LOCAL_GRADS=0 ;;
    ddp) suite "$name" "$n" auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    local) suite "$name" "$n" auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_CE_GATHER=0 ;;
    flat) suite "$name" "$n" auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_LOCAL_GRADS=0 ;;
    flat-b[0-9]*) suite "$name" "$n" "${v#flat-b}" >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_LOCAL_GRADS=0 ;;
    ce) suite "$name" "$n" auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_CE_GATHER=1 ;;
    ce-ctas[0-9]*) suite "$name" "$n" auto "ddp-$v" "nccl = { NCCL_MAX_CTAS = ${v#ce-ctas} }" >/dev/null
      run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_CE_GATHER=1 ;;
    ce-b[0-9]*) suite "$name" "$n" "${v#ce-b}" >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_CE_GATHER=1 ;;
    flat-z) suite "$name" "$n" auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_LOCAL_GRADS=0 HARNESS_UNZEROED_GRADS=0 ;;
    ce-z) suite "$name" "$n" auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_CE_GATHER=1 HARNESS_UNZEROED_GRADS=0 ;;
    zero2-z) suite "$name" "$n" auto zero2 'zero = 2' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_UNZEROED_GRADS=0 ;;
    split) suite "$name" "$n" auto ddp-split 'nccl = { NCCL_CTA_POLICY = 0 }' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_CE_GATHER=1 ;;
    zero2) suite "$name" "$n" auto zero2 'zero = 2' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    zero1) suite "$name" "$n" auto zero1 'zero = 1' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    simple) suite "$name" "$n" auto ddp-simple 'nccl = { NCCL_PROTO = "Simple" }' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    ch32) suite "$name" "$n" auto ddp-ch32 'nccl = { NCCL_MIN_NCHANNELS = 32, NCCL_MAX_NCHANNELS = 32 }' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    bf16) suite "$name" "$n" auto ddp-bf16 'reduce_dtype = "bf16"' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    net) suite "$name" "$n" auto ddp-net 'nccl_transport = "network"' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    net-bf16) suite "$name" "$n" auto ddp-net-bf16 $'nccl_transport = "network"\nreduce_dtype = "bf16"' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    no-overlap) suite "$name" "$n" auto >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_OVERLAP=0 ;;
    ch8) suite "$name" "$n" auto ddp-ch8 'nccl = { NCCL_MAX_NCHANNELS = 8 }' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    bucket[0-9]*) suite "$name" "$n" "${v#bucket}" >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    bf16-b[0-9]*) suite "$name" "$n" "${v#bf16-b}" ddp-bf16 'reduce_dtype = "bf16"' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    zero2-b[0-9]*) suite "$name" "$n" "${v#zero2-b}" zero2 'zero = 2' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    ctas[0-9]*) suite "$name" "$n" auto "ddp-$v" "nccl = { NCCL_MAX_CTAS = ${v#ctas} }" >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    ctaeff) suite "$name" "$n" auto ddp-ctaeff 'nccl = { NCCL_CTA_POLICY = 1 }' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    ll128) suite "$name" "$n" auto ddp-ll128 'nccl = { NCCL_PROTO = "LL128" }' >/dev/null; run "$name" CUDA_VISIBLE_DEVICES="$gpus" ;;
    trace|trace-one|trace-ce|trace-zero[12])
      case "$v" in
        trace-zero[12]) suite "$name" "$n" auto "zero${v#trace-zero}" "zero = ${v#trace-zero}" >/dev/null
          TRACE=1 run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_TRACE_STEPS=3 ;;
        trace-ce) suite "$name" "$n" auto >/dev/null; TRACE=1 run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_TRACE_STEPS=3 HARNESS_CE_GATHER=1 ;;
        trace-one) suite "$name" 1 auto >/dev/null; TRACE=1 run "$name" CUDA_VISIBLE_DEVICES=0 HARNESS_TRACE_STEPS=3 ;;
        *) suite "$name" "$n" auto >/dev/null; TRACE=1 run "$name" CUDA_VISIBLE_DEVICES="$gpus" HARNESS_TRACE_STEPS=3 ;;
      esac
      for f in "$dir/$name.trace"/*.json; do
        [ -e "$f" ] || continue
        python3 bench/trace_summary.py "$f" --top 25 > "${f%.json}.txt" 2>&1
        python3 bench/dp_trace.py "$f" > "${f%.json}.dp.txt" 2>&1
        gzip -f "$f"
      done ;;
    *) echo "unknown variant $v" >&2 ;;
  esac
done
done

python3 - "$dir" "$n" $variants <<'PY'
import json, os, sys
import statistics
d, n, variants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rounds = int(os.environ.get("ROUNDS") or 1)
def entries(v):
    try:
        return json.load(open(os.path.join(d, v + ".json")))["entries"]
    except Exception:
        return []
def named(v, r):
    return v if r == 1 else f"{v}@{r}"
def tps(v):
    return [e["metrics"]["tokens_per_s"] for r in range(1, rounds + 1) for e in entries(named(v, r)) if e.get("metrics")]
# The 1-GPU baseline: the median of the rounds' `one` runs (GPU 0).
one = statistics.median(tps("one")) if tps("one") else None
long = statistics.median(tps("one-long")) if tps("one-long") else None
# `concurrent` ran one result per GPU: concurrent-g0, concurrent-g1, ...
variants = [x for v in variants for x in ([f"{v}-g{g}" for g in range(n)] if v == "concurrent" else [v])]
base = variants
variants = [named(v, r) for r in range(1, rounds + 1) for v in base]
vw = max([12] + [len(v) for v in variants])
print(f"{'variant':<{vw}} {'GPUs':>4} {'tokens/s':>11} {'step p50 ms':>11} {'step mean ms':>12} {'scaling':>8} {'peak GiB':>9} {'eval loss':>9} {'unzeroed':>8} {'fwd':>6} {'bwd':>6} {'wait':>5} {'opt':>5}")
for v in variants:
    for e in entries(v):
        m = e.get("metrics")
        if not m:
            print(f"{v:<{vw}} failed: {str(e.get('error'))[:80]}")
            continue
        w = m.get("world_size", 1)
        s = m.get("step") or {}
        sc = f"{m['tokens_per_s'] / (w * one):.3f}" if one and w > 1 else ""
        if v.startswith("concurrent-") and long:
            sc = f"{m['tokens_per_s'] / long:.3f}*"
        peak = (m.get("memory") or {}).get("peak_device_allocated_bytes", 0) / 2**30
        ev = m.get("final_eval_loss") or float("nan")
        unz = f"{m.get('unzeroed_buckets') or 0}/{len(m.get('bucket_bytes') or [])}" if w > 1 else ""
        ph = lambda k: ((m.get("phases") or {}).get(k) or {}).get("p50_ms", 0)
        print(f"{v:<{vw}} {w:>4} {m['tokens_per_s']:>11,.0f} {s.get('p50_ms', 0):>11.2f} {s.get('mean_ms', 0):>12.2f} {sc:>8} {peak:>9.2f} {ev:>9.4f} {unz:>8}"
              f" {ph('forward'):>6.1f} {ph('backward'):>6.1f} {ph('communicate'):>5.1f} {ph('optimizer'):>5.1f}")
if rounds > 1:
    print(f"over {rounds} rounds (scaling against the median 1-GPU run): median [lowest, highest]")
    for v in base:
        runs = [e["metrics"] for r in range(1, rounds + 1) for e in entries(named(v, r)) if e.get("metrics")]
        w = runs[0].get("world_size", 1) if runs else 1
        if not runs or w < 2 or not one:
            continue
        sc = [m["tokens_per_s"] / (w * one) for m in runs]
        print(f"{v:<{vw}} {w:>4} {statistics.median(m['tokens_per_s'] for m in runs):>11,.0f} {statistics.median(sc):>8.3f} [{min(sc):.3f}, {max(sc):.3f}] of {len(sc)}")
# With one-g1 .. one-g(N-1) beside `one`: the GPUs differ (up to 3.6% on one
# host), and a data-parallel step runs on all of them, so scaling against the
# mean of their 1-GPU runs as well as against GPU 0's.
each = [tps("one")] + [tps(f"one-g{g}") for g in range(1, n)]
if n > 1 and all(each):
    mean = statistics.mean(statistics.median(t) for t in each)
    print(f"scaling against the mean of the {n} GPUs' 1-GPU runs ({mean:,.0f} tokens/s; GPU 0: {one:,.0f}):")
    for v in base:
        runs = [e["metrics"] for r in range(1, rounds + 1) for e in entries(named(v, r)) if e.get("metrics")]
        w = runs[0].get("world_size", 1) if runs else 1
        if runs and w > 1:
            print(f"{v:<{vw}} {w:>4} {statistics.median(m['tokens_per_s'] for m in runs) / (w * mean):>8.3f}")
conc = [e["metrics"]["tokens_per_s"] for g in range(n) for e in entries(f"concurrent-g{g}") if e.get("metrics")]
if long and len(conc) == n:
    print(f"* concurrent: each GPU's tokens/s over one-long's; all {n} together {sum(conc) / (n * long):.3f}, "
          f"the slowest {min(conc) / long:.3f} (a data-parallel step waits for it)")
PY
