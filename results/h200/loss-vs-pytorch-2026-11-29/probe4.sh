#!/usr/bin/env bash
set -uo pipefail
source bench/gpu_env.sh
D=$(mktemp -d)
python3 bench/markov_tokens.py "$D/big.bin" > "$OUT/big.json"
for seed in 1 2 3; do
cat > "$OUT/s$seed.toml" <<TOML
[suite]
name = "seed$seed"
device = "cuda"
seed = $seed
warmup_steps = 0

[[workload]]
name = "g124"
model = { kind = "gpt", preset = "gpt2-124m" }
data = { kind = "bin", train = "$D/big.bin", vocab = 50304 }
batch = 16
seq_len = 1024
steps = 301
precision = "bf16"
optimizer = { kind = "adamw", lr = 6e-4, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
grad_clip = 1.0
eval_batches = 2

[[strategy]]
name = "allreduce"
baseline = true
TOML
"$BIN" run "$OUT/s$seed.toml" --out "$OUT/h$seed.json" --quiet > "$OUT/h$seed.txt" 2>&1 || tail -5 "$OUT/h$seed.txt"
done
for seed in 0 1 2; do
  python3 bench/pytorch_gpt.py --seed $seed --tokens "$D/big.bin" --steps 291 --warmup 10 --eval-batches 2 --json "$OUT/t$seed.json" > /dev/null 2>&1 || echo "torch $seed failed"
done
python3 - "$OUT" <<'PY'
import json, os, sys
d = sys.argv[1]
print("run | loss @100 / @150 / @200 / @250 / @300 | eval")
for s in (1, 2, 3):
    m = json.load(open(os.path.join(d, f"h{s}.json")))["entries"][0]["metrics"]
    c = {q[0]: q[2] for q in m["loss_curve"]}
    print(f"harness seed {s} | " + " / ".join(f"{c.get(k, float('nan')):.3f}" for k in (100, 150, 200, 250, 300)) + f" | {m['final_eval_loss']:.3f}")
for s in (0, 1, 2):
    t = json.load(open(os.path.join(d, f"t{s}.json")))
    c = dict((i, v) for i, v in t["loss_curve"])
    print(f"torch seed {s} | " + " / ".join(f"{c.get(k, float('nan')):.3f}" for k in (100, 150, 200, 250, 300)) + f" | {t['eval_loss']:.3f}")
PY
