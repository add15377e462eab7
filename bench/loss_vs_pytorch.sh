#!/usr/bin/env bash
# Does harness train like PyTorch? Both train the same GPT on the same
# learnable token file (bench/markov_tokens.py: a seeded Markov chain whose
# entropy rate is the loss floor), with the same recipe (bench/pytorch_gpt.py's:
# AdamW 6e-4, betas 0.9/0.95, weight decay 0.1, clip 1.0, bf16 autocast),
# at several seeds each, on one GPU; prints the loss along the way and the
# held-out loss at the end, one row per side and seed. Compare the two
# sides' spreads, not one seed's run: on GPT-2 124M the drop from about 9
# to 2.5 nats comes at a seed-dependent step, on both sides
# (results/h200/loss-vs-pytorch-2026-11-29/).
# Settings: PRESET (gpt2-124m), BATCH (16), SEQ (1024), STEPS (300),
# SEEDS ("1 2 3"), TOKEN_VOCAB (50304: the chain's tokens; the model's
# vocabulary stays 50304). Needs $HARNESS_BIN and PyTorch 2.11; writes
# under ${OUT:-bench-out}.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
PRESET=${PRESET:-gpt2-124m}; BATCH=${BATCH:-16}; SEQ=${SEQ:-1024}; STEPS=${STEPS:-300}; SEEDS=${SEEDS:-1 2 3}
TOK=${TOKENS:-$(mktemp -d)/tokens.bin}
python3 bench/markov_tokens.py "$TOK" --vocab "${TOKEN_VOCAB:-50304}" > "$OUT/tokens.json"
for seed in $SEEDS; do
  cat > "$OUT/seed$seed.toml" <<TOML
[suite]
name = "loss-vs-pytorch-seed$seed"
device = "cuda"
seed = $seed
warmup_steps = 0

[[workload]]
name = "$PRESET"
model = { kind = "gpt", preset = "$PRESET" }
data = { kind = "bin", train = "$TOK", vocab = 50304 }
batch = $BATCH
seq_len = $SEQ
steps = $((STEPS + 1))
precision = "bf16"
optimizer = { kind = "adamw", lr = 6e-4, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
grad_clip = 1.0
eval_batches = 2

[[strategy]]
name = "allreduce"
baseline = true
TOML
  "$BIN" run "$OUT/seed$seed.toml" --out "$OUT/harness-$seed.json" --quiet > "$OUT/harness-$seed.txt" 2>&1 || { tail -20 "$OUT/harness-$seed.txt"; exit 1; }
  python3 bench/pytorch_gpt.py --preset "$PRESET" --batch "$BATCH" --seq "$SEQ" --seed "$seed" --tokens "$TOK" \
    --steps $((STEPS - 9)) --warmup 10 --eval-batches 2 --json "$OUT/torch-$seed.json" > /dev/null
done
python3 - "$OUT" "$STEPS" $SEEDS <<'PY'
import json, os, sys
d, steps, seeds = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
at = [s for s in (50, 100, 150, 200, 250, 300, 400, 500) if s < steps] + [steps]
print(f"floor (the chain's entropy rate) {json.load(open(os.path.join(d, 'tokens.json')))['entropy_rate_nats']:.4f}")
print("side | seed | " + " / ".join(f"@{s}" for s in at) + " | held-out loss")
for s in seeds:
    m = json.load(open(os.path.join(d, f"harness-{s}.json")))["entries"][0]["metrics"]
    c = {q[0]: q[2] for q in m["loss_curve"]}
    print(f"harness | {s} | " + " / ".join(f"{c.get(k, float('nan')):.3f}" for k in at) + f" | {m['final_eval_loss']:.4f}")
    t = json.load(open(os.path.join(d, f"torch-{s}.json")))
    c = dict((i, v) for i, v in t["loss_curve"])
    print(f"pytorch | {s} | " + " / ".join(f"{c.get(k, float('nan')):.3f}" for k in at) + f" | {t['eval_loss']:.4f}")
PY
