#!/usr/bin/env bash
set -uo pipefail
source bench/gpu_env.sh
D=$(mktemp -d)
python3 bench/markov_tokens.py "$D/small.bin" --tokens 4000000 > "$OUT/small.json"
python3 bench/markov_tokens.py "$D/big.bin" > "$OUT/big.json"
wl() { # name preset batch seq steps precision kernels file
cat <<TOML
[[workload]]
name = "$1"
model = { kind = "gpt", preset = "$2" }
data = { kind = "bin", train = "$8", vocab = 50304 }
batch = $3
seq_len = $4
steps = $5
precision = "$6"
kernels = "$7"
optimizer = { kind = "adamw", lr = 6e-4, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
grad_clip = 1.0
eval_batches = 2

TOML
}
suite() { printf '[suite]\nname = "%s"\ndevice = "%s"\nseed = 1\nwarmup_steps = 0\n\n' "$1" "$2"; }
strat() { printf '[[strategy]]\nname = "allreduce"\nbaseline = true\n'; }
{ suite tiny cuda; wl tiny-gpu tiny 8 128 201 fp32 libtorch "$D/small.bin"; strat; } > "$OUT/tiny.toml"
"$BIN" run "$OUT/tiny.toml" --out "$OUT/tiny.json" --quiet > "$OUT/tiny.txt" 2>&1 || tail -5 "$OUT/tiny.txt"
{ suite big cuda; wl big gpt2-124m 16 1024 160 bf16 fused "$D/big.bin"; strat; } > "$OUT/big.toml"
for v in default HARNESS_CUDA_GRAPH=0 HARNESS_LOCAL_GRADS=0 HARNESS_OVERLAP=0 HARNESS_FUSED_CASTS=0; do
  if [ $v = default ]; then e=(); else e=("$v"); fi
  env "${e[@]}" "$BIN" run "$OUT/big.toml" --out "$OUT/big-$v.json" --quiet > "$OUT/big-$v.txt" 2>&1 || tail -5 "$OUT/big-$v.txt"
done
python3 - "$OUT" <<'PY'
import json, os, sys, glob
d = sys.argv[1]
def curve(f):
    e = json.load(open(f))["entries"][0]; m = e["metrics"]
    c = {p[0]: p[2] for p in m["loss_curve"]}
    return [round(c.get(s, float("nan")), 4) for s in (0, 20, 50, 100, 150, 159, 199, 200)], m.get("cuda_graph_steps"), m.get("switches")
print("tiny on GPU fp32 libtorch (CPU run: 20 10.7908, 100 10.407, 199 10.0656, 200 9.8697):", curve(os.path.join(d, "tiny.json")))
for f in sorted(glob.glob(os.path.join(d, "big-*.json"))):
    print(os.path.basename(f), curve(f))
PY
