#!/usr/bin/env python3
"""PyTorch reference for harness's `vision` ResNets: the same network,
recipe and measurement, in eager PyTorch (or torch.compile with --compile).

Architecture as crates/train/src/models/vision.rs (torchvision's ResNet v1.5,
written out here so the script needs nothing but torch): a 7x7 stride-2
stem and a max-pool, bottleneck stages [3, 4, 6, 3] (ResNet-50) with the
stride in the 3x3 convolution, batch norm after every convolution, global
average pooling and a linear classifier; torchvision's initialisation.
Recipe as suites/gpu-vision.toml: channels-last activations and weights,
bf16 autocast, AdamW(fused) lr 1e-3 weight decay 5e-5, no clipping, images
made on the GPU (as harness's `pipeline = "device"`), 1000 classes.
images/s is reported as tokens_per_s (one image is one token, as in
harness's results). The timed loop never synchronises inside a step.

Prints one JSON object (and writes it to --json).
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchlib import compiled, finish, impl_name, memory, run_args, timed, warm_up

DEPTHS = {50: [3, 4, 6, 3], 101: [3, 4, 23, 3]}


class Bottleneck(nn.Module):
    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, depth, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for i, n in enumerate(DEPTHS[depth]):
            width = 64 * 2**i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if (i > 0 and j == 0) else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def multiply_adds(model, side):
    """Multiply-adds of one forward pass of one image (convolutions and the
    classifier, as torchvision counts them)."""
    total = 0
    hooks = []

    def conv(m, i, o):
        nonlocal total
        total += o.numel() // o.shape[0] * m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]

    def lin(m, i, o):
        nonlocal total
        total += m.in_features * m.out_features

    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            hooks.append(m.register_forward_hook(conv))
        elif isinstance(m, nn.Linear):
            hooks.append(m.register_forward_hook(lin))
    with torch.no_grad():
        model(torch.zeros(1, 3, side, side, device=next(model.parameters()).device))
    for h in hooks:
        h.remove()
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=50, choices=DEPTHS)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=5e-5)
    run_args(ap)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = True
    dev = "cuda"
    model = ResNet(a.depth, a.classes).to(dev).to(memory_format=torch.channels_last)
    n_params = sum(p.numel() for p in model.parameters())
    macs = multiply_adds(model, a.image_size)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay, fused=True)
    step_fn = compiled(model, a)
    model.train()

    def step(i):
        # Images and labels made on the GPU each step (no CPU pipeline).
        x = torch.randn(a.batch, 3, a.image_size, a.image_size, device=dev).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, a.classes, (a.batch,), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(step_fn(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    warm_up(step, a.warmup, a.trace)
    dt, loss = timed(step, a.warmup, a.steps)
    ips = a.steps * a.batch / dt
    out = {
        "impl": impl_name(a),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
        "model": f"resnet{a.depth}", "parameters": n_params, "multiply_adds": macs, "batch": a.batch,
        "image_size": a.image_size, "steps": a.steps, "warmup": a.warmup,
        "tokens_per_s": ips, "images_per_s": ips, "steps_per_s": a.steps / dt, "ms_per_step": 1e3 * dt / a.steps,
        # Training: forward, and backward at twice the forward's cost.
        "achieved_tflops": 6 * macs * ips / 1e12,
        **memory(),
        "final_loss": loss.item(),
    }
    finish(out, a.json)


if __name__ == "__main__":
    main()
