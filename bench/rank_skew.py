"""How far apart the ranks of one data-parallel step are: reads the traces
that `harness run --trace` writes with HARNESS_TRACE_ALL_RANKS=1 (rank 0's
NAME.json and NAME.rank<r>.json beside it; gzipped or not) and prints, for
each traced step and rank, when the loss kernel ran (the end of the forward
pass), when the backward pass's last kernel on the compute stream ended
(the last to start before the step's last collective),
when the first and the last collective (kernel or copy on another stream)
of the step started, and when the optimizer's first kernel started, in ms
after rank 0's loss kernel. The ranks of one host share the trace clock.

Usage: python3 bench/rank_skew.py TRACE_DIR [LOSS_KERNEL] [OPTIMIZER_KERNEL]
(defaults: ce_bf16, adamw)."""
import glob
import gzip
import json
import os
import re
import sys


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path) as f:
        return json.load(f)["traceEvents"]


def rank_of(path):
    m = re.search(r"\.rank(\d+)\.json", os.path.basename(path))
    return int(m.group(1)) if m else 0


def steps(events, loss, optimizer):
    """Per traced step: (loss start, backward end, first and last collective
    start, optimizer start), in µs of the trace clock."""
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    losses = [e for e in gpu if e["name"] == loss]
    if not losses:
        return []
    compute = losses[0]["tid"]
    out = []
    for i, l in enumerate(losses):
        end = losses[i + 1]["ts"] if i + 1 < len(losses) else float("inf")
        opt = next((e for e in gpu if l["ts"] < e["ts"] < end and e["name"] == optimizer), None)
        stop = opt["ts"] if opt else end
        window = [e for e in gpu if l["ts"] <= e["ts"] < stop]
        coll = [e for e in window if e["tid"] != compute]
        # The backward pass's end: the compute stream's last kernel to start
        # before the step's last collective (after it: the wait, clipping).
        last = coll[-1]["ts"] if coll else stop
        bwd = [e for e in window if e["tid"] == compute and e["ts"] < last]
        out.append((
            l["ts"],
            max((e["ts"] + e["dur"] for e in bwd), default=float("nan")),
            coll[0]["ts"] if coll else float("nan"),
            coll[-1]["ts"] if coll else float("nan"),
            opt["ts"] if opt else float("nan"),
        ))
    return out


def main():
    d = sys.argv[1]
    loss = sys.argv[2] if len(sys.argv) > 2 else "ce_bf16"
    optimizer = sys.argv[3] if len(sys.argv) > 3 else "adamw"
    files = sorted(glob.glob(os.path.join(d, "*.json")) + glob.glob(os.path.join(d, "*.json.gz")), key=rank_of)
    ranks = {rank_of(f): steps(load(f), loss, optimizer) for f in files}
    if 0 not in ranks or not ranks[0]:
        sys.exit(f"no rank 0 trace with {loss} kernels in {d}")
    print(f"{'step':>4} {'rank':>4} {'loss':>8} {'bwd end':>8} {'1st coll':>8} {'last coll':>9} {'optimizer':>9}  (ms after rank 0's loss kernel)")
    for s, base in enumerate(ranks[0]):
        for r in sorted(ranks):
            if s >= len(ranks[r]):
                continue
            vals = [(v - base[0]) / 1e3 for v in ranks[r][s]]
            print(f"{s:>4} {r:>4} " + " ".join(f"{v:>8.2f}" if i < 3 else f"{v:>9.2f}" for i, v in enumerate(vals)))


if __name__ == "__main__":
    main()
