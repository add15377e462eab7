#!/usr/bin/env python3
"""torch.distributed all_reduce bus bandwidth (nccl-tests definitions:
algbw = bytes / time, busbw = algbw x 2(n-1)/n) for fp32 buffers of the given
sizes. Run with torchrun --nproc_per_node=N. Prints one JSON object."""
import json, os, sys, time

import torch
import torch.distributed as dist

def main():
    # Sizes in MiB, or `--bytes-from RESULT.json` for the gradient buckets
    # that a harness entry reduced (so both sides move the same buffers).
    args = sys.argv[1:]
    buckets = []
    if args[:1] == ["--bytes-from"]:
        r = json.load(open(args[1]))
        buckets = r["entries"][0]["metrics"]["bucket_bytes"]
        args = args[2:]
    sizes_mib = [float(x) for x in (args or ["25", "512"])]
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    n = dist.get_world_size()
    out = {"world_size": n, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "sizes": []}
    for mib in sizes_mib:
        x = torch.randn(int(mib * 2**20 / 4), device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = 20
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        alg = x.numel() * 4 / dt / 1e9
        out["sizes"].append({"mib": mib, "ms": dt * 1e3, "algbw_gbs": alg, "busbw_gbs": alg * 2 * (n - 1) / n})
    if buckets:
        # One step's buckets back to back, as the harness issues them.
        xs = [torch.randn(b // 4, device="cuda") for b in buckets]
        for _ in range(3):
            for x in xs:
                dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = 20
        t0 = time.perf_counter()
        for _ in range(iters):
            for x in xs:
                dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
        alg = sum(buckets) / dt / 1e9
        out["buckets"] = {"count": len(buckets), "bytes": sum(buckets), "ms_per_step": dt * 1e3, "algbw_gbs": alg, "busbw_gbs": alg * 2 * (n - 1) / n}
    if dist.get_rank() == 0:
        print(json.dumps(out))
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
