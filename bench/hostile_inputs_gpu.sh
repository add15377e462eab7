#!/usr/bin/env bash
# The GPU side of the hostile-inputs work, in one call on a 2-GPU machine
# (the device tool's nvidia-h100-x2):
#   1. one GPU, GPT-2 124M: the build before and after, alternating with
#      PyTorch eager (bench/compare_builds.sh, REPLICA=1 adds the after build
#      with the replica check forced on every step, to price the hash);
#   2. two GPUs, suites/gpu2.toml (NCCL data parallel through the
#      authenticated rendezvous store), before and after, alternating;
#   3. two GPUs, GPT-2 124M with every-n checkpoints: the run is killed
#      (SIGKILL to its process group) once a checkpoint past step 60 is on
#      disk, and `--resume` must finish the entry from that checkpoint.
# Usage: bench/hostile_inputs_gpu.sh BEFORE_BIN AFTER_BIN  (writes under $OUT;
# the every-n plugin under target/plugins, or .carry/plugins on the device)
set -uo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1 AFTER=$2
source bench/gpu_env.sh
ROOT=$OUT

echo "== 1. one GPU, before / after / PyTorch eager"
mkdir -p "$ROOT/one"
OUT=$ROOT/one COMPILE=0 REPLICA=1 bash bench/compare_builds.sh "$BEFORE" "$AFTER" > "$ROOT/one/table.txt" 2>&1 || echo "compare_builds failed"

echo "== 2. two GPUs, suites/gpu2.toml before / after"
mkdir -p "$ROOT/two"
for r in 1 2; do
  for b in before after; do
    bin=$BEFORE; [ $b = after ] && bin=$AFTER
    "$bin" run suites/gpu2.toml --out "$ROOT/two/$b-$r.json" --quiet > "$ROOT/two/$b-$r.txt" 2>&1 || echo "gpu2 $b-$r failed: $(tail -2 "$ROOT/two/$b-$r.txt")"
  done
done

echo "== 3. two GPUs, killed and resumed"
mkdir -p "$ROOT/resume"
S=$ROOT/resume/suite.toml
sed -e 's/^steps = 110/steps = 400/' -e 's/^name = "gpu2"/name = "gpu2-resume"/' suites/gpu2.toml > "$S"
cat >> "$S" <<EOF

[[plugin]]
name = "every-n"
path = "$PWD/target/plugins/every-n.wasm"

[[strategy]]
name = "every20"
checkpoint = "every-n"
checkpoint_config = { every = 20, keep = 2 }
EOF
R=$ROOT/resume/r.json
setsid "$AFTER" run "$S" --out "$R" --quiet > "$ROOT/resume/first.txt" 2>&1 &
pid=$!
killed=no
for _ in $(seq 1 1200); do
  if ls -d "$ROOT"/resume/r.checkpoints/*every20*/step-* 2>/dev/null | sed 's/.*step-0*//' | awk '$1 >= 60 {f=1} END {exit !f}'; then
    kill -KILL -- -"$pid" 2>/dev/null; killed=yes; break
  fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.2
done
wait "$pid" 2>/dev/null
echo "killed: $killed; checkpoints then: $(ls "$ROOT"/resume/r.checkpoints/*every20*/ 2>/dev/null | tr '\n' ' ')" | tee "$ROOT/resume/kill.txt"
"$AFTER" run "$S" --out "$R" --resume > "$ROOT/resume/resume.txt" 2>&1; echo "resume rc=$?" >> "$ROOT/resume/resume.txt"

tar -C "$ROOT" -czf "$ROOT/hostile-inputs-gpu.tar.gz" --exclude='*.checkpoints' one two resume 2>/dev/null
echo
cat "$ROOT/one/table.txt" | tail -8
python3 - "$ROOT" <<'PY'
import json, os, statistics, sys
d = sys.argv[1]
def tps(p):
    try:
        e = json.load(open(p))["entries"][0]
        return e["metrics"]["tokens_per_s"] if e["status"] == "ok" else None
    except Exception:
        return None
rows = {b: [tps(os.path.join(d, "two", f"{b}-{r}.json")) for r in (1, 2)] for b in ("before", "after")}
print("2 GPUs gpu2.toml tokens/s:", {b: [round(x) if x else x for x in v] for b, v in rows.items()})
if all(rows["before"]) and all(rows["after"]):
    print(f"2 GPUs after / before: {statistics.mean(rows['after']) / statistics.mean(rows['before']):.4f}")
try:
    r = json.load(open(os.path.join(d, "resume", "r.json")))
    for e in r["entries"]:
        res = (e.get("metrics") or {}).get("resilience") or {}
        print(f"resume: {e['id']} {e['status']} resumed_from={res.get('resumed_from')} complete={r.get('complete')}")
except Exception as ex:
    print("resume: no result", ex)
PY
tail -3 "$ROOT/resume/resume.txt"
