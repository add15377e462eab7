#!/usr/bin/env python3
"""Prints the checkpoint figures of a harness result file, one row per entry:
stall per checkpoint, persist time and speed, the slowdown of the steps that
overlapped a snapshot's copy or a persist, restores by source, the time and
speed of the reads from disk within them, goodput.

    python3 bench/checkpoint_table.py RESULT.json
"""
import json
import statistics
import sys


def mean(xs):
    return statistics.mean(xs) if xs else float("nan")


def main(path):
    r = json.load(open(path))
    print(f"{'workload':10} {'strategy':17} {'mode':5} {'p50ms':>6} {'ckpt':>4} {'stall ms':>15} {'persist s':>9} "
          f"{'GB/s':>5} {'ovl':>4} {'slow ms':>8} {'restores (from: s)':28} {'read s':>9} {'GB/s':>5} {'goodput':>7} {'lost s':>6} {'train s':>7}")
    for e in r["entries"]:
        m = e.get("metrics") or {}
        if e.get("status") != "ok":
            print(f"{e['workload']:10} {e['strategy']:17} FAILED: {str(e.get('error'))[:90]}")
            continue
        res = m.get("resilience") or {}
        cks = res.get("checkpoints", [])
        stalls = [c["cost_s"] * 1e3 for c in cks]
        persisted = [c for c in cks if c.get("persisted") and c.get("persist_s")]
        persist_s = [c["persist_s"] for c in persisted]
        gbps = [c["bytes"] / c["persist_s"] / 1e9 for c in persisted]
        ovl = [c.get("overlap_steps", 0) for c in cks]
        slow = [c.get("slowdown_s", 0.0) * 1e3 for c in cks]
        fails = res.get("failures", [])
        restores = ", ".join(f"{f.get('restored_from', '?')}: {f['restore_s']:.2f}" for f in fails)
        reads = [f for f in fails if f.get("read_s")]
        read_gbps = sum(f["read_bytes"] for f in reads) / sum(f["read_s"] for f in reads) / 1e9 if reads else float("nan")
        read_s = f"{min(f['read_s'] for f in reads):.2f}-{max(f['read_s'] for f in reads):.2f}" if reads else "-"

        stall = f"{mean(stalls):.0f} (max {max(stalls):.0f})" if stalls else "-"
        step = (m.get("step") or {}).get("p50_ms", float("nan"))
        print(f"{e['workload']:10} {e['strategy']:17} {res.get('checkpoint_mode', '-'):5} {step:6.1f} {len(cks):4} {stall:>15} "
              f"{mean(persist_s):9.2f} {mean(gbps):5.2f} {mean(ovl):4.1f} {mean(slow):8.1f} {restores[:28]:28} {read_s:>9} {read_gbps:5.2f} "
              f"{m.get('goodput_steps_per_s') or float('nan'):7.2f} {res.get('time_lost_s', 0.0):6.2f} {m.get('train_time_s', 0.0):7.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
