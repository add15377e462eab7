#!/usr/bin/env python3
"""PyTorch reference for harness's `t5` model: the same T5 v1.0
encoder-decoder, recipe and measurement, in eager PyTorch (or, with
--compile, the whole model compiled with torch.compile in --compile-mode;
with --compile-layers, each layer compiled instead).

Architecture as crates/train/src/models/t5.rs: RMS-normalised pre-norm layers without
biases, ReLU feed-forward, unscaled attention logits with a learned bias per
head and relative-position bucket (32 buckets, max distance 128; one table
per stack), cross-attention, a shared embedding that is also the output
layer (its input scaled by d_model^-0.5), no dropout. Teacher forcing: the
decoder reads the target shifted right behind token 0; the source ends with
the end token (1), as harness's `pairs` data. Recipe as docs/claims.md
section 1 (T5-large on random tokens, batch 16 x 512, Adam lr 1e-4):
bf16 autocast, AdamW(fused) without weight decay, no clipping. tokens/s
counts target tokens. The timed loop never synchronises inside a step.

Prints one JSON object (and writes it to --json).
"""
import argparse, math

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchlib import compiled, finish, impl_name, memory, run_args, timed, warm_up

# layers per stack, heads, width, feed-forward width
PRESETS = {"small": (6, 8, 512, 2048), "base": (12, 12, 768, 3072), "large": (24, 16, 1024, 4096)}
BUCKETS, MAX_DISTANCE = 32, 128


def bucket(rel, bidirectional):
    """T5's relative-position bucket of key position - query position."""
    n, buckets, base = -rel, BUCKETS, 0
    if bidirectional:
        buckets //= 2
        base = buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    exact = buckets // 2
    if n < exact:
        return base + n
    far = exact + int(math.log(n / exact) / math.log(MAX_DISTANCE / exact) * (buckets - exact))
    return base + min(far, buckets - 1)


