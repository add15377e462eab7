#!/usr/bin/env python3
"""PyTorch reference for harness's `encoder` family: torch.nn's own
TransformerEncoder (post-LayerNorm, ReLU, batch first, no dropout) with a
mean-pool linear head, trained on the regression task of harness's
`regression` data, in eager PyTorch (or torch.compile with --compile).

Preset claims5 (6 layers, width 512, 8 heads, feed-forward 2048) has
harness's 18,914,817 parameters. Recipe as suites/gpu-kernels-encoder.toml:
bf16 autocast, AdamW(fused) lr 1e-3 without weight decay, inputs drawn on
the GPU each step (unit normals; the target is a fixed unit vector's dot
product with the sequence mean times sqrt(seq_len), plus noise 0.3). The
timed loop never synchronises inside a step.

Prints one JSON object (and writes it to --json).
"""
import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchlib import compiled, finish, impl_name, measure, run_args

# layers, width, heads, feed-forward width
PRESETS = {"claims5": (6, 512, 8, 2048), "tiny": (2, 64, 4, 256)}


class Encoder(nn.Module):
    def __init__(self, preset):
        super().__init__()
        layers, d, heads, d_ff = PRESETS[preset]
        layer = nn.TransformerEncoderLayer(d, heads, d_ff, dropout=0.0, activation="relu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1)).squeeze(-1)


def flops_per_token(model, t):
    """Training FLOPs of one token as harness counts them (6 x parameters +
    12 x layers x width x seq_len for attention)."""
    n = sum(p.numel() for p in model.parameters())
    layers, d = len(model.encoder.layers), model.head.in_features
    return 6 * n + 12 * layers * d * t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="claims5", choices=PRESETS)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--noise", type=float, default=0.3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    run_args(ap)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = a.device
    model = Encoder(a.preset).to(dev)
    d = model.head.in_features
    w = F.normalize(torch.randn(d, device=dev), dim=0)
    n_params = sum(p.numel() for p in model.parameters())
    flops = flops_per_token(model, a.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=dev == "cuda")
    step_fn = compiled(model, a)
    model.train()

    def step(i):
        x = torch.randn(a.batch, a.seq_len, d, device=dev)
        y = x.mean(1) @ w * math.sqrt(a.seq_len) + a.noise * torch.randn(a.batch, device=dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            pred = step_fn(x)
        loss = F.mse_loss(pred.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    dt, loss, mem = measure(step, a, dev)
    tps = a.steps * a.batch * a.seq_len / dt
    out = {
        "impl": impl_name(a),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
        "model": a.preset, "parameters": n_params, "flops_per_token": flops, "batch": a.batch,
        "seq_len": a.seq_len, "steps": a.steps, "warmup": a.warmup,
        "tokens_per_s": tps, "steps_per_s": a.steps / dt, "ms_per_step": 1e3 * dt / a.steps,
        "achieved_tflops": flops * tps / 1e12,
        **mem,
        "final_loss": loss.item(),
    }
    finish(out, a.json)


if __name__ == "__main__":
    main()
