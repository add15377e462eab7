#!/usr/bin/env python3
"""Prints what suites/gpu-standard-calibration.toml measured.

    bench/calibration_table.py RESULT.json

Batch size: per fixed micro-batch, tokens/s and the step time, then for each
target margin above the data's floor the training time (and tokens) at the
first evaluation at or below it: what the track's baseline batch takes, and
what a larger batch would. Checkpointing: per strategy, the time to target,
where it stopped, the failures and their restores.
"""
import json
import sys

MARGINS = [0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5]


def main(path):
    r = json.load(open(path))
    rows = []
    for e in r["entries"]:
        m = e.get("metrics")
        if not m:
            print(f"{e['id']}: {e['status']}")
            continue
        floor = m.get("loss_floor")
        tok_per_step = m["tokens"] / max(m["steps"], 1)
        if e["workload"].startswith("b"):
            first = {}
            for step, t, loss in m["eval_curve"]:
                for g in MARGINS:
                    if g not in first and floor is not None and loss <= floor + g:
                        first[g] = (t, step * tok_per_step)
            cells = "  ".join(
                f"{first[g][0]:6.1f}s/{first[g][1] / 1e6:4.2f}M" if g in first else "      -      " for g in MARGINS
            )
            rows.append((e["workload"], f"{m['tokens_per_s'] / 1e3:6.1f}k {m['step']['p50_ms']:7.1f}  {m['eval_curve'][-1][2]:.4f}  {cells}"))
        else:
            res = m.get("resilience") or {}
            fails = ", ".join(
                f"{f['step']}->{f['restored_to']}({f.get('restored_from', '?')} {f.get('restore_s', 0):.2f}s)"
                for f in res.get("failures", [])
            )
            ttt = m.get("time_to_target_s")
            rows.append(
                (
                    e["id"],
                    f"ttt {ttt if ttt is None else round(ttt, 2)} s, stopped at {m['steps']} (target {m.get('steps_to_target')}), "
                    f"executed {res.get('steps_executed')}, ckpts {len(res.get('checkpoints', []))}, lost {res.get('time_lost_s', 0):.1f} s; {fails}",
                )
            )
    print("batch  tokens/s p50 ms  final   " + "  ".join(f"  +{g:<5} s/tokens" for g in MARGINS))
    for name, text in rows:
        print(f"{name:6} {text}" if not "/" in name else f"{name}: {text}")


if __name__ == "__main__":
    main(sys.argv[1])
