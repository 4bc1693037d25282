"""Selective copying (Mamba paper, §4.1.1): remember the data tokens scattered among noise, in order.

Each sequence has `--length` positions of which `--tokens` hold data tokens (values 1..K) at random
places and the rest hold the blank token 0; then `--tokens` marker tokens (K + 1) ask for the data
tokens in their original order. The loss and the accuracy count only the answer positions; chance is
1/K. Content-aware selection (the input-dependent Δ, B, C of the selective scan) is what solves it.

    python examples/selective_copying.py            # ~2 minutes on 2 CPU cores
    python examples/selective_copying.py --arch mamba3 --steps 1500 --length 256
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmamba


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["mamba1", "mamba3"], default="mamba1")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--length", type=int, default=32, help="positions holding data or blanks")
    p.add_argument("--tokens", type=int, default=4, help="data tokens to copy")
    p.add_argument("--vocab", type=int, default=8, help="K distinct data tokens")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_batch(rng, bsz, length, n_tokens, k):
    """inputs [B, length + n], targets [B, length + n], answer mask [B, length + n]."""
    data = rng.integers(1, k + 1, size=(bsz, n_tokens))
    pos = np.sort(np.stack([rng.choice(length, n_tokens, replace=False) for _ in range(bsz)]), axis=1)
    seq = np.zeros((bsz, length + n_tokens), np.int32)
    np.put_along_axis(seq, pos, data, axis=1)
    seq[:, length:] = k + 1                                        # the markers
    targets = np.zeros_like(seq)
    # next-token form: the input at position length-1+i is answered by data[i]
    targets[:, length - 1:length - 1 + n_tokens] = data
    mask = np.zeros(seq.shape, bool)
    mask[:, length - 1:length - 1 + n_tokens] = True
    return {"inputs": jnp.asarray(seq), "targets": jnp.asarray(targets), "mask": jnp.asarray(mask)}


def masked_loss(logits, batch):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    m = batch["mask"].astype(jnp.float32)
    acc = jnp.sum((jnp.argmax(logits, -1) == batch["targets"]) * m) / jnp.sum(m)
    return jnp.sum(ce * m) / jnp.sum(m), {"accuracy": acc}


def main(argv=None):
    args = parse_args(argv)
    if args.arch == "mamba1":
        cfg = jmamba.Mamba1Config(d_model=64, n_layers=2, d_state=16)
    else:
        cfg = jmamba.Mamba3Config(d_model=64, n_layers=2, d_state=32, headdim=32)
    lm = jmamba.MambaLM(cfg, args.vocab + 2, rngs=nnx.Rngs(args.seed))
    opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 50, args.steps, args.lr * 0.1))
    state = jmamba.TrainState.create(lm, opt, args.batch_size)
    step = jmamba.make_train_step(lm, opt, loss_fn=masked_loss, clip_max_norm=1.0)
    rng = np.random.default_rng(args.seed)
    accs = []
    # The Mamba-3 scan's chunk length is a tuning knob of the op, read when the step is traced (on its
    # first call, inside the block); it does not touch Mamba-1.
    with jmamba.ops.tuning("mamba3_siso_scan", chunk_size=16):
        for i in range(args.steps):
            state = state.reset_recurrent_state()            # independent sequences
            state, m = step(state, make_batch(rng, args.batch_size, args.length, args.tokens, args.vocab))
            accs.append(float(m["accuracy"]))
            if i % 100 == 0 or i == args.steps - 1:
                print(f"step {i:5d}  loss {float(m['loss']):.3f}  accuracy (last 50) {np.mean(accs[-50:]):.3f}")
    final = float(np.mean(accs[-50:]))
    print(f"final accuracy {final:.3f} (chance {1 / args.vocab:.3f})")
    return final


if __name__ == "__main__":
    main()
