#!/usr/bin/env bash
# Session 7, call 3 (one GPU): where does the small GPT's held-out loss part
# from PyTorch's (harness 5.575 / 5.580 against 5.683 / 5.707 after 150
# steps at b59fc14)? Small GPT, 16 x 1024, 151 steps, seeds 1-3, 16
# held-out batches; harness: fused bf16 (default), libtorch bf16, libtorch
# fp32; PyTorch eager: bf16 autocast, fp32. One suite per variant with the
# same workload name, so each seed initialises alike across variants.
set -uo pipefail
source bench/gpu_env.sh
export CUDA_VISIBLE_DEVICES=0
W=.carry/s7/$1
O=$OUT/g; mkdir -p "$O"
TOK=$(mktemp -d)/tokens.bin
python3 bench/markov_tokens.py "$TOK" > "$O/tokens.json"
for seed in 1 2 3; do
  for v in fused:bf16 libtorch:bf16 libtorch:fp32; do
    k=${v%%:*}; p=${v##*:}
    cat > "$O/$k-$p-$seed.toml" <<TOML
[suite]
name = "loss-bisect"
device = "cuda"
seed = $seed
warmup_steps = 0

[[workload]]
name = "small"
model = { kind = "gpt", preset = "small" }
data = { kind = "bin", train = "$TOK", vocab = 50304 }
batch = 16
seq_len = 1024
steps = 151
precision = "$p"
kernels = "$k"
optimizer = { kind = "adamw", lr = 6e-4, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
grad_clip = 1.0
eval_batches = 16

[[strategy]]
name = "allreduce"
baseline = true
TOML
    timeout 60 $W run "$O/$k-$p-$seed.toml" --out "$O/h-$k-$p-$seed.json" --quiet > "$O/h-$k-$p-$seed.txt" 2>&1 || tail -3 "$O/h-$k-$p-$seed.txt"
  done
  for p in bf16 fp32; do
    timeout 60 python3 bench/pytorch_gpt.py --preset small --batch 16 --seq 1024 --seed "$seed" --tokens "$TOK" \
      --steps 141 --warmup 10 --eval-batches 16 --precision $p --json "$O/t-$p-$seed.json" > /dev/null 2> "$O/t-$p-$seed.err" || tail -3 "$O/t-$p-$seed.err"
  done
done
python3 - "$O" <<'PY'
import json, os, sys, statistics as st
d = sys.argv[1]
rows = {}
for s in (1, 2, 3):
    for k in ("fused-bf16", "libtorch-bf16", "libtorch-fp32"):
        try:
            m = json.load(open(os.path.join(d, f"h-{k}-{s}.json")))["entries"][0]["metrics"]
            c = {q[0]: q[2] for q in m["loss_curve"]}
            rows.setdefault("harness " + k, []).append((c.get(50), c.get(100), c.get(150), m["final_eval_loss"]))
        except Exception as e:
            print("harness", k, s, "missing:", e)
    for p in ("bf16", "fp32"):
        try:
            t = json.load(open(os.path.join(d, f"t-{p}-{s}.json")))
            c = dict((i, v) for i, v in t["loss_curve"])
            rows.setdefault("pytorch " + p, []).append((c.get(50), c.get(100), c.get(150), t["eval_loss"]))
        except Exception as e:
            print("pytorch", p, s, "missing:", e)
print("side | seed 1-3: loss @50 / @100 / @150, held-out (16 batches) | mean held-out")
for k, v in rows.items():
    cells = "; ".join(" / ".join(f"{x:.3f}" if x is not None else "-" for x in r) for r in v)
    print(f"{k} | {cells} | {st.mean(r[3] for r in v):.4f}")
PY
tar -C "$OUT" -czf "$OUT/g.tar.gz" g && rm -rf "$O"
