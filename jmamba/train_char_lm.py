"""The main job: train a byte-level Mamba language model on an embedded corpus, then sample from it.

    python -m jmamba.train_char_lm                     # CPU default: a few minutes on 2 cores
    python -m jmamba.train_char_lm --arch mamba3       # the Mamba-3 SISO backbone instead
    python -m jmamba.train_char_lm --d-model 512 --n-layers 8 --seq-len 512 --batch-size 32 \
        --steps 5000 --precision bf16                  # a GPU-sized run

The corpus defaults to Python standard-library sources read from the running interpreter (no
download); `--text FILE` trains on any file. Each batch row is a stream of consecutive windows and the
train step carries the recurrent state between them (truncated BPTT).

Outputs in `--out` (default runs/char_lm): `checkpoints/` (every `--ckpt-every` steps and at the end;
running the command again resumes from the newest one: parameters, optimizer, recurrent state, data
position, RNG and loss history), `model.safetensors` (final weights), `loss.png` (the loss curve) and
a generated sample printed at the end. `--fresh` ignores existing checkpoints.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from jmamba.data.corpus import VOCAB_SIZE, decode, default_corpus_bytes, encode, load_text_bytes
from jmamba.data.streams import StreamBatcher
from jmamba.generate import generate
from jmamba.io.checkpoint import (CheckpointMismatchError, checkpoint_info, latest_step, restore_checkpoint,
                                  save_checkpoint)
from jmamba.io.safetensors_io import save_safetensors
from jmamba.lm import MambaLM
from jmamba.mamba1.config import Mamba1Config
from jmamba.training.train_state import TrainState
from jmamba.training.train_step import make_train_step


def _number(kind, lo, *, strict):
    """An argparse type: a finite `kind` >= lo (> lo when strict); the message names the bound."""
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if not math.isfinite(v) or (v <= lo if strict else v < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo}, got {text}")
        return v
    parse.__name__ = kind.__name__
    return parse


POSITIVE_INT, NONNEG_INT = _number(int, 0, strict=True), _number(int, 0, strict=False)
POSITIVE, NONNEG = _number(float, 0.0, strict=True), _number(float, 0.0, strict=False)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", choices=["mamba1", "mamba3"], default="mamba1")
    p.add_argument("--text", help="train on this text file instead of the embedded corpus")
    p.add_argument("--out", default="runs/char_lm", help="output folder (checkpoints, weights, plot)")
    p.add_argument("--fresh", action="store_true", help="start over even if checkpoints exist")
    p.add_argument("--steps", type=POSITIVE_INT, default=400, help="total optimizer steps (a resumed run continues)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=16)
    p.add_argument("--seq-len", type=POSITIVE_INT, default=128)
    p.add_argument("--d-model", type=POSITIVE_INT, default=128)
    p.add_argument("--n-layers", type=POSITIVE_INT, default=2)
    p.add_argument("--d-state", type=POSITIVE_INT, default=None, help="default: 16 (mamba1) / 32 (mamba3)")
    p.add_argument("--headdim", type=POSITIVE_INT, default=32, help="mamba3 head size")
    p.add_argument("--precision", choices=["f32", "bf16", "f16"], default="f32")
    p.add_argument("--lr", type=POSITIVE, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=NONNEG_INT, default=30, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=NONNEG, default=0.1)
    p.add_argument("--clip", type=POSITIVE, default=1.0, help="global-norm clipping threshold")
    p.add_argument("--ckpt-every", type=NONNEG_INT, default=100, help="checkpoint period in steps (0: only at the end)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-tokens", type=NONNEG_INT, default=300, help="bytes to generate after training")
    p.add_argument("--prompt", default="def ", help="prompt of the generated sample")
    p.add_argument("--temperature", type=NONNEG, default=0.7, help="sampling temperature (0: greedy)")
    return p


def parse_args(argv=None):
    """Parses and checks every flag before any work: argparse errors (exit 2) name the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.text is not None and not os.path.isfile(args.text):
        parser.error(f"argument --text: no such file {args.text!r}")
    try:
        build_config(args).validate()
    except ValueError as e:
        parser.error(f"the model flags do not make a valid {args.arch} config: {e}")
    if not args.prompt:
        parser.error("argument --prompt: must not be empty")
    return args


def build_config(args):
    if args.arch == "mamba1":
        return Mamba1Config(d_model=args.d_model, n_layers=args.n_layers, d_state=args.d_state or 16)
    from jmamba.mamba3.config import Mamba3Config
    return Mamba3Config(d_model=args.d_model, n_layers=args.n_layers, d_state=args.d_state or 32,
                        headdim=args.headdim)


