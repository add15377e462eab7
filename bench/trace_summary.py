#!/usr/bin/env python3
"""Where one traced step's time goes (a trace from `harness run --trace`).

    bench/trace_summary.py TRACE.json [--top N]

Prints the step's phases (harness's ranges, host time), the GPU's busy time
by kind of kernel (matmul, attention, normalisation, elementwise, softmax and
cross-entropy, optimizer, copies), and the N kernels that took longest in
total. GPU time is the sum of kernel and copy durations on the device.
"""
import collections
import json
import sys

KINDS = [
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "matmul", "sm90_", "sm80_")),
    ("layer norm", ("layer_norm", "layernorm")),
    ("softmax / cross-entropy", ("softmax", "nll_loss", "cross_entropy", "log_softmax")),
    ("optimizer", ("adam", "multi_tensor_apply", "foreach")),
    ("reduction", ("reduce", "norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "gelu", "dropout", "fill", "copy", "cat", "index", "embedding")),
]


def kind(name):
    low = name.lower()
    for k, keys in KINDS:
        if any(key in low for key in keys):
            return k
    return "other"


def main(path, top):
    events = json.load(open(path))["traceEvents"]
    ranges = [e for e in events if e.get("cat") == "user_annotation"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if ranges:
        t0 = min(e["ts"] for e in ranges)
        t1 = max(e["ts"] + e["dur"] for e in ranges)
        print(f"step (host, first range to last): {(t1 - t0) / 1e3:.2f} ms")
        for e in sorted(ranges, key=lambda e: e["ts"]):
            print(f"  {e['name']:40} {e['dur'] / 1e3:9.3f} ms")
    if not kernels:
        print("no GPU activity in the trace (a CPU run, or CUPTI unavailable)")
        return
    busy = sum(e["dur"] for e in kernels)
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    print(f"\nGPU: {len(kernels)} kernels and copies, busy {busy / 1e3:.2f} ms of a {span / 1e3:.2f} ms span ({100 * busy / span:.0f}%)")
    by_kind = collections.Counter()
    for e in kernels:
        by_kind[kind(e["name"]) if e["cat"] == "kernel" else "copies"] += e["dur"]
    print(f"\n{'kind':26} {'ms':>9} {'share':>6}")
    for k, d in by_kind.most_common():
        print(f"{k:26} {d / 1e3:9.3f} {100 * d / busy:5.1f}%")
    by_name = collections.defaultdict(lambda: [0, 0])
    for e in kernels:
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    print(f"\n{'kernel':90} {'calls':>5} {'ms':>8} {'share':>6}")
    for name, (d, n) in sorted(by_name.items(), key=lambda x: -x[1][0])[:top]:
        short = name if len(name) <= 90 else name[:87] + "..."
        print(f"{short:90} {n:5} {d / 1e3:8.3f} {100 * d / busy:5.1f}%")


if __name__ == "__main__":
    args = sys.argv[1:]
    top = int(args[args.index("--top") + 1]) if "--top" in args else 20
    main(args[0], top)
