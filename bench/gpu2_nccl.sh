#!/usr/bin/env bash
# NCCL as a cluster sees it, on a 2-GPU machine, in one call:
#  1. suites/gpu2-nccl.toml: GPT-2 124M tokens/s and all-reduce busbw with
#     NCCL's own transport against its network transport (and fixed
#     NCCL_ALGO/PROTO, and a 2 x 1 topology at 10 Gbps); each entry records
#     the NCCL settings and transports.
#  2. `harness bench allreduce` on the same buckets, both transports.
#  3. A fault suite: rank 1 SIGKILLed, rank 1 hung in a plugin that never
#     enters the collective, rank 1 failing on its own; each entry must end
#     within collective_timeout_s (15 s) and the next entry must train.
# Works under $WORK, packs it into $OUT/gpu2-nccl.tar.gz with the result
# files beside it, and prints a short table last.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/gpu_env.sh
FINAL=$OUT
OUT=${WORK:-/tmp/gpu2-nccl}; rm -rf "$OUT"; mkdir -p "$OUT"
"$BIN" env > "$OUT/env.txt" 2>&1
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1

# ONLY=faults runs part 3 alone.
if [ "${ONLY:-all}" = all ]; then
# 1. Transports in training.
t0=$(date +%s)
"$BIN" run suites/gpu2-nccl.toml --out "$OUT/nccl.json" --quiet > "$OUT/nccl.txt" 2>&1
echo "nccl suite: exit $? in $(( $(date +%s) - t0 )) s"

# 2. The all-reduce alone, on the training buckets.
"$BIN" bench allreduce --bytes-from "$OUT/nccl.json" --world 2 --iters 20 > "$OUT/busbw-auto.json" 2>"$OUT/busbw-auto.err"
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT NCCL_DEBUG_FILE="$OUT/busbw-network.%p.nccl" \
  "$BIN" bench allreduce --bytes-from "$OUT/nccl.json" --world 2 --iters 5 > "$OUT/busbw-network.json" 2>"$OUT/busbw-network.err"

fi

# 3. Faults.
P=$PWD/.carry/plugins/libmisbehave.so
S="$OUT/faults.toml"
cat > "$S" <<TOML
[suite]
name = "faults"
device = "cuda"
world_size = 2
warmup_steps = 2
collective_timeout_s = 15

[[workload]]
name = "small"
model = { kind = "gpt", preset = "small" }
data = { kind = "synthetic", vocab = 512 }
batch = 16
seq_len = 128
steps = 30
optimizer = { kind = "adamw", lr = 1e-3 }
eval_batches = 1

[[plugin]]
name = "bad"
path = "$P"

[[strategy]]
name = "before"
baseline = true

[[strategy]]
name = "rank1-killed"
compressor = "bad"
compressor_config = { mode = "kill", rank = 1 }

[[strategy]]
name = "after-kill"

[[strategy]]
name = "rank1-hung"
compressor = "bad"
compressor_config = { mode = "hang", rank = 1 }

[[strategy]]
name = "after-hang"

[[strategy]]
name = "rank1-fails"
compressor = "bad"
compressor_config = { mode = "panic", rank = 1 }

[[strategy]]
name = "last"
TOML
t0=$(date +%s)
"$BIN" run "$S" --out "$OUT/faults.json" > "$OUT/faults.txt" 2>&1
echo "fault suite: exit $? in $(( $(date +%s) - t0 )) s"

python3 - "$OUT" <<'PY'
import json, sys, glob, os
out = sys.argv[1]
r = json.load(open(f"{out}/nccl.json")) if os.path.exists(f"{out}/nccl.json") else {"entries": []}
print(f"\n{'entry':34} {'status':7} {'tokens/s':>9} {'busbw GB/s':>10} {'emu busbw':>9}  NCCL")
for e in r["entries"]:
    m = e.get("metrics") or {}
    n = m.get("nccl") or {}
    bw = m.get("busbw_gbs"); emu = m.get("busbw_emulated_gbs")
    print(f"{e['id']:34} {e['status']:7} {m.get('tokens_per_s', 0):9.0f} {bw or 0:10.2f} {emu or 0:9.2f}  "
          f"{n.get('version')} via {','.join(n.get('transports', [])) or '?'} {n.get('note') or ''}")
for name in ["auto", "network"]:
    try:
        lines = [l for l in open(f"{out}/busbw-{name}.json") if l.startswith("{")]
        b = json.loads(lines[-1])["buckets"]
        print(f"bench allreduce {name:8}: busbw {b['busbw_gbs']:.2f} GB/s, {b['ms_per_step']:.2f} ms per step of {b['bytes']/1e6:.0f} MB")
    except Exception as ex:
        print(f"bench allreduce {name}: no result ({ex})")
via = set()
for f in glob.glob(f"{out}/busbw-network.*.nccl"):
    for l in open(f):
        if "Channel" in l and " via " in l:
            via.add(l.split(" via ")[1].split()[0])
print("bench network transports:", sorted(via))
f = json.load(open(f"{out}/faults.json"))
print()
for e in f["entries"]:
    m = e.get("metrics") or {}
    print(f"{e['id']:28} {e['status']:7} steps {m.get('steps', '-'):>4}  {e.get('error', '')[:220]}")
print("complete:", f["complete"])
PY
tar -C "$OUT" -czf "$FINAL/gpu2-nccl.tar.gz" .
cp "$OUT"/nccl.json "$OUT"/faults.json "$OUT"/faults.txt "$OUT"/env.txt "$OUT"/topo.txt "$FINAL"/ 2>/dev/null