def cross_entropy(logits, batch):
    """Mean next-byte cross entropy (nats)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def main(argv=None) -> int:
    args = parse_args(argv)
    data = load_text_bytes(args.text) if args.text else default_corpus_bytes()
    tokens = encode(data)
    n_val = max(args.seq_len + 2, len(tokens) // 20)
    train_tokens = tokens[:-n_val]
    print(f"jmamba char LM | jax {jax.__version__} on {jax.default_backend()} | corpus {len(tokens):,} bytes")

    cfg = build_config(args)
    lm = MambaLM(cfg, VOCAB_SIZE, rngs=nnx.Rngs(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(lm, nnx.Param)))
    print(f"model: {args.arch} d_model={cfg.d_model} layers={cfg.n_layers} d_state={cfg.d_state} "
          f"params={n_params:,} precision={args.precision}")

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.1)
    optimizer = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay)
    state = TrainState.create(lm, optimizer, args.batch_size, precision=args.precision)
    batches = StreamBatcher(train_tokens, args.batch_size, args.seq_len)
    losses: list[float] = []
    ckpt_dir = os.path.join(args.out, "checkpoints")
    if args.fresh and os.path.isdir(ckpt_dir):
        shutil.rmtree(ckpt_dir)
    if latest_step(ckpt_dir) is not None:
        try:
            state = restore_checkpoint(ckpt_dir, state, config=lm.config)
        except CheckpointMismatchError as e:
            print(f"error: {ckpt_dir} holds checkpoints of a different run ({e}); pass --fresh to start over "
                  f"or choose another --out", file=sys.stderr)
            return 2
        extras = checkpoint_info(ckpt_dir)["extras"]
        batches.position = np.asarray(extras["data_position"], np.int64)
        batches.fresh[:] = False
        losses = [float(x) for x in extras["losses"]]
        print(f"resumed from {ckpt_dir} at step {int(state.step)}")

    train_step = make_train_step(lm, optimizer, loss_fn=cross_entropy, precision=args.precision,
                                 clip_max_norm=args.clip)

    def checkpoint():
        save_checkpoint(ckpt_dir, state, config=lm.config,
                        extras={"data_position": batches.position, "losses": losses, "seed": args.seed})

    start = int(state.step)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(start, args.steps), desc="train", unit="step", dynamic_ncols=True,
               initial=start, total=args.steps)
    t0, timed = None, 0
    for i in bar:
        batch = {k: jnp.asarray(v) for k, v in batches.next().items()}
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
        if t0 is None:
            t0 = time.perf_counter()   # compilation stays out of the throughput
        else:
            timed += 1
        if i % 10 == 0 or i == args.steps - 1:
            rate = tokens_per_step * timed / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(loss=f"{np.mean(losses[-10:]):.3f}", tok_s=f"{rate:,.0f}")
        if args.ckpt_every and (i + 1) % args.ckpt_every == 0 and i + 1 < args.steps:
            checkpoint()
    bar.close()
    if latest_step(ckpt_dir) != int(state.step):
        checkpoint()
    if losses:
        print(f"loss: first step {losses[0]:.3f} -> last {np.mean(losses[-10:]):.3f} nats/byte "
              f"(uniform would be {np.log(VOCAB_SIZE):.3f})")

    nnx.update(lm, state.params)
    print(f"held-out loss: {evaluate(lm, tokens[-n_val:], args.seq_len):.3f} nats/byte")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "model.safetensors")
    save_safetensors(path, state.params, lm.config)
    print(f"weights saved to {path}")
    plot_losses(losses, os.path.join(args.out, "loss.png"))

    prompt = jnp.asarray(encode(args.prompt))[None]
    out = generate(lm, prompt, args.sample_tokens, temperature=args.temperature, top_k=40,
                   rng=jax.random.PRNGKey(args.seed))
    print("---- sample ----")
    print(decode(out[0]))
    print("----------------")
    return 0


def evaluate(lm, tokens, seq_len):
    """Mean cross entropy of the held-out bytes, one row, state carried through."""
    n = (len(tokens) - 1) // seq_len
    ids = jnp.asarray(tokens[: n * seq_len + 1])
    logits, _ = nnx.jit(lambda m, x: m(x))(lm, ids[:-1].reshape(1, -1))
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, ids[1:].reshape(1, -1)).mean())


def plot_losses(losses, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss plot (pip install 'jmamba[plot]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="per step")
    if len(losses) >= 20:
        k = 20
        ax.plot(steps[k - 1:], np.convolve(losses, np.ones(k) / k, mode="valid"), lw=1.5, label=f"mean of {k}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross entropy (nats/byte)")
    ax.set_title("jmamba byte-level LM")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curve saved to {path}")


if __name__ == "__main__":
    sys.exit(main())
