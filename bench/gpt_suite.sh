# Sourced by bench/scaling.sh and bench/scaling_levers.sh: the GPT suite they
# run, bf16 with nanoGPT's AdamW recipe on synthetic tokens.
# gpt_suite NAME DESCRIPTION PRESET WORLD BATCH STEPS WARMUP BUCKET_MB STRATEGIES
# prints the suite; STRATEGIES is its [[strategy]] tables, verbatim;
# BUCKET_MB "auto" leaves the bucket size to harness.
gpt_suite() {
  cat <<EOF_SUITE
[suite]
name = "$1"
description = "$2"
device = "cuda"
seed = 1
warmup_steps = $7
world_size = $4
$([ "$8" = auto ] || echo "bucket_mb = $8")

[[workload]]
name = "gpt-$3-bf16"
model = { kind = "gpt", preset = "$3" }
data = { kind = "synthetic", vocab = 50304, branching = 4 }
batch = $5
seq_len = 1024
steps = $6
precision = "bf16"
optimizer = { kind = "adamw", lr = 6e-4, betas = [0.9, 0.95], eps = 1e-8, weight_decay = 0.1 }
grad_clip = 1.0
eval_batches = 2

$9
EOF_SUITE
}
