"""What the PyTorch reference benches (pytorch_gpt.py, pytorch_t5.py,
pytorch_resnet.py, pytorch_vit.py, pytorch_encoder.py) share: warm-up, one
traced step, the timed loop and their JSON output. `step(i)` trains step i
and returns its loss."""
import json
import os
import sys
import time

import torch


def run_args(ap):
    """The options every bench takes: how many steps to time and warm up,
    torch.compile, where to write the JSON and a trace."""
    ap.add_argument("--steps", type=int, default=100, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    ap.add_argument(
        "--compile-mode", default="default",
        choices=["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"],
        help="torch.compile's mode (the benches compare against the fastest)",
    )
    ap.add_argument("--json")
    ap.add_argument("--trace", help="write a Chrome trace of one step (after warm-up, untimed) to this file")


def compiled(model, a):
    """`model` compiled whole with torch.compile in `a.compile_mode` if
    `a.compile`, else `model`."""
    if not a.compile:
        return model
    return torch.compile(model) if a.compile_mode == "default" else torch.compile(model, mode=a.compile_mode)


def impl_name(a, suffix=""):
    """The run's `impl` label: pytorch-eager, pytorch-compile, or
    pytorch-compile-MODE for a mode other than the default."""
    if not a.compile:
        return "pytorch-eager" + suffix
    mode = "" if a.compile_mode == "default" else "-" + a.compile_mode
    return "pytorch-compile" + suffix + mode


def warm_up(step, n, trace=None):
    """Runs steps 0..n-1, then, with `trace` (a path), records step n-1 once
    more as `harness run --trace` records one: operators with their shapes,
    kernels and copies, as a Chrome trace."""
    for i in range(n):
        step(i)
    torch.cuda.synchronize()
    if trace:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
            with torch.profiler.record_function("pytorch: step"):
                step(n - 1)
            torch.cuda.synchronize()
        prof.export_chrome_trace(trace)


def timed(step, first, n):
    """Steps first..first+n-1 from a reset peak-memory counter, never
    synchronising inside a step: (seconds, the last step's loss)."""
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = None
    for i in range(first, first + n):
        loss = step(i)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, loss


def measure(step, a, dev):
    """Warm-up then the timed steps of a bench's options `a` on `dev`:
    (seconds, the last step's loss, peak memory). On CUDA through warm_up
    and timed; on the CPU (a script's smoke test) plain wall time and no
    memory figures."""
    if dev == "cuda":
        warm_up(step, a.warmup, a.trace)
        dt, loss = timed(step, a.warmup, a.steps)
        return dt, loss, memory()
    for i in range(a.warmup):
        step(i)
    t0 = time.perf_counter()
    loss = None
    for i in range(a.warmup, a.warmup + a.steps):
        loss = step(i)
    return time.perf_counter() - t0, loss, {}


def memory():
    """The timed loop's peak device memory, allocated and reserved."""
    return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(), "peak_reserved_bytes": torch.cuda.max_memory_reserved()}


def write(out, path=None, show=True):
    """Prints the result as one JSON line and writes it to `path`."""
    if show:
        print(json.dumps(out))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def finish(out, path=None):
    """A bench's last act: [`write`], then the process ends at once. After
    torch.compile's max-autotune modes, inductor's compile workers kept a
    finished bench from exiting for minutes, until a caller's time limit
    killed it (exit status 124 with its result written)."""
    write(out, path)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
