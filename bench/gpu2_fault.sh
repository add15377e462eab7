#!/usr/bin/env bash
# Fault test on a 2-GPU machine: a short entry finishes, then rank 1 is
# SIGKILLed during a long one. Rank 0 must stop within the collective timeout
# with a message naming rank 1, keep the finished entry, and exit non-zero.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
S="$OUT/fault.toml"
cat > "$S" <<'TOML'
[suite]
name = "fault"
device = "cuda"
world_size = 2
warmup_steps = 2
collective_timeout_s = 10

[[workload]]
name = "short"
model = { kind = "gpt", preset = "small" }
data = { kind = "synthetic", vocab = 512 }
batch = 16
seq_len = 128
steps = 20
optimizer = { kind = "adamw", lr = 1e-3 }
eval_batches = 1

[[workload]]
name = "long"
model = { kind = "gpt", preset = "small" }
data = { kind = "synthetic", vocab = 512 }
batch = 16
seq_len = 128
steps = 1000000
optimizer = { kind = "adamw", lr = 1e-3 }
eval_batches = 1
TOML
start=$(date +%s)
"$BIN" run "$S" --out "$OUT/fault.json" --quiet > "$OUT/fault.log" 2>&1 &
launcher=$!
# Wait until the first entry is on disk and the second is running.
for i in $(seq 1 120); do
  python3 -c "import json,sys; r=json.load(open('$OUT/fault.json')); sys.exit(0 if len(r['entries'])>=1 else 1)" 2>/dev/null && break
  sleep 0.5
done
sleep 5
victim=$(pgrep -n -f "harness run $S")
echo "killing rank process $victim (newest of: $(pgrep -f "harness run $S" | tr '\n' ' '))"
kill -KILL "$victim"
killed=$(date +%s)
wait $launcher; code=$?
end=$(date +%s)
echo "launcher exit code $code; stopped $((end - killed)) s after the kill (timeout 10 s); whole run $((end - start)) s"
tail -5 "$OUT/fault.log"
python3 - "$OUT/fault.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for e in r["entries"]:
    print(e["id"], e["status"], e.get("error", "")[:300])
print("complete:", r["complete"])
PY
