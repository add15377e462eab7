#!/usr/bin/env bash
# The plugin SDK's overhead figures (issue: "Overhead, in a benchmark"):
#  1. the host -> plugin hook round trip (`harness plugin bench`, p50/p99),
#  2. step time of the built-in all-reduce + fixed batch against the same as
#     WASM and native plugins, same run, paired seeds:
#     suites/plugin-overhead-cpu.toml, and on a GPU machine also
#     suites/plugin-overhead-gpu.toml.
# Usage: bench/plugin_overhead.sh [cpu|gpu|all]   (default: cpu)
# Needs the plugins built (scripts/build-plugins.sh) and $HARNESS_BIN
# (default: target/release/harness, or .carry/harness on the device).
# Writes under ${OUT:-bench-out}; prints a table last.
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-cpu}
if [ "$which" != cpu ]; then
  source bench/gpu_env.sh
else
  OUT=${OUT:-bench-out}; mkdir -p "$OUT"
  BIN=${HARNESS_BIN:-target/release/harness}
fi
"$BIN" plugin bench --calls 200000 target/plugins/fixed.wasm target/plugins/libfixed.so \
  target/plugins/allreduce.wasm target/plugins/liballreduce.so | tee "$OUT/hook-bench.txt"
suites=()
case "$which" in
  cpu) suites=(cpu) ;;
  gpu) suites=(gpu) ;;
  all) suites=(cpu gpu) ;;
  *) echo "usage: $0 [cpu|gpu|all]" >&2; exit 2 ;;
esac
for s in "${suites[@]}"; do
  "$BIN" run "suites/plugin-overhead-$s.toml" --out "$OUT/plugin-overhead-$s.json" --quiet > "$OUT/plugin-overhead-$s.txt" 2>&1 \
    || { tail -20 "$OUT/plugin-overhead-$s.txt"; exit 1; }
done
python3 - "$OUT" "${suites[@]}" <<'PY'
import json, os, statistics, sys
out, suites = sys.argv[1], sys.argv[2:]
med = statistics.median
TOUCHED = ("communicate", "optimizer", "strategy")
# step: median over repeats of each entry's step p50, and its ratio to the
# built-in one's. phases: the cost of the phases the plugins run in
# (communicate: compress and the output check; optimizer: the check through
# a norm; strategy: the batch policy's next), as the sum of their p50s;
# plugin minus built-in in the same repeat (same seed, run next to each
# other), median over repeats, as a share of the built-in step.
print(f"{'suite':<20} {'workload':<14} {'strategy':<10} {'step p50 ms (repeats)':<44} {'ratio':>7} {'phases':>8} {'call p50 us':>12}")
for s in suites:
    r = json.load(open(os.path.join(out, f"plugin-overhead-{s}.json")))
    by = {}
    for e in r["entries"]:
        if e["status"] != "ok":
            print(f"{s}: {e['id']} failed: {e.get('error')}")
            continue
        m = e["metrics"]
        touched = sum(m["phases"][k]["p50_ms"] for k in TOUCHED if k in m["phases"])
        calls = [p["call"]["p50_ms"] * 1e3 for p in m.get("plugins", []) if p.get("call") and p["slot"] == "compressor"]
        by.setdefault((e["workload"], e["strategy"]), {})[e["repeat"]] = (m["step"]["p50_ms"], touched, calls[0] if calls else None)
    for (w, st), reps in sorted(by.items()):
        base = by[(w, "built-in")]
        step, bstep = med(v[0] for v in reps.values()), med(v[0] for v in base.values())
        extra = med(reps[k][1] - base[k][1] for k in reps if k in base)
        call = [v[2] for v in reps.values() if v[2] is not None]
        shown = ", ".join(f"{reps[k][0]:.2f}" for k in sorted(reps))
        print(f"{s:<20} {w:<14} {st:<10} {f'{step:.3f} ({shown})':<44} {step / bstep:7.4f} {100 * extra / bstep:+7.2f}% {med(call) if call else float('nan'):12.2f}")
PY
