#!/usr/bin/env python3
"""Compares two results files of the same suite, one run with `kernels =
"fused"` and one with `kernels = "libtorch"` (bench/gpu_kernels.sh):
tokens/s, peak memory, and how far the training losses (step by step, same
seeds and data) and the evaluations drift apart, entry by entry.

    bench/kernels_compare.py FUSED.json LIBTORCH.json [TOLERANCE]

TOLERANCE (default 0.01) bounds the largest relative difference of the
training loss at any step, the bf16 rounding of two computations of the
same maths; the script exits 1 when a pair exceeds it."""
import json
import sys

fused = {e["id"]: e for e in json.load(open(sys.argv[1]))["entries"]}
libtorch = {e["id"]: e for e in json.load(open(sys.argv[2]))["entries"]}
tol = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
bad = False
print(f"{'entry':32} {'fused tok/s':>11} {'libtorch':>10} {'ratio':>6} {'fused GiB':>9} {'libtorch':>8} "
      f"{'max |dloss|':>11} {'max rel':>8} {'eval fused':>10} {'libtorch':>9}")
for base, f in sorted(fused.items()):
    l = libtorch.get(base)
    if l is None or f["status"] != "ok" or l["status"] != "ok":
        print(f"{base}: missing or failed entry")
        bad = True
        continue
    fm, lm = f["metrics"], l["metrics"]
    fc = {s: v for s, _, v in fm["loss_curve"]}
    lc = {s: v for s, _, v in lm["loss_curve"]}
    steps = sorted(set(fc) & set(lc))
    diff = [abs(fc[s] - lc[s]) for s in steps]
    rel = [abs(fc[s] - lc[s]) / max(abs(lc[s]), 1e-9) for s in steps]
    gib = lambda m: (m["memory"].get("peak_device_allocated_bytes") or 0) / 2**30
    print(f"{base:32} {fm['tokens_per_s']:11.0f} {lm['tokens_per_s']:10.0f} {fm['tokens_per_s'] / lm['tokens_per_s']:6.3f} "
          f"{gib(fm):9.2f} {gib(lm):8.2f} {max(diff):11.4f} {max(rel):8.4f} {fm['final_eval_loss']:10.4f} {lm['final_eval_loss']:9.4f}")
    print(f"  fused: cross-entropy {fm.get('fused_cross_entropy')}, layer norm {fm.get('fused_layer_norm')}; "
          f"libtorch: {lm.get('fused_cross_entropy')}, {lm.get('fused_layer_norm')}; {len(steps)} steps compared")
    if max(rel) > tol:
        bad = True
        print(f"  {base}: the losses differ by more than {tol:.1%} at some step")
sys.exit(1 if bad else 0)
