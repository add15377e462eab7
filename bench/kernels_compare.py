#!/usr/bin/env python3
"""Compares two results files of the same suite, one run with `kernels =
"fused"` and one with `kernels = "libtorch"` (bench/gpu_kernels.sh):
tokens/s, peak memory, and how far the training losses (step by step, same
seeds and data) and the evaluations drift apart, entry by entry.

    bench/kernels_compare.py FUSED.json LIBTORCH.json [LIBTORCH_AGAIN.json [FP32.json]]

A second libtorch run measures the noise: libtorch's own kernels are not
bitwise deterministic on CUDA, and early training amplifies any difference
(a loss spike in one run and not the other), so the same code run twice
drifts too. With an fp32 run of the same suite (no bf16 rounding at all),
a pair passes when the fused run's mean absolute distance from the fp32
curve is no larger than the farther of the two libtorch runs' (or below
0.01): the fused kernels stay as close to the exact maths as libtorch
does. Without it, when the largest relative difference between fused and
libtorch at any step stays within 1% or within twice the libtorch runs'
own drift. The script exits 1 when a pair fails."""
import json
import sys

fused = {e["id"]: e for e in json.load(open(sys.argv[1]))["entries"]}
libtorch = {e["id"]: e for e in json.load(open(sys.argv[2]))["entries"]}
load = lambda i: {e["id"]: e for e in json.load(open(sys.argv[i]))["entries"]} if len(sys.argv) > i else {}
again, fp32 = load(3), load(4)
bad = False


def mean_distance(a, b):
    """Mean absolute difference of two loss curves over their common steps."""
    ac = {s: v for s, _, v in a["metrics"]["loss_curve"]}
    bc = {s: v for s, _, v in b["metrics"]["loss_curve"]}
    steps = sorted(set(ac) & set(bc))
    return sum(abs(ac[s] - bc[s]) for s in steps) / len(steps)


def drift(a, b):
    """Largest absolute and relative difference of two loss curves."""
    ac = {s: v for s, _, v in a["metrics"]["loss_curve"]}
    bc = {s: v for s, _, v in b["metrics"]["loss_curve"]}
    steps = sorted(set(ac) & set(bc))
    return (max(abs(ac[s] - bc[s]) for s in steps), max(abs(ac[s] - bc[s]) / max(abs(bc[s]), 1e-9) for s in steps), len(steps))


print(f"{'entry':32} {'fused tok/s':>11} {'libtorch':>10} {'ratio':>6} {'fused GiB':>9} {'libtorch':>8} "
      f"{'max |dloss|':>11} {'max rel':>8} {'eval fused':>10} {'libtorch':>9}")
for base, f in sorted(fused.items()):
    l = libtorch.get(base)
    if l is None or f["status"] != "ok" or l["status"] != "ok":
        print(f"{base}: missing or failed entry")
        bad = True
        continue
    fm, lm = f["metrics"], l["metrics"]
    diff, rel, steps = drift(f, l)
    noise = drift(again[base], l)[1] if base in again and again[base]["status"] == "ok" else None
    tol = max(0.01, 2 * noise) if noise is not None else 0.01
    gib = lambda m: (m["memory"].get("peak_device_allocated_bytes") or 0) / 2**30
    print(f"{base:32} {fm['tokens_per_s']:11.0f} {lm['tokens_per_s']:10.0f} {fm['tokens_per_s'] / lm['tokens_per_s']:6.3f} "
          f"{gib(fm):9.2f} {gib(lm):8.2f} {diff:11.4f} {rel:8.4f} {fm['final_eval_loss']:10.4f} {lm['final_eval_loss']:9.4f}")
    print(f"  fused: cross-entropy {fm.get('fused_cross_entropy')}, layer norm {fm.get('fused_layer_norm')}; "
          f"libtorch: {lm.get('fused_cross_entropy')}, {lm.get('fused_layer_norm')}; {steps} steps compared")
    if noise is not None:
        print(f"  libtorch run twice: max relative difference {noise:.4f} (eval {again[base]['metrics']['final_eval_loss']:.4f})")
    if base in fp32 and fp32[base]["status"] == "ok":
        x = fp32[base]
        runs = [("fused", f), ("libtorch", l)] + ([("libtorch again", again[base])] if noise is not None else [])
        dist = {name: mean_distance(r, x) for name, r in runs}
        print(f"  mean |loss - fp32 loss| over the steps (fp32 eval {x['metrics']['final_eval_loss']:.4f}): "
              + ", ".join(f"{name} {d:.4f}" for name, d in dist.items()))
        limit = max(0.01, max(d for name, d in dist.items() if name != "fused"))
        if dist["fused"] > limit:
            bad = True
            print(f"  {base}: the fused run strays farther from fp32 ({dist['fused']:.4f}) than libtorch's runs ({limit:.4f})")
    elif rel > tol:
        bad = True
        print(f"  {base}: the losses differ by more than {tol:.2%} at some step")
sys.exit(1 if bad else 0)
