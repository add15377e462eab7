#!/usr/bin/env python3
"""Prints the activation-recomputation figures of harness result files, one
row per entry: the setting, micro-batch, tokens/s, step time, the peak
device memory of a training step (evaluation excluded), final train loss, and for batch-policy entries the largest
micro-batch reached and the out-of-memory errors caught.

    python3 bench/recompute_table.py RESULT.json [RESULT.json ...]
"""
import json
import sys

GIB = 2**30


def main(paths):
    print(f"{'workload':14} {'recompute':9} {'batch':>9} {'tokens/s':>9} {'vs none':>7} {'step p50 ms':>11} "
          f"{'step peak GiB':>14} {'vs none':>7} {'train loss':>10} {'OOMs':>4}")
    for path in paths:
        r = json.load(open(path))
        base = {}
        for e in r["entries"]:
            m = e.get("metrics") or {}
            if e.get("status") != "ok":
                print(f"{e['workload']:14} FAILED: {str(e.get('error'))[:100]}")
                continue
            rc = m["model"].get("recompute", "none")
            model = m["model"].get("preset") or "?"
            mem = m["memory"]
            peak = (mem.get("peak_step_allocated_bytes") or mem.get("peak_device_allocated_bytes") or 0) / GIB
            tps = m["tokens_per_s"]
            if rc == "none":
                base[model] = (tps, peak)
            b_tps, b_peak = base.get(model, (float("nan"), float("nan")))
            sizes = [c[1] for c in m.get("batch_changes", [])]
            batch = f"{sizes[0]}..{max(sizes)}" if len(sizes) > 1 else str(sizes[0] if sizes else "?")
            ooms = len((m.get("resilience") or {}).get("out_of_memory", m.get("out_of_memory", [])) or [])
            p50 = (m.get("step") or {}).get("p50_ms", float("nan"))
            print(f"{e['workload']:14} {str(rc):9} {batch:>9} {tps:9.0f} {tps / b_tps:7.2f} {p50:11.1f} "
                  f"{peak:14.2f} {peak / b_peak:7.2f} {m.get('final_train_loss') or float('nan'):10.4f} {ooms:4}")


if __name__ == "__main__":
    main(sys.argv[1:])
