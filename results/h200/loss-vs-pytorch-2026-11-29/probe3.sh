#!/usr/bin/env bash
set -uo pipefail
source bench/gpu_env.sh
D=$(mktemp -d)
python3 bench/markov_tokens.py "$D/big.bin" > "$OUT/big.json"
wl() { # name preset batch seq steps
cat <<TOML
[[workload]]
name = "$1"
model = { kind = "gpt", preset = "$2" }
data = { kind = "bin", train = "$D/big.bin", vocab = 50304 }
batch = $3
seq_len = $4
steps = $5
precision = "bf16"
optimizer = { kind = "adamw", lr = 6e-4, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
grad_clip = 1.0
eval_batches = 2

TOML
}
{ printf '[suite]\nname = "scale"\ndevice = "cuda"\nseed = 1\nwarmup_steps = 0\n\n'
  wl tiny-16x1024 tiny 16 1024 151; wl small-16x1024 small 16 1024 151; wl g124-8x128 gpt2-124m 8 128 151; wl g124-64x256 gpt2-124m 64 256 151
  printf '[[strategy]]\nname = "allreduce"\nbaseline = true\n'; } > "$OUT/scale.toml"
"$BIN" run "$OUT/scale.toml" --out "$OUT/scale.json" --quiet > "$OUT/scale.txt" 2>&1 || tail -5 "$OUT/scale.txt"
for c in "tiny 16 1024" "small 16 1024" "gpt2-124m 8 128" "gpt2-124m 64 256"; do
  set -- $c
  python3 bench/pytorch_gpt.py --preset $1 --batch $2 --seq $3 --tokens "$D/big.bin" --steps 141 --warmup 10 --eval-batches 2 --json "$OUT/torch-$1-$2x$3.json" > /dev/null 2>&1 || echo "torch $c failed"
done
python3 - "$OUT" <<'PY'
import json, os, sys
d = sys.argv[1]
h = {e["workload"]: e["metrics"] for e in json.load(open(os.path.join(d, "scale.json")))["entries"]}
print("config | harness loss @50 / @100 / @150, eval | torch loss @50 / @100 / @150, eval")
for name, (p, b, s) in {"tiny-16x1024": ("tiny", 16, 1024), "small-16x1024": ("small", 16, 1024), "g124-8x128": ("gpt2-124m", 8, 128), "g124-64x256": ("gpt2-124m", 64, 256)}.items():
    m = h.get(name)
    hc = {q[0]: q[2] for q in m["loss_curve"]} if m else {}
    t = json.load(open(os.path.join(d, f"torch-{p}-{b}x{s}.json")))
    tc = dict((i, v) for i, v in t["loss_curve"])
    f = lambda c, k: f"{c.get(k, float('nan')):.3f}"
    print(f"{name} | {f(hc,50)} / {f(hc,100)} / {f(hc,150)}, {m['final_eval_loss'] if m else float('nan'):.3f} | {f(tc,50)} / {f(tc,100)} / {f(tc,150)}, {t['eval_loss']:.3f}")
PY
