#!/usr/bin/env python3
"""Where a data-parallel step loses time on the GPU, from `harness run --trace`.

    bench/dp_trace.py TRACE.json[.gz] [TRACE.json[.gz] ...]

For each traced step of each trace (one rank's), from the GPU ranges of
harness's forward and optimizer phases: the forward pass; the backward
window (end of the forward range to the start of the optimizer's); the
matmuls' kernel time in that window, and how much of it ran beside an NCCL
kernel; the NCCL kernels' time; and the exposed tail (from the end of the
window's last compute kernel to the end of its last NCCL kernel). Run it on
a 1-GPU and a several-GPU trace of the same workload: the matmuls' growth is
what the collectives cost the computation beside them, the tail what the
overlap did not hide.
"""
import gzip
import json
import sys

MATMUL = ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "matmul", "sm90_", "sm80_")


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def merged(spans):
    """The union of [start, end) spans, sorted and merged."""
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(s, e, union):
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in union if a < e and b > s)


def steps(events):
    ranges = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    fwd = sorted((e for e in ranges if e["name"] == "harness: forward"), key=lambda e: e["ts"])
    opt = sorted((e for e in ranges if e["name"] == "harness: optimizer"), key=lambda e: e["ts"])
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    for f in fwd:
        f_end = f["ts"] + f["dur"]
        o = next((o for o in opt if o["ts"] >= f_end), None)
        if o is None:
            continue
        lo, hi = f_end, o["ts"]
        inside = [k for k in kernels if lo <= k["ts"] < hi]
        nccl = [k for k in inside if "nccl" in k["name"].lower()]
        compute = [k for k in inside if "nccl" not in k["name"].lower()]
        mm = [k for k in compute if any(x in k["name"].lower() for x in MATMUL)]
        union = merged((k["ts"], k["ts"] + k["dur"]) for k in nccl)
        mm_beside = sum(overlap(k["ts"], k["ts"] + k["dur"], union) for k in mm)
        last_nccl = max((k["ts"] + k["dur"] for k in nccl), default=None)
        last_compute = max((k["ts"] + k["dur"] for k in compute if last_nccl is None or k["ts"] < last_nccl), default=lo)
        yield {
            "forward": f["dur"] / 1e3,
            "window": (hi - lo) / 1e3,
            "matmul": sum(k["dur"] for k in mm) / 1e3,
            "matmul beside nccl": mm_beside / 1e3,
            "other compute": sum(k["dur"] for k in compute if k not in mm) / 1e3,
            "nccl": sum(k["dur"] for k in nccl) / 1e3,
            "nccl kernels": len(nccl),
            "tail": max(0.0, (last_nccl - last_compute) / 1e3) if last_nccl else 0.0,
            "optimizer": o["dur"] / 1e3,
        }


def grids(events):
    """Each matmul kernel's grid sizes (blocks), with its calls."""
    seen = {}
    for e in events:
        if e.get("cat") == "kernel" and any(x in e["name"].lower() for x in MATMUL):
            g = e.get("args", {}).get("grid") or [0]
            blocks = 1
            for x in g:
                blocks *= x
            key = (e["name"][:60], blocks)
            seen[key] = seen.get(key, 0) + 1
    return sorted(seen.items(), key=lambda kv: -kv[1])


def main(paths):
    cols = ["forward", "window", "matmul", "matmul beside nccl", "other compute", "nccl", "nccl kernels", "tail", "optimizer"]
    print(f"{'trace (ms per step)':<44} " + " ".join(f"{c:>10}" for c in ["step"] + cols))
    for path in paths:
        rows = list(steps(load(path)))
        name = path.rsplit("/", 1)[-1][:44]
        for i, r in enumerate(rows):
            print(f"{name:<44} " + f"{i:>10} " + " ".join(f"{r[c]:>10.2f}" if isinstance(r[c], float) else f"{r[c]:>10}" for c in cols))
        if rows:
            mean = {c: sum(r[c] for r in rows) / len(rows) for c in cols}
            print(f"{name:<44} " + f"{'mean':>10} " + " ".join(f"{mean[c]:>10.2f}" for c in cols))
        for (kernel, blocks), calls in grids(load(path))[:12]:
            print(f"    matmul {kernel:<60} {blocks:>6} blocks  {calls:>5} calls")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
