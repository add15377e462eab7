"""Which of scaled_dot_product_attention's kernels a T5-style learned
position bias gets on CUDA, and at what cost: q, k, v bf16 [16, 16, L, 64]
under bf16 autocast, the bias [1, 16, L, L] looked up from a [32, 16]
table (requiring its gradient, as T5's does), as a permuted view, made
contiguous, padded, or with the keys padded; each line the time of a
forward and backward pass and the kernels it ran. One GPU, seconds.

    python3 bench/sdpa_bias_probe.py
"""
import torch, torch.nn.functional as F, time, warnings
from torch.nn.attention import sdpa_kernel, SDPBackend
dev = "cuda"
b, h, d = 16, 16, 64
def run(q_len, k_len, bias_fn, label, force=None):
    torch.manual_seed(0)
    q = torch.randn(b, h, q_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, h, k_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, h, k_len, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    table = torch.randn(32, h, device=dev, requires_grad=True)
    def step():
        bias = bias_fn(table, q_len, k_len)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        y.float().sum().backward()
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            if force is not None:
                with sdpa_kernel(force):
                    step()
            else:
                step()
        for _ in range(3): step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10): step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 100
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            step(); torch.cuda.synchronize()
        names = sorted({e.name for e in p.events() if ("fmha" in e.name or "flash" in e.name or "softmax" in e.name or "cudnn" in e.name.lower() or "gemm_f32" in e.name)})
        print(f"{label:55s} {ms:7.2f} ms  {[n[:40] for n in names][:4]}  warn={[str(w.message)[:160] for w in ws][:2]}")
    except Exception as e:
        print(f"{label:55s} FAILED {str(e)[:300]}")
idx_cache = {}
def emb(table, q, k, pad=0):
    idx = torch.randint(0, 32, (q, k + pad), device=dev)
    return F.embedding(idx, table).permute(2, 0, 1).unsqueeze(0)
run(512, 512, lambda t, q, k: emb(t, q, k), "512 bias permuted view")
run(513, 513, lambda t, q, k: emb(t, q, k), "513 bias permuted view")
run(513, 513, lambda t, q, k: emb(t, q, k).contiguous(), "513 bias contiguous")
run(513, 513, lambda t, q, k: emb(t, q, k, 15).contiguous()[..., :513], "513 bias padded storage (528) sliced")
run(513, 513, lambda t, q, k: emb(t, q, k, 15).contiguous()[..., :513], "513 forced efficient", SDPBackend.EFFICIENT_ATTENTION)
def padded_keys(t, q, k):
    bias = emb(t, q, k)
    return torch.cat([bias, torch.full((1, h, q, 528 - k), float("-inf"), device=dev)], -1)
run(513, 528, padded_keys, "513 q, keys padded to 528 with -inf bias")
run(513, 513, lambda t, q, k: emb(t, q, k).detach(), "513 bias no grad")
