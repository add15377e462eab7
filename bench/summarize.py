#!/usr/bin/env python3
"""Prints harness vs PyTorch tokens/s from a folder of bench outputs
(harness-*.json result files, pytorch-*.json from pytorch_gpt.py).

    bench/summarize.py [DIR] [WORKLOAD] [MODEL] [VARIANT]

The ratios compare the harness workload WORKLOAD (default gpt2-124m-bf16)
with the PyTorch runs (with MODEL, only pytorch-*-MODEL.json): with eager
PyTorch (the mean of its runs) and with torch.compile in its best mode
(each mode's runs averaged, the fastest mode taken). With VARIANT, only
harness-*-VARIANT-N.json files count for harness (gpu_families.sh's
variants)."""
import glob, json, os, sys

d = sys.argv[1] if len(sys.argv) > 1 else "bench-out"
workload = sys.argv[2] if len(sys.argv) > 2 else "gpt2-124m-bf16"
model = sys.argv[3] if len(sys.argv) > 3 else None
variant = sys.argv[4] if len(sys.argv) > 4 else None
rows = []
for p in sorted(glob.glob(os.path.join(d, "harness-*.json"))):
    r = json.load(open(p))
    for e in r["entries"]:
        m = e.get("metrics") or {}
        if e["status"] != "ok":
            rows.append((os.path.basename(p) + ":" + e["id"], 0, 0, 0, 0, "FAILED " + e.get("error", "")))
            continue
        mem = m["memory"].get("peak_device_allocated_bytes") or 0
        rows.append((os.path.basename(p) + ":" + e["id"], m["tokens_per_s"], m["step"]["p50_ms"], m.get("mfu") or 0, mem, ""))
        ph = " ".join(f"{k}={v['mean_ms']:.2f}" for k, v in m["phases"].items())
        hp = " ".join(f"{k}={v['mean_ms']:.2f}" for k, v in m.get("host_phases", {}).items())
        print(f"{os.path.basename(p)} {e['id']}: device ms {ph} | host ms {hp}")
for p in sorted(glob.glob(os.path.join(d, f"pytorch-*-{model}.json" if model else "pytorch-*.json"))):
    r = json.load(open(p))
    rows.append((os.path.basename(p), r["tokens_per_s"], r["ms_per_step"], r["achieved_tflops"] / 989.4, r["peak_allocated_bytes"], ""))
print(f"{'run':60s} {'tokens/s':>10s} {'ms/step':>8s} {'MFU':>6s} {'peak GiB':>8s}")
for name, tps, ms, mfu, mem, note in rows:
    print(f"{name:60s} {tps:10.0f} {ms:8.2f} {100*mfu:5.1f}% {mem/2**30:8.2f} {note}")
h = [r[1] for r in rows if r[0].startswith("harness") and f":{workload}/" in r[0] and r[1] > 0
     and (variant is None or r[0].split(":")[0].removesuffix(".json").rstrip("0123456789").endswith(f"-{variant}-"))]
if variant:
    print(f"harness variant {variant}: {len(h)} runs")
e = [r[1] for r in rows if r[0].startswith("pytorch-eager")]
if h and e:
    print(f"harness / pytorch eager (mean of runs): {sum(h)/len(h) / (sum(e)/len(e)):.3f}")
# Each compile mode's runs: the file name less its run number and model.
modes = {}
for r in rows:
    if r[0].startswith("pytorch-compile") and r[1] > 0:
        mode = r[0].removesuffix(".json").removesuffix(f"-{model}" if model else "").rstrip("-0123456789") or "pytorch-compile"
        modes.setdefault(mode, []).append(r[1])
if h and modes:
    for mode, c in sorted(modes.items()):
        print(f"harness / {mode}: {sum(h)/len(h) / (sum(c)/len(c)):.3f}")
    best = max(sum(c) / len(c) for c in modes.values())
    print(f"harness / torch.compile (best mode): {sum(h)/len(h) / best:.3f}")
