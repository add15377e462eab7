#!/usr/bin/env bash
# Two harness builds on one suite, alternating (A, B, A, B, ...), on a GPU
# machine (the device tool), then a table of each run's tokens/s and step
# p50 per workload and B's median over A's: a behaviour-preserving change
# measured before and after in one call.
# Usage: bench/ab_gpu.sh A_BIN B_BIN SUITE [ROUNDS]   (ROUNDS default 2)
# Writes the result files and logs under ${OUT:-bench-out}.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
A=$1 B=$2 SUITE=$3 ROUNDS=${4:-2}
"$B" env > "$OUT/env.txt"
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    bin=$A; [ "$side" = B ] && bin=$B
    "$bin" run "$SUITE" --out "$OUT/$side-$r.json" --quiet > "$OUT/$side-$r.txt" 2>&1 || { tail -20 "$OUT/$side-$r.txt"; exit 1; }
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, statistics, sys
d = sys.argv[1]
rows = {}
for p in sorted(glob.glob(os.path.join(d, "[AB]-*.json"))):
    side = os.path.basename(p)[0]
    for e in json.load(open(p))["entries"]:
        m = e.get("metrics") or {}
        tps = m.get("tokens_per_s") or m.get("samples_per_s") or 0
        rows.setdefault(e["id"], {"A": [], "B": []})[side].append((tps, (m.get("step") or {}).get("p50_ms", 0), e["status"]))
print(f"{'entry':40} {'A tokens/s':>24} {'B tokens/s':>24} {'B/A (medians)':>14}")
for k, v in rows.items():
    a = [x[0] for x in v["A"]]; b = [x[0] for x in v["B"]]
    ratio = statistics.median(b) / statistics.median(a) if a and b and statistics.median(a) else float("nan")
    fa = ", ".join(f"{x:,.0f}" for x in a); fb = ", ".join(f"{x:,.0f}" for x in b)
    print(f"{k:40} {fa:>24} {fb:>24} {ratio:>14.4f}")
PY
