#!/usr/bin/env bash
# docs/claims.md sections 1 and 5 on one host of N GPUs (N = 4 by default:
# suites/gpu4-claims.toml; 8: suites/gpu8-claims.toml), plus the suite's
# workloads on 1 GPU with its baseline strategy only, for scaling; prints a
# table. Usage: bench/claims.sh [N]
# Needs $HARNESS_BIN (default .carry/harness). Writes under ${OUT:-bench-out}.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
n=${1:-4}
suite="suites/gpu$n-claims.toml"
[ -f "$suite" ] || { echo "no $suite" >&2; exit 2; }
"$BIN" run "$suite" --out "$OUT/gpu$n-claims.json" --quiet > "$OUT/gpu$n-claims.txt" 2>&1 || tail -5 "$OUT/gpu$n-claims.txt"
sed -e "s/^world_size = $n/world_size = 1/" -e "s/^name = \"gpu$n-claims\"/name = \"gpu1-claims\"/" "$suite" \
  | awk '/^\[\[strategy\]\]/{n++} n<2' > "$OUT/gpu1-claims.toml"
CUDA_VISIBLE_DEVICES=0 "$BIN" run "$OUT/gpu1-claims.toml" --out "$OUT/gpu1-claims.json" --quiet > "$OUT/gpu1-claims.txt" 2>&1 || tail -5 "$OUT/gpu1-claims.txt"
python3 - "$OUT" "$n" <<'PY'
import json, os, sys
d, n = sys.argv[1], int(sys.argv[2])
one = {}
for f in ["gpu1-claims.json", f"gpu{n}-claims.json"]:
    try:
        r = json.load(open(os.path.join(d, f)))
    except Exception as e:
        print(f, "missing:", e); continue
    for e in r["entries"]:
        m = e.get("metrics")
        if not m:
            print(f"{f} {e['id']}: {e['status']} {(e.get('error') or '')[:200]}"); continue
        key = (e["workload"], e["strategy"])
        if "gpu1" in f:
            one[key] = m["samples_per_s"]
        # Against the 1-GPU run of the same workload's baseline.
        base = one.get((e["workload"], "ddp"))
        scal = f" scaling {m['samples_per_s'] / (n * base):.3f}" if base and "gpu1" not in f else ""
        print(f"{f:18} {e['workload']:22} {e['strategy']:11} samples/s {m['samples_per_s']:10.0f} step p50 {m['step']['p50_ms']:8.2f} ms"
              f" final eval {m['final_eval_loss']:.4f}{scal}")
PY
