#!/usr/bin/env bash
# Per-layer PowerSGD: harness's `powersgd` plugin (WASM) against PyTorch's
# DDP `powerSGD_hook`, GPT-2 124M bf16, batch 16 x 1024 per GPU, on
# ${GPUS:-2} GPUs (the device tool's nvidia-h200-x2; GPUS=1 runs the same on
# one GPU, where the collectives are no-ops and the compressors' own work is
# what differs). The same rank (RANK_R, default 4), the hook's defaults
# (min_compression 2, error feedback, warm start) and its start at step 2 on
# both sides; each side against its own plain all-reduce, alternating, in
# one call. Both sides train on the same learnable token file
# (bench/markov_tokens.py: a seeded Markov chain whose entropy rate is the
# loss floor), random windows of its first 95%, and evaluate 8 batches of
# its held-out tail after the last step, so the losses after the same steps
# compare across the two. Round r runs at seed r on both sides (each side's
# all-reduce and PowerSGD at the same seed): on this data GPT-2 124M's loss
# after a few hundred steps depends on the seed on both sides
# (results/h200/loss-vs-pytorch-2026-11-29/), so compare PowerSGD with its
# own side's all-reduce round by round, and the sides over rounds. Needs
# $HARNESS_BIN (default .carry/harness), the plugins in .carry/plugins and
# PyTorch 2.11. Writes under ${OUT:-bench-out}; prints a table last.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
GPUS=${GPUS:-2}; R=${RANK_R:-4}; STEPS=${STEPS:-300}; ROUNDS=${ROUNDS:-2}
# The token file (80 MB) outside $OUT: only its description comes back.
TOK=${TOKENS:-$(mktemp -d)/tokens.bin}
python3 bench/markov_tokens.py "$TOK" > "$OUT/tokens.json"
for round in $(seq 1 "$ROUNDS"); do
cat > "$OUT/powersgd-$round.toml" <<TOML
[suite]
name = "powersgd-vs-hook"
device = "cuda"
seed = $round
warmup_steps = 10
world_size = $GPUS

[[workload]]
name = "gpt2-124m-bf16"
model = { kind = "gpt", preset = "gpt2-124m" }
data = { kind = "bin", train = "$TOK", vocab = 50304 }
batch = 16
seq_len = 1024
steps = $((STEPS + 10))
precision = "bf16"
optimizer = { kind = "adamw", lr = 6e-4, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
grad_clip = 1.0
eval_batches = 8

[[plugin]]
name = "powersgd"
path = "$PWD/target/plugins/powersgd.wasm"

[[strategy]]
name = "allreduce"
baseline = true

[[strategy]]
name = "powersgd-r$R-layers"
compressor = "powersgd"
compressor_config = { rank = $R, start_step = 2 }
TOML
  "$BIN" run "$OUT/powersgd-$round.toml" --out "$OUT/harness-$round.json" --quiet > "$OUT/harness-$round.txt" 2>&1 || { tail -20 "$OUT/harness-$round.txt"; exit 1; }
  torchrun --standalone --nproc_per_node="$GPUS" bench/pytorch_gpt.py --seed "$round" --tokens "$TOK" --steps "$STEPS" --warmup 10 --json "$OUT/torch-allreduce-$round.json" > /dev/null
  torchrun --standalone --nproc_per_node="$GPUS" bench/pytorch_gpt.py --seed "$round" --tokens "$TOK" --steps "$STEPS" --warmup 10 --powersgd-rank "$R" --json "$OUT/torch-powersgd-$round.json" > /dev/null
done
python3 - "$OUT" "$ROUNDS" "$R" <<'PY'
import json, os, sys
d, rounds, r = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = []
for i in range(1, rounds + 1):
    h = {e["strategy"]: e["metrics"] for e in json.load(open(os.path.join(d, f"harness-{i}.json")))["entries"]}
    ta = json.load(open(os.path.join(d, f"torch-allreduce-{i}.json")))
    tp = json.load(open(os.path.join(d, f"torch-powersgd-{i}.json")))
    ha, hp = h["allreduce"], h[f"powersgd-r{r}-layers"]
    # Mean training loss of the last 10 steps, and the held-out loss after the last.
    last10 = lambda m: sum(p[2] for p in m["loss_curve"][-10:]) / len(m["loss_curve"][-10:])
    rows.append((i, ha["tokens_per_s"], hp["tokens_per_s"], ta["tokens_per_s"], tp["tokens_per_s"],
                 ha["final_eval_loss"], hp["final_eval_loss"], ta["eval_loss"], tp["eval_loss"],
                 last10(ha), last10(hp), ta["mean_loss_last_10"], tp["mean_loss_last_10"]))
tok = json.load(open(os.path.join(d, "tokens.json")))
print(f"PowerSGD rank {r}, GPT-2 124M bf16, {json.load(open(os.path.join(d, 'torch-powersgd-1.json')))['world_size']} GPU(s); "
      f"token file's entropy rate (loss floor) {tok['entropy_rate_nats']:.4f}")
print("round | harness allreduce | harness powersgd | torch allreduce | torch powerSGD_hook | harness psgd / torch psgd | eval loss h: ar / psgd | eval loss t: ar / psgd | last-10 train h: ar / psgd | last-10 train t: ar / psgd")
for (i, ha, hp, ta, tp, ea, ep, eta, etp, la, lp, lta, ltp) in rows:
    print(f"{i} | {ha:,.0f} | {hp:,.0f} | {ta:,.0f} | {tp:,.0f} | {hp / tp:.3f} | {ea:.4f} / {ep:.4f} | {eta:.4f} / {etp:.4f} | {la:.4f} / {lp:.4f} | {lta:.4f} / {ltp:.4f}")
PY
