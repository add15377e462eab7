#!/usr/bin/env python3
"""PyTorch reference for harness's `vision` ViT presets: the same network,
recipe and measurement, in eager PyTorch (or torch.compile with --compile).

Architecture as crates/train/src/models/vision.rs (torchvision's vit_b_16, written
out here so the script needs nothing but torch): a strided convolution
cuts the image into patches, a class token and learned positions are
added, pre-LayerNorm encoder blocks (one fused q/k/v projection, non-causal
attention through scaled_dot_product_attention, an exact-GELU MLP), a final
LayerNorm and a linear head on the class token. ViT-B/16 at 1000 classes
has torchvision's 86,567,656 parameters. Recipe as suites/gpu-vit.toml:
bf16 autocast, AdamW(fused) lr 1e-3 weight decay 5e-5, no clipping, images
made on the GPU each step, 1000 classes. images/s is reported as
tokens_per_s (one image is one token, as in harness's results). The timed
loop never synchronises inside a step.

Prints one JSON object (and writes it to --json).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchlib import compiled, finish, impl_name, measure, run_args

# layers, width, heads, MLP width
PRESETS = {"vit-b16": (12, 768, 12, 3072), "vit-tiny": (2, 64, 4, 256)}


class Block(nn.Module):
    def __init__(self, d, heads, d_ff):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.in_proj, self.out_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.linear_1, self.linear_2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def attention(self, x):
        b, t, d = x.shape
        q, k, v = self.in_proj(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.linear_2(F.gelu(self.linear_1(self.ln_2(x))))


class ViT(nn.Module):
    def __init__(self, preset, classes, side, patch=16):
        super().__init__()
        layers, d, heads, d_ff = PRESETS[preset]
        self.conv_proj = nn.Conv2d(3, d, patch, patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embedding = nn.Parameter(torch.randn(1, (side // patch) ** 2 + 1, d) * 0.02)
        self.layers = nn.ModuleList(Block(d, heads, d_ff) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x):
        p = self.conv_proj(x).flatten(2).transpose(1, 2)
        y = torch.cat([self.class_token.expand(p.shape[0], -1, -1).to(p.dtype), p], 1) + self.pos_embedding
        for b in self.layers:
            y = b(y)
        return self.head(self.ln(y)[:, 0])


def flops_per_image(model, side, patch=16):
    """Training FLOPs of one image as harness counts them (PaLM's
    convention, 6 x parameters per token a part sees + 12 x layers x width
    x tokens per token for attention): the encoder blocks on the patches and
    the class token, the patch projection on the patches, the head on the
    class token."""
    d = model.ln.normalized_shape[0]
    t = (side // patch) ** 2 + 1
    count = lambda m: sum(p.numel() for p in m.parameters())
    blocks = count(model.layers)
    return 6 * (t * blocks + (t - 1) * count(model.conv_proj) + count(model.head)) + 12 * len(model.layers) * d * t * t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="vit-b16", choices=PRESETS)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=5e-5)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script")
    run_args(ap)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = a.device
    model = ViT(a.preset, a.classes, a.image_size).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    flops = flops_per_image(model, a.image_size)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay, fused=dev == "cuda")
    step_fn = compiled(model, a)
    model.train()

    def step(i):
        # Images and labels made on the device each step (no CPU pipeline).
        x = torch.randn(a.batch, 3, a.image_size, a.image_size, device=dev)
        y = torch.randint(0, a.classes, (a.batch,), device=dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = F.cross_entropy(step_fn(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    dt, loss, mem = measure(step, a, dev)
    ips = a.steps * a.batch / dt
    out = {
        "impl": impl_name(a),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
        "model": a.preset, "parameters": n_params, "flops_per_image": flops, "batch": a.batch,
        "image_size": a.image_size, "steps": a.steps, "warmup": a.warmup,
        "tokens_per_s": ips, "images_per_s": ips, "steps_per_s": a.steps / dt, "ms_per_step": 1e3 * dt / a.steps,
        "achieved_tflops": flops * ips / 1e12,
        **mem,
        "final_loss": loss.item(),
    }
    finish(out, a.json)


if __name__ == "__main__":
    main()
