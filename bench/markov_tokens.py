#!/usr/bin/env python3
"""Writes a learnable token file that harness and the PyTorch references can
both train on, so that their losses after the same steps compare.

The tokens follow a seeded first-order Markov chain of the same law as
harness's `synthetic` data (each token has `branching` successors drawn
uniformly from the vocabulary, with Dirichlet(1) weights), sampled as many
independent chains laid end to end. The file is in llm.c's `.bin` format
(a 256 x int32 header: magic 20240520, version 1, the token count; then u16
tokens), which harness reads as `data = { kind = "bin", train = ... }` and
bench/pytorch_gpt.py as `--tokens FILE`.

Prints one JSON line: the file, its token count and the chain's entropy
rate measured on the file (nats per token: the loss a perfect model reaches;
the file's few chain boundaries excepted).
"""
import argparse
import json

import numpy as np

MAGIC = 20240520


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--branching", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=40_000_000)
    ap.add_argument("--chains", type=int, default=4000, help="independent chains sampled side by side")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if not 2 <= a.vocab <= 65536:
        ap.error("--vocab must be in 2..65536 (u16 tokens)")
    if not 1 <= a.branching <= a.vocab:
        ap.error("--branching must be in 1..vocab")
    if a.tokens < 2 or a.chains < 1:
        ap.error("--tokens must be at least 2 and --chains at least 1")
    # Each chain at least two tokens long (one transition to measure).
    a.chains = min(a.chains, a.tokens // 2)
    rng = np.random.default_rng(a.seed)
    succ = rng.integers(0, a.vocab, size=(a.vocab, a.branching), dtype=np.int64)
    prob = rng.dirichlet(np.ones(a.branching), size=a.vocab)
    cum = np.cumsum(prob, axis=1)
    cum[:, -1] = 1.0
    steps = -(-a.tokens // a.chains)
    out = np.empty((a.chains, steps), dtype=np.uint16)
    logp = np.empty((a.chains, steps - 1))
    state = rng.integers(0, a.vocab, size=a.chains)
    out[:, 0] = state
    rows = np.arange(a.chains)
    for t in range(1, steps):
        u = rng.random(a.chains)
        j = np.minimum((u[:, None] > cum[state]).sum(axis=1), a.branching - 1)
        logp[:, t - 1] = np.log(prob[state, j])
        state = succ[state, j]
        out[rows, t] = state
    tokens = out.reshape(-1)[: a.tokens]
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [MAGIC, 1, len(tokens)]
    with open(a.out, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    print(json.dumps({"file": a.out, "tokens": int(len(tokens)), "vocab": a.vocab, "branching": a.branching,
                      "seed": a.seed, "entropy_rate_nats": float(-logp.mean())}))


if __name__ == "__main__":
    main()