def rms_norm(x, w):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        dkv = d // h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        nn.init.normal_(self.q.weight, 0.0, (d * dkv) ** -0.5)
        for m in (self.k, self.v, self.o):
            nn.init.normal_(m.weight, 0.0, d ** -0.5)

    def forward(self, x, kv, bias=None):
        b, tq, d = x.shape
        tk = kv.shape[1]
        q = self.q(x).view(b, tq, self.h, -1).transpose(1, 2)
        k = self.k(kv).view(b, tk, self.h, -1).transpose(1, 2)
        v = self.v(kv).view(b, tk, self.h, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
        return self.o(y.transpose(1, 2).contiguous().view(b, tq, d))


class FeedForward(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.wi, self.wo = nn.Linear(d, d_ff, bias=False), nn.Linear(d_ff, d, bias=False)
        nn.init.normal_(self.wi.weight, 0.0, d ** -0.5)
        nn.init.normal_(self.wo.weight, 0.0, d_ff ** -0.5)

    def forward(self, x):
        return self.wo(F.relu(self.wi(x)))


class Layer(nn.Module):
    def __init__(self, d, h, d_ff, cross):
        super().__init__()
        self.ln1 = nn.Parameter(torch.ones(d))
        self.attn = Attention(d, h)
        self.cross = Attention(d, h) if cross else None
        self.ln2 = nn.Parameter(torch.ones(d)) if cross else None
        self.ln3 = nn.Parameter(torch.ones(d))
        self.ffn = FeedForward(d, d_ff)

    def forward(self, x, bias, memory=None):
        y = rms_norm(x, self.ln1)
        x = x + self.attn(y, y, bias)
        if self.cross is not None:
            x = x + self.cross(rms_norm(x, self.ln2), memory)
        return x + self.ffn(rms_norm(x, self.ln3))


class T5(nn.Module):
    def __init__(self, layers, heads, d, d_ff, vocab):
        super().__init__()
        self.d = d
        self.shared = nn.Parameter(torch.randn(vocab, d))
        self.enc_bias = nn.Parameter(torch.randn(BUCKETS, heads) * d ** -0.5)
        self.dec_bias = nn.Parameter(torch.randn(BUCKETS, heads) * d ** -0.5)
        self.encoder = nn.ModuleList([Layer(d, heads, d_ff, False) for _ in range(layers)])
        self.decoder = nn.ModuleList([Layer(d, heads, d_ff, True) for _ in range(layers)])
        self.enc_norm = nn.Parameter(torch.ones(d))
        self.dec_norm = nn.Parameter(torch.ones(d))
        self.tables = {}

    def prepare(self, src_len, tgt_len, device):
        """Builds the bucket tables for these lengths, before any compile:
        torch.compile traces Python, and the table's q x k calls of
        `bucket` traced in the forward held the whole-model compile for
        more than 8 minutes (never finished) on an H100 host."""
        for q, causal in ((src_len, False), (tgt_len, True)):
            idx = [[bucket(j - i, not causal) for j in range(q)] for i in range(q)]
            self.tables[(q, q, causal)] = torch.tensor(idx, device=device)

    def position_bias(self, table, q, k, causal, device):
        bias = F.embedding(self.tables[(q, k, causal)], table).permute(2, 0, 1).unsqueeze(0)
        if causal:
            mask = torch.ones(q, k, dtype=torch.bool, device=device).triu(1)
            bias = bias.masked_fill(mask, float("-inf"))
        return bias

    def forward(self, src, tgt):
        b, s = src.shape
        t = tgt.shape[1]
        x = F.embedding(src, self.shared)
        enc_bias = self.position_bias(self.enc_bias, s, s, False, src.device)
        for layer in self.encoder:
            x = layer(x, enc_bias)
        memory = rms_norm(x, self.enc_norm)
        dec_in = torch.cat([torch.zeros(b, 1, dtype=tgt.dtype, device=tgt.device), tgt[:, :-1]], 1)
        x = F.embedding(dec_in, self.shared)
        dec_bias = self.position_bias(self.dec_bias, t, t, True, src.device)
        for layer in self.decoder:
            x = layer(x, dec_bias, memory)
        logits = F.linear(rms_norm(x, self.dec_norm) * self.d ** -0.5, self.shared)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="large", choices=PRESETS)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512, help="target length (the source is as many words and the end token)")
    ap.add_argument("--vocab", type=int, default=32128)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--compile-layers", action="store_true", help="torch.compile each layer (regional compilation) instead of the whole model")
    run_args(ap)
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    layers, heads, d, d_ff = PRESETS[a.preset]
    model = T5(layers, heads, d, d_ff, a.vocab).to(dev)
    model.prepare(a.seq + 1, a.seq, dev)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True)
    if a.compile_layers:
        # Regional compilation (PyTorch's recipe for repeated blocks): each
        # layer is compiled in place, and the 48 layers of T5-large share
        # two compiled graphs (encoder, decoder layer); compiling the whole
        # model took more than 7 minutes on an H100 host.
        for layer in list(model.encoder) + list(model.decoder):
            layer.compile()
        step_fn = model
    else:
        step_fn = compiled(model, a)
    # Random pairs (harness: `pairs` data with noise = 1): words 2..vocab-1,
    # each source closed by the end token.
    data = torch.randint(2, a.vocab, (a.warmup + a.steps, 2, a.batch, a.seq + 1), device=dev)
    data[:, 0, :, -1] = 1

    def step(i):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(data[i, 0], data[i, 1, :, :-1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    warm_up(step, a.warmup, a.trace)
    dt, loss = timed(step, a.warmup, a.steps)
    tokens = a.steps * a.batch * a.seq
    tps = tokens / dt
    # Per target token, source as long as target: 6 x parameters, and the
    # encoder's, the decoder's and the cross attention (12 x layers x width
    # x length each).
    flops_per_token = 6 * n_params + 36 * layers * d * a.seq
    out = {
        "impl": "pytorch-compile-layers" if a.compile_layers else impl_name(a),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
        "preset": a.preset, "parameters": n_params, "batch": a.batch, "seq_len": a.seq,
        "steps": a.steps, "warmup": a.warmup, "tokens_per_s": tps, "steps_per_s": a.steps / dt,
        "ms_per_step": 1e3 * dt / a.steps, "achieved_tflops": flops_per_token * tps / 1e12,
        **memory(),
        "final_loss": loss.item(),
    }
    finish(out, a.json)


if __name__ == "__main__":
    main()
