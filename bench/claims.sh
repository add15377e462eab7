#!/usr/bin/env bash
# docs/claims.md sections 1 and 5 on a 4-GPU host (suites/gpu4-claims.toml), plus
# the encoder workloads on 1 GPU for scaling; prints a table.
# Needs $HARNESS_BIN (default .carry/harness). Writes under ${OUT:-bench-out}.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
"$BIN" run suites/gpu4-claims.toml --out "$OUT/gpu4-claims.json" --quiet > "$OUT/gpu4-claims.txt" 2>&1 || tail -5 "$OUT/gpu4-claims.txt"
sed -e 's/^world_size = 4/world_size = 1/' -e 's/^name = "gpu4-claims"/name = "gpu1-claims"/' suites/gpu4-claims.toml \
  | awk '/^\[\[strategy\]\]/{n++} n<2' > "$OUT/gpu1-claims.toml"
CUDA_VISIBLE_DEVICES=0 "$BIN" run "$OUT/gpu1-claims.toml" --out "$OUT/gpu1-claims.json" --quiet > "$OUT/gpu1-claims.txt" 2>&1 || tail -5 "$OUT/gpu1-claims.txt"
python3 - "$OUT" <<'PY'
import json, os, sys
d = sys.argv[1]
one = {}
for f in ["gpu1-claims.json", "gpu4-claims.json"]:
    try:
        r = json.load(open(os.path.join(d, f)))
    except Exception as e:
        print(f, "missing:", e); continue
    n = r["plan"]["world_size"] if "world_size" in r.get("plan", {}) else (4 if "gpu4" in f else 1)
    for e in r["entries"]:
        m = e.get("metrics")
        if not m:
            print(f"{f} {e['id']}: {e['status']} {(e.get('error') or '')[:200]}"); continue
        key = (e["workload"], e["strategy"])
        if "gpu1" in f:
            one[key] = m["samples_per_s"]
        base = one.get(key)
        scal = f" scaling {m['samples_per_s'] / (4 * base):.3f}" if base and "gpu4" in f else ""
        print(f"{f:18} {e['workload']:22} {e['strategy']:7} samples/s {m['samples_per_s']:10.0f} step p50 {m['step']['p50_ms']:8.2f} ms"
              f" final eval {m['final_eval_loss']:.4f}{scal}")
PY
