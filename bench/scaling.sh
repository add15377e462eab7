#!/usr/bin/env bash
# Scaling on one host: harness DDP, ZeRO-1 and ZeRO-2 against PyTorch DDP on the same
# GPT model, batch and GPU counts, in one call, one process per GPU; then
# torch.distributed all_reduce busbw on harness's gradient buckets at each
# count. Prints a table last.
# Usage: bench/scaling.sh PRESET "COUNTS"   e.g. bench/scaling.sh 1.3b "1 2 4"
#   PRESET: gpt2-124m (batch 16, 110 steps) or 1.3b (batch 8, 35 steps), bf16.
# PyTorch runs under torch.compile (its default mode, of the DDP-wrapped
# model), or eagerly with EAGER=1.
# Needs $HARNESS_BIN (default .carry/harness) and PyTorch 2.11 with torchrun.
# Writes under ${OUT:-bench-out}/scaling-PRESET/.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
source bench/gpt_suite.sh
preset=${1:?usage: bench/scaling.sh PRESET \"COUNTS\"}
counts=${2:-"1 2 4"}
case "$preset" in
  gpt2-124m) batch=16; steps=110; warm=10 ;;
  1.3b) batch=8; steps=35; warm=5 ;;
  *) echo "unknown preset $preset" >&2; exit 2 ;;
esac
dir="$OUT/scaling-$preset"
mkdir -p "$dir"
for n in $counts; do
  gpus=$(seq -s, 0 $((n - 1)))
  zero=""
  if [ "$n" -gt 1 ]; then zero=$'[[strategy]]\nname = "zero1"\nzero = 1\n\n[[strategy]]\nname = "zero2"\nzero = 2'; fi
  gpt_suite "scaling-$preset-$n" "GPT $preset bf16 on $n GPU(s): DDP, ZeRO-1 and ZeRO-2 (bench/scaling.sh)" "$preset" "$n" "$batch" "$steps" "$warm" auto \
    $'[[strategy]]\nname = "ddp"\nbaseline = true\n\n'"$zero" > "$dir/suite-$n.toml"
  t0=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpus "$BIN" run "$dir/suite-$n.toml" --out "$dir/harness-$n.json" --quiet > "$dir/harness-$n.txt" 2>&1 || tail -5 "$dir/harness-$n.txt"
  t1=$(date +%s)
  CUDA_VISIBLE_DEVICES=$gpus torchrun --standalone --nproc_per_node="$n" bench/pytorch_gpt.py --preset "$preset" --batch "$batch" $([ -n "${EAGER:-}" ] || echo --compile) \
    --steps $((steps - warm)) --warmup "$warm" --json "$dir/pytorch-$n.json" > "$dir/pytorch-$n.txt" 2>&1 || tail -5 "$dir/pytorch-$n.txt"
  t2=$(date +%s)
  if [ "$n" -gt 1 ]; then
    CUDA_VISIBLE_DEVICES=$gpus torchrun --standalone --nproc_per_node="$n" bench/allreduce_busbw.py --bytes-from "$dir/harness-$n.json" 25 \
      > "$dir/torch-busbw-$n.json" 2> "$dir/torch-busbw-$n.err" || true
    # harness's own all-reduce on the same buckets, back to back, timed alike.
    CUDA_VISIBLE_DEVICES=$gpus "$BIN" bench allreduce --bytes-from "$dir/harness-$n.json" --world "$n" --iters 20 \
      > "$dir/harness-busbw-$n.json" 2> "$dir/harness-busbw-$n.err" || true
  fi
  echo "$n GPU(s): harness $((t1 - t0)) s, pytorch $((t2 - t1)) s, busbw $(( $(date +%s) - t2 )) s"
done
python3 - "$dir" $counts <<'PY'
import json, os, sys
d, counts = sys.argv[1], [int(c) for c in sys.argv[2:]]
def load(p):
    try:
        return json.load(open(os.path.join(d, p)))
    except Exception:
        return None
one = {}
# busbw: all-reduce over harness's gradient buckets back to back (harness
# bench allreduce, and torch.distributed), GB/s, and their ratio.
print(f"{'GPUs':>4} {'impl':<14} {'tokens/s':>10} {'step p50 ms':>11} {'scaling':>8} {'vs PyTorch':>10} {'peak GiB/rank':>13} {'harness busbw':>12} {'torch busbw':>11} {'ratio':>7}")
for n in counts:
    pt = load(f"pytorch-{n}.json")
    bw = load(f"torch-busbw-{n}.json")
    tb = (bw or {}).get("buckets", {}).get("busbw_gbs")
    try:
        hb = json.loads(open(os.path.join(d, f"harness-busbw-{n}.json")).read().strip().splitlines()[-1])["buckets"]["busbw_gbs"]
    except Exception:
        hb = None
    r = load(f"harness-{n}.json") or {"entries": []}
    rows = []
    for e in r["entries"]:
        m = e.get("metrics")
        if not m:
            print(f"{n:>4} {e['strategy']:<14} failed: {(e.get('error') or '')[:200]}")
            continue
        ranks = m.get("ranks") or []
        peak = max((x["memory"]["peak_device_allocated_bytes"] or 0) for x in ranks) if ranks else m["memory"]["peak_device_allocated_bytes"]
        rows.append((e["strategy"], m["tokens_per_s"], m["step"]["p50_ms"], peak / 2**30, None))
    if pt:
        rows.append(("pytorch-ddp", pt["tokens_per_s"], pt["ms_per_step"], pt["peak_allocated_bytes"] / 2**30, None))
    for name, tps, p50, peak, busbw in rows:
        if n == 1:
            one[name] = tps
        # One GPU runs DDP only: the ZeRO stages scale against it.
        base = one.get("ddp" if name.startswith("zero") else name)
        scal = f"{tps / (n * base):.3f}" if base and n > 1 else "-"
        vs = f"{tps / pt['tokens_per_s']:.3f}" if pt and name != "pytorch-ddp" else "-"
        tbs = f"{tb:.1f}" if tb and name == "ddp" else "-"
        hbs = f"{hb:.1f}" if hb and name == "ddp" else "-"
        ratio = f"{hb / tb:.3f}" if hb and tb and name == "ddp" else "-"
        print(f"{n:>4} {name:<14} {tps:>10.0f} {p50:>11.2f} {scal:>8} {vs:>10} {peak:>13.2f} {hbs:>12} {tbs:>11} {ratio:>7}")
PY
