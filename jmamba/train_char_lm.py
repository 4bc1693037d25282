"""The main job: train a byte-level Mamba language model on an embedded corpus, then sample from it.

    python -m jmamba.train_char_lm                     # CPU default: a few minutes on 2 cores
    python -m jmamba.train_char_lm --d-model 512 --n-layers 8 --seq-len 512 --batch-size 32 --steps 5000

The corpus defaults to Python standard-library sources read from the running interpreter (no
download); `--text FILE` trains on any file. Each batch row is a stream of consecutive windows and the
train step carries the recurrent state between them (truncated BPTT). At the end the weights are
written to `<out>/model.safetensors` and a generated sample is printed.
"""

from __future__ import annotations

import argparse
import os
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
from jmamba.io.safetensors_io import save_safetensors
from jmamba.lm import MambaLM
from jmamba.mamba1.config import Mamba1Config
from jmamba.training.train_state import TrainState
from jmamba.training.train_step import make_train_step


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--text", help="train on this text file instead of the embedded corpus")
    p.add_argument("--out", default="runs/char_lm", help="output folder for weights")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--d-state", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-tokens", type=int, default=300)
    p.add_argument("--prompt", default="def ")
    p.add_argument("--temperature", type=float, default=0.7)
    return p.parse_args(argv)


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

    cfg = Mamba1Config(d_model=args.d_model, n_layers=args.n_layers, d_state=args.d_state)
    lm = MambaLM(cfg, VOCAB_SIZE, rngs=nnx.Rngs(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(lm, nnx.Param)))
    print(f"model: Mamba-1 d_model={cfg.d_model} layers={cfg.n_layers} d_state={cfg.d_state} "
          f"params={n_params:,}")

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay))
    state = TrainState.create(lm, optimizer, args.batch_size)
    train_step = make_train_step(lm, optimizer, loss_fn=cross_entropy)
    batches = StreamBatcher(train_tokens, args.batch_size, args.seq_len)

    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(args.steps), desc="train", unit="step", dynamic_ncols=True)
    t0, first_loss, loss = None, None, float("nan")
    for i in bar:
        batch = {k: jnp.asarray(v) for k, v in batches.next().items()}
        state, metrics = train_step(state, batch)
        if i == 0:
            first_loss = float(metrics["loss"])
            t0 = time.perf_counter()  # exclude compilation from the throughput
        if i % 10 == 0 or i == args.steps - 1:
            loss = float(metrics["loss"])
            rate = tokens_per_step * i / max(time.perf_counter() - t0, 1e-9) if i else 0.0
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")
    bar.close()
    print(f"loss: first step {first_loss:.3f} -> last {loss:.3f} nats/byte "
          f"(uniform would be {np.log(VOCAB_SIZE):.3f})")

    nnx.update(lm, state.params)
    val_loss = evaluate(lm, tokens[-n_val:], args.seq_len)
    print(f"held-out loss: {val_loss:.3f} nats/byte")

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "model.safetensors")
    save_safetensors(path, state.params, lm.config)
    print(f"weights saved to {path}")

    prompt = jnp.asarray(encode(args.prompt))[None]
    out = generate(lm, prompt, args.sample_tokens, temperature=args.temperature, top_k=40,
                   rng=jax.random.PRNGKey(args.seed))
    print("---- sample ----")
    print(decode(out[0]))
    print("----------------")
    return 0


def evaluate(lm, tokens, seq_len):
    """Mean cross entropy over consecutive windows, state carried (one row)."""
    n = (len(tokens) - 1) // seq_len
    ids = jnp.asarray(tokens[: n * seq_len + 1])
    inputs = ids[:-1].reshape(1, -1)
    targets = ids[1:].reshape(1, -1)
    logits, _ = nnx.jit(lambda m, x: m(x))(lm, inputs)
    return float(optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean())


if __name__ == "__main__":
    sys.exit(main())
