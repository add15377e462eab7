#!/usr/bin/env bash
# Runs on a 2-GPU machine (the device tool's nvidia-h200-x2): harness's
# suites/gpu2.toml (NCCL data parallel) and the 1-GPU GPT-2 entry for scaling,
# PyTorch DDP on the same model under torchrun, and torch.distributed
# all_reduce bus bandwidth; prints a table. Needs $HARNESS_BIN (default
# .carry/harness) and PyTorch 2.11. Writes under ${OUT:-bench-out}.
set -euo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
"$BIN" run suites/gpu2.toml --out "$OUT/harness-2gpu.json" --quiet > "$OUT/harness-2gpu.txt" 2>&1 || { cat "$OUT/harness-2gpu.txt"; exit 1; }
CUDA_VISIBLE_DEVICES=0 "$BIN" run suites/gpu.toml --out "$OUT/harness-1gpu.json" --quiet > /dev/null 2>&1 || echo "1-GPU run failed"
torchrun --standalone --nproc_per_node=2 bench/pytorch_gpt.py --steps 100 --warmup 10 --json "$OUT/pytorch-ddp2.json" > /dev/null
torchrun --standalone --nproc_per_node=2 bench/allreduce_busbw.py --bytes-from "$OUT/harness-2gpu.json" 25 512 > "$OUT/torch-busbw.json"
# harness's own all-reduce on the same buckets, back to back, timed the same way.
"$BIN" bench allreduce --bytes-from "$OUT/harness-2gpu.json" --world 2 --iters 20 > "$OUT/harness-busbw.json" 2> "$OUT/harness-busbw.err" || true
python3 - "$OUT" <<'PY'
import json, sys, os
d = sys.argv[1]
h2 = json.load(open(os.path.join(d, "harness-2gpu.json")))["entries"][0]
m2 = h2.get("metrics") or {}
print("harness 2 GPUs:", h2["status"], h2.get("error", ""))
try:
    h1 = [e for e in json.load(open(os.path.join(d, "harness-1gpu.json")))["entries"] if e["workload"] == "gpt2-124m-bf16"][0]["metrics"]
except Exception as e:
    h1 = None
pt = json.load(open(os.path.join(d, "pytorch-ddp2.json")))
bw = json.load(open(os.path.join(d, "torch-busbw.json")))
if m2:
    print(f"harness 2 GPUs: {m2['tokens_per_s']:.0f} tokens/s, step p50 {m2['step']['p50_ms']:.2f} ms, busbw {m2.get('busbw_gbs') or 0:.1f} GB/s, collectives/step {m2['collectives']/m2['steps']:.1f}, peak alloc {m2['memory']['peak_device_allocated_bytes']/2**30:.2f} GiB")
if h1:
    print(f"harness 1 GPU:  {h1['tokens_per_s']:.0f} tokens/s")
    if m2: print(f"scaling efficiency: {m2['tokens_per_s'] / (2 * h1['tokens_per_s']):.3f}")
print(f"pytorch DDP 2 GPUs: {pt['tokens_per_s']:.0f} tokens/s, {pt['ms_per_step']:.2f} ms/step, peak alloc {pt['peak_allocated_bytes']/2**30:.2f} GiB")
if m2: print(f"harness / pytorch DDP: {m2['tokens_per_s'] / pt['tokens_per_s']:.3f}")
if "buckets" in bw and m2:
    b = bw["buckets"]
    print(f"torch.distributed on harness's {b['count']} buckets ({b['bytes']/2**20:.0f} MiB): busbw {b['busbw_gbs']:.1f} GB/s; harness / torch: {m2['busbw_gbs'] / b['busbw_gbs']:.3f}")
try:
    hb = json.loads(open(os.path.join(d, "harness-busbw.json")).read().strip().splitlines()[-1])["buckets"]
    if "buckets" in bw:
        print(f"harness all-reduce back to back on the same buckets: busbw {hb['busbw_gbs']:.1f} GB/s; harness / torch: {hb['busbw_gbs'] / bw['buckets']['busbw_gbs']:.3f}")
except Exception as e:
    print("harness bench allreduce failed:", e)
for s in bw["sizes"]:
    print(f"torch.distributed all_reduce {s['mib']:.0f} MiB: busbw {s['busbw_gbs']:.1f} GB/s ({s['ms']:.3f} ms)")
PY
