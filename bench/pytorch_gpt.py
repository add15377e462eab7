#!/usr/bin/env python3
"""PyTorch reference for harness's `gpt` model: the same GPT-2 architecture,
recipe and measurement, in eager PyTorch (or torch.compile with --compile).

Architecture as crates/train/src/models/mod.rs: pre-LayerNorm blocks, learned
positions, GELU(tanh), causal scaled_dot_product_attention, tied embedding,
biases, no dropout. Recipe as suites/gpu.toml: bf16 autocast, AdamW(fused)
betas (0.9, 0.95), weight decay 0.1 on matrices, gradient clipping at 1.0.
The timed loop never synchronises inside a step (the strongest eager
baseline); tokens/s is counted after the warm-up steps.

Data: uniform random tokens (throughput only: no model learns them), or with
`--tokens FILE` random windows of an llm.c `.bin` token file, as harness's
`kind = "bin"` data reads one (the last `--val-fraction` held out): then the
losses after the same steps compare with harness's on the same file
(bench/markov_tokens.py writes a learnable one), and the run also reports
the mean training loss of the last 10 steps and the loss on `--eval-batches`
held-out batches after training.

Prints one JSON object (and writes it to --json).
"""
import argparse, math, os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from benchlib import compiled, finish, impl_name, memory, run_args, timed, warm_up, write

PRESETS = {"tiny": (2, 4, 128), "small": (4, 4, 256), "gpt2-124m": (12, 12, 768), "gpt2-350m": (24, 16, 1024), "1.3b": (24, 16, 2048)}


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.attn_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.c_attn(self.ln_1(x)).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, layers, heads, d, vocab, seq):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.h = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        for n, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * layers) if n.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif n.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def token_windows(path, n, seq, val_fraction, held_out, seed):
    """`n` random windows of `seq + 1` tokens from the training part of an
    llm.c token file (from its held-out tail with `held_out`), as an int64
    array of shape (n, seq + 1)."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    header = np.frombuffer(raw[:1024], dtype="<i4")
    if header[0] == 20240520:
        if header[1] != 1:
            raise SystemExit(f"{path}: llm.c header version {header[1]}; only 1 (u16 tokens) is read")
        toks = np.frombuffer(raw, dtype="<u2", count=int(header[2]), offset=1024)
    else:
        toks = np.frombuffer(raw, dtype="<u2")
    cut = int(len(toks) * (1.0 - val_fraction))
    lo, hi = (cut, len(toks)) if held_out else (0, cut)
    if hi - lo < seq + 1:
        raise SystemExit(f"{path}: {hi - lo} tokens in the {'held-out' if held_out else 'training'} part, fewer than one window of {seq + 1}")
    starts = np.random.default_rng(seed).integers(lo, hi - seq, size=n)
    return np.stack([toks[s:s + seq + 1] for s in starts]).astype(np.int64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="gpt2-124m", choices=PRESETS)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--powersgd-rank", type=int, default=0,
                    help="DDP with PyTorch's powerSGD_hook at this rank (0: the plain all-reduce)")
    ap.add_argument("--powersgd-start", type=int, default=2,
                    help="the hook's start_powerSGD_iter (it must be > 1 with error feedback)")
    ap.add_argument("--seed", type=int, default=0, help="the model's initialisation (torch.manual_seed)")
    ap.add_argument("--tokens", help="train on random windows of this llm.c .bin token file (default: uniform random tokens)")
    ap.add_argument("--val-fraction", type=float, default=0.05, help="the token file's held-out tail (harness's default)")
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches evaluated after training (with --tokens)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                    help="bf16 autocast (harness's precision = \"bf16\") or fp32 throughout, TF32 off (\"fp32\")")
    run_args(ap)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    # Under torchrun: DDP over NCCL, one process per GPU (as harness's ranks).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # DDP on one GPU too when a comm hook is asked for (the hook is the work).
    use_ddp = world > 1 or a.powersgd_rank > 0
    if use_ddp:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl")
    dev = "cuda"
    layers, heads, d = PRESETS[a.preset]
    model = GPT(layers, heads, d, a.vocab, a.seq).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25) if use_ddp else model
    if a.powersgd_rank > 0:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        # The hook's defaults otherwise: min_compression_rate 2, error
        # feedback and warm start on, orthogonalisation epsilon 0.
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=a.powersgd_rank,
                                   start_powerSGD_iter=a.powersgd_start)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    step_fn = compiled(ddp, a)
    n_steps = a.warmup + a.steps
    if a.tokens:
        # Every step's windows gathered before the timed loop, each rank its own.
        w = token_windows(a.tokens, n_steps * a.batch, a.seq, a.val_fraction, False, 1000 * (a.seed + 1) + rank)
        if w.max() >= a.vocab:
            raise SystemExit(f"{a.tokens} holds token {w.max()}, outside --vocab {a.vocab}")
        data = torch.from_numpy(w).view(n_steps, a.batch, a.seq + 1).to(dev)
    else:
        data = torch.randint(0, a.vocab, (n_steps, a.batch, a.seq + 1), device=dev)
    losses = []

    def step(i):
        x, y = data[i, :, :-1], data[i, :, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        return loss

    warm_up(step, a.warmup, a.trace)
    dt, loss = timed(step, a.warmup, a.steps)
    tokens = a.steps * a.batch * a.seq * world
    tps = tokens / dt
    flops_per_token = 6 * n_params + 12 * layers * d * a.seq
    out = {
        "impl": impl_name(a, (f"-ddp{world}" if use_ddp else "") + (f"-powersgd{a.powersgd_rank}" if a.powersgd_rank else "")),
        "world_size": world,
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
        "preset": a.preset, "precision": a.precision, "parameters": n_params, "batch": a.batch, "seq_len": a.seq,
        "steps": a.steps, "warmup": a.warmup, "tokens_per_s": tps, "ms_per_step": 1e3 * dt / a.steps,
        "achieved_tflops": flops_per_token * tps / 1e12,
        **memory(),
        "final_loss": loss.item(),
    }
    if a.tokens:
        out["tokens_file"] = a.tokens
        out["mean_loss_last_10"] = torch.stack(losses[-10:]).float().mean().item()
        curve = torch.stack(losses).float().tolist()
        out["loss_curve"] = [[i, v] for i, v in enumerate(curve) if i % 10 == 0 or i == len(curve) - 1]
        ev = torch.from_numpy(token_windows(a.tokens, a.eval_batches * a.batch, a.seq, a.val_fraction, True, 7)).to(dev)
        model.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            out["eval_loss"] = torch.stack([model(b[:, :-1], b[:, 1:]) for b in ev.view(a.eval_batches, a.batch, a.seq + 1)]).float().mean().item()
        model.train()
    if rank != 0:
        torch.distributed.destroy_process_group()
        return
    if use_ddp:
        # The other ranks leave the group too: no early exit here.
        write(out, a.json)
        torch.distributed.destroy_process_group()
        return
    finish(out, a.json)


if __name__ == "__main__":
    main()
