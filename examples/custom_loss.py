"""Bring your own loss: train a Mamba-1 backbone through the split API with a loss computed outside.

The task: each step sees a window of a noisy multi-channel signal and must predict, at every time
step, the value channel 0 had `--delay` steps earlier (a memory task). The readout head and the loss
live in this script, not in jmamba: the script computes d_out = dLoss/d(backbone outputs) itself,
updates its own head with its own optimizer, and hands d_out to `jmamba.backward_step`.
Each batch row is a continuing stream, so the recurrent state carried between windows matters.

    python examples/custom_loss.py                 # ~1 minute on 2 CPU cores
    python examples/custom_loss.py --steps 500 --precision bf16
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmamba


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--delay", type=int, default=4, help="the first `delay` positions of a window need the carried state")
    p.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class SignalStreams:
    """B endless streams of 4-channel noise; the target is channel 0 delayed by `delay` steps."""

    def __init__(self, batch, delay, seed):
        self.rng = np.random.default_rng(seed)
        self.history = self.rng.normal(size=(batch, delay, 4)).astype(np.float32)
        self.delay = delay

    def next(self, seq_len):
        x = self.rng.normal(size=(self.history.shape[0], seq_len, 4)).astype(np.float32)
        full = np.concatenate([self.history, x], axis=1)
        target = full[:, : seq_len, 0]                 # value `delay` steps before each position
        self.history = full[:, -self.delay:]
        return jnp.asarray(x), jnp.asarray(target)


def main(argv=None):
    args = parse_args(argv)
    cfg = jmamba.Mamba1Config(d_model=32, n_layers=2, d_state=16, input_dim=4)
    model = jmamba.Mamba1Backbone(cfg, rngs=nnx.Rngs(args.seed))
    opt = optax.adamw(1e-2)
    state = jmamba.TrainState.create(model, opt, args.batch_size, precision=args.precision)

    # The user's own head and optimizer: y [B, T, d_model] -> prediction [B, T].
    head = {"w": 0.1 * jax.random.normal(jax.random.PRNGKey(args.seed), (cfg.d_model,)), "b": jnp.zeros(())}
    head_opt = optax.adam(1e-2)
    head_state = head_opt.init(head)

    def loss_fn(head, y, target):
        return jnp.mean((y @ head["w"] + head["b"] - target) ** 2)

    @jax.jit
    def user_side(head, head_state, y, target):
        loss, (g_head, d_out) = jax.value_and_grad(loss_fn, argnums=(0, 1))(head, y, target)
        updates, head_state = head_opt.update(g_head, head_state, head)
        return optax.apply_updates(head, updates), head_state, loss, d_out

    streams = SignalStreams(args.batch_size, args.delay, args.seed)
    losses = []
    for i in range(args.steps):
        x, target = streams.next(args.seq_len)
        y, ctx, state = jmamba.forward(model, state, {"inputs": x}, precision=args.precision)
        head, head_state, loss, d_out = user_side(head, head_state, y, target)
        state, metrics = jmamba.backward_step(opt, state, ctx, d_out, clip_max_norm=1.0)
        losses.append(float(loss))
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {np.mean(losses[-50:]):.4f}  grad_norm {float(metrics['grad_norm']):.3f}")
    print(f"first 20 steps {np.mean(losses[:20]):.4f} -> last 20 steps {np.mean(losses[-20:]):.4f} "
          f"(predicting the mean gives 1.0)")
    return losses


if __name__ == "__main__":
    main()
