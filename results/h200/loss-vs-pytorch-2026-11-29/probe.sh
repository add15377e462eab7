#!/usr/bin/env bash
# Why does harness learn the Markov token file slower than PyTorch? Same
# model, data, recipe; harness variants vs PyTorch eager, one GPU.
set -uo pipefail
source bench/gpu_env.sh
TOK=$(mktemp -d)/tokens.bin
python3 bench/markov_tokens.py "$TOK" > "$OUT/tokens.json"
S=${STEPS:-300}
wl() { # name kernels precision clip
cat <<TOML
[[workload]]
name = "$1"
model = { kind = "gpt", preset = "gpt2-124m" }
data = { kind = "bin", train = "$TOK", vocab = 50304 }
batch = 16
seq_len = 1024
steps = $((S + 10))
precision = "$3"
kernels = "$2"
optimizer = { kind = "adamw", lr = 6e-4, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
$4
eval_batches = 8

TOML
}
{ printf '[suite]\nname = "loss-probe"\ndevice = "cuda"\nseed = 1\nwarmup_steps = 10\n\n'
  wl fused fused bf16 "grad_clip = 1.0"; wl libtorch libtorch bf16 "grad_clip = 1.0"; wl libtorch-fp32 libtorch fp32 "grad_clip = 1.0"; wl fused-noclip fused bf16 ""
  printf '[[strategy]]\nname = "allreduce"\nbaseline = true\n'; } > "$OUT/probe.toml"
"$BIN" run "$OUT/probe.toml" --out "$OUT/probe.json" --quiet > "$OUT/probe.txt" 2>&1 || tail -20 "$OUT/probe.txt"
{ printf '[suite]\nname = "loss-probe-adamw"\ndevice = "cuda"\nseed = 1\nwarmup_steps = 10\n\n'; wl fused-torchadamw fused bf16 "grad_clip = 1.0"
  printf '[[strategy]]\nname = "allreduce"\nbaseline = true\n'; } > "$OUT/probe2.toml"
HARNESS_FUSED_ADAMW=0 "$BIN" run "$OUT/probe2.toml" --out "$OUT/probe2.json" --quiet > "$OUT/probe2.txt" 2>&1 || tail -20 "$OUT/probe2.txt"
python3 bench/pytorch_gpt.py --tokens "$TOK" --steps "$S" --warmup 10 --json "$OUT/torch.json" > /dev/null
python3 - "$OUT" <<'PY'
import json, os, sys
d = sys.argv[1]
print("variant | tokens/s | loss@50 | loss@150 | last-10 train | eval")
for f in ["probe.json", "probe2.json"]:
    for e in json.load(open(os.path.join(d, f)))["entries"]:
        m = e["metrics"]
        if not m: print(e["workload"], "failed"); continue
        c = {p[0]: p[2] for p in m["loss_curve"]}
        l10 = sum(p[2] for p in m["loss_curve"][-10:]) / 10
        print(f"harness {e['workload']} | {m['tokens_per_s']:,.0f} | {c.get(50, float('nan')):.3f} | {c.get(150, float('nan')):.3f} | {l10:.4f} | {m['final_eval_loss']:.4f}")
t = json.load(open(os.path.join(d, "torch.json")))
tc = dict((i, v) for i, v in t["loss_curve"])
print(f"torch eager bf16 | {t['tokens_per_s']:,.0f} | {tc.get(50, float('nan')):.3f} | {tc.get(150, float('nan')):.3f} | {t['mean_loss_last_10']:.4f} | {t['eval_loss']:.4f}")
PY
