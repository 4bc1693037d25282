"""The main job: train a Mamba language model (bytes or a tokenizer.json) on a corpus, then sample from it.

    python -m jmamba.train_char_lm                     # CPU default: about 2 minutes on 2 cores
    python -m jmamba.train_char_lm --arch mamba3       # the Mamba-3 SISO backbone instead
    python -m jmamba.train_char_lm --tokenizer tokenizer.json --text corpus.txt   # HF tokenizer (jmamba[hf])
    python -m jmamba.train_char_lm --d-model 512 --n-layers 8 --seq-len 512 --batch-size 32 \
        --steps 5000 --precision bf16 --eval-every 250 --tensorboard   # a GPU-sized run

The corpus defaults to Python standard-library sources read from the running interpreter (no
download); `--text FILE` trains on any file. Text is tokenized as bytes (vocabulary 256), or with a
Hugging Face `tokenizer.json` (`--tokenizer`, vocabulary from the tokenizer). The last 5% of the tokens
are held out. Each batch row is a stream of consecutive windows and the train step carries the
recurrent state between them (truncated BPTT).

Outputs in `--out` (default runs/char_lm): `checkpoints/` (every `--ckpt-every` steps and at the end;
running the command again resumes from the newest one: parameters, optimizer, recurrent state, data
position, RNG, loss and held-out history), `metrics.jsonl` (one JSON row per logged train step and per
held-out evaluation, docs/training_loop.md), `tensorboard/` (with `--tensorboard`), `config.json` +
`model.safetensors` (the trained model: `MambaLM.from_pretrained(out)`), `tokenizer.json` (a copy, with
`--tokenizer`), `loss.png` (train and held-out loss) and a generated sample printed at the end.
`--fresh` ignores existing checkpoints; a resume with another model config or tokenizer is refused
with one line that says to pass --fresh or another --out.
"""

from __future__ import annotations

import argparse
import gc
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

from jmamba.data.corpus import default_corpus_bytes, load_text_bytes
from jmamba.data.streams import StreamBatcher
from jmamba.data.tokenizer import load_tokenizer
from jmamba.generate import generate
from jmamba.io.checkpoint import (CheckpointMismatchError, checkpoint_info, latest_step, restore_checkpoint,
                                  save_checkpoint)
from jmamba.lm import MambaLM
from jmamba.mamba1.config import Mamba1Config
from jmamba.training.losses import next_token_loss, per_token_loss
from jmamba.training.metrics_log import TENSORBOARD_DIR, MetricsLogger, learning_rate, tensorboard_available
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
    p.add_argument("--arch", choices=["mamba1", "mamba3"], default="mamba1", help="backbone architecture")
    p.add_argument("--text", help="train on this text file (default: %(default)s, the embedded Python "
                                  "standard-library sources)")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizer.json, needs jmamba[hf] (default: %(default)s, "
                                       "bytes with vocabulary 256)")
    p.add_argument("--out", default="runs/char_lm",
                   help="output folder (checkpoints, metrics.jsonl, config.json + model.safetensors, loss.png)")
    p.add_argument("--fresh", action="store_true", help="start over even if checkpoints exist")
    p.add_argument("--steps", type=POSITIVE_INT, default=400, help="total optimizer steps (a resumed run continues)")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=16, help="rows (parallel streams) per batch")
    p.add_argument("--seq-len", type=POSITIVE_INT, default=128, help="tokens per row and step")
    p.add_argument("--d-model", type=POSITIVE_INT, default=128, help="model width")
    p.add_argument("--n-layers", type=POSITIVE_INT, default=2, help="number of residual Mamba blocks")
    p.add_argument("--d-state", type=POSITIVE_INT, default=None, help="SSM state size (default: %(default)s, 16 for mamba1 and 32 for mamba3)")
    p.add_argument("--headdim", type=POSITIVE_INT, default=32, help="mamba3 head size")
    p.add_argument("--precision", choices=["f32", "bf16", "f16"], default="f32", help="compute precision")
    p.add_argument("--lr", type=POSITIVE, default=3e-3, help="peak learning rate (warm-up, then cosine to lr/10)")
    p.add_argument("--warmup", type=NONNEG_INT, default=30, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=NONNEG, default=0.1, help="AdamW weight decay")
    p.add_argument("--clip", type=POSITIVE, default=1.0, help="global-norm clipping threshold")
    p.add_argument("--ckpt-every", type=NONNEG_INT, default=100, help="checkpoint period in steps (0: only at the end)")
    p.add_argument("--eval-every", type=NONNEG_INT, default=100,
                   help="held-out loss period in steps (0: only at the end, where it always runs)")
    p.add_argument("--log-every", type=POSITIVE_INT, default=1, help="metrics.jsonl row period in steps")
    p.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard scalars to OUT/tensorboard (needs jmamba[tensorboard])")
    p.add_argument("--seed", type=int, default=0, help="parameter init and sampling seed")
    p.add_argument("--sample-tokens", type=NONNEG_INT, default=300, help="tokens to generate after training")
    p.add_argument("--prompt", default="def ", help="prompt of the generated sample (default: %(default)r)")
    p.add_argument("--temperature", type=NONNEG, default=0.7, help="sampling temperature (0: greedy)")
    return p


def parse_args(argv=None):
    """Parses and checks every flag before any work: argparse errors (exit 2) name the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("text", "tokenizer"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            parser.error(f"argument --{flag}: no such file {path!r}")
    try:
        build_config(args).validate()
    except ValueError as e:
        parser.error(f"the model flags do not make a valid {args.arch} config: {e}")
    if not args.prompt:
        parser.error("argument --prompt: must not be empty")
    try:
        tok = load_tokenizer(args.tokenizer)
    except (ImportError, ValueError) as e:
        parser.error(f"argument --tokenizer: {e}")
    if len(tok.encode(args.prompt)) == 0:
        parser.error(f"argument --prompt: {args.prompt!r} encodes to no tokens")
    if args.tensorboard and not tensorboard_available():
        parser.error("argument --tensorboard: needs the tensorboardX package: pip install 'jmamba[tensorboard]'")
    return args


def build_config(args):
    if args.arch == "mamba1":
        return Mamba1Config(d_model=args.d_model, n_layers=args.n_layers, d_state=args.d_state or 16)
    from jmamba.mamba3.config import Mamba3Config
    return Mamba3Config(d_model=args.d_model, n_layers=args.n_layers, d_state=args.d_state or 32,
                        headdim=args.headdim)


def cross_entropy(logits, batch):
    """Mean next-token cross entropy (nats); `jmamba.training.losses.next_token_loss`."""
    return next_token_loss(logits, batch)


def _refuse(ckpt_dir, why):
    print(f"error: {ckpt_dir} holds checkpoints of a different run ({why}); pass --fresh to start over "
          f"or choose another --out", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    data = load_text_bytes(args.text) if args.text else default_corpus_bytes()
    tokens = tok.encode(data)
    unit = tok.unit
    n_val = max(args.seq_len + 2, len(tokens) // 20)
    if len(tokens) < n_val + args.seq_len + 2:
        print(f"error: the text has {len(tokens):,} {unit}s; --seq-len {args.seq_len} needs at least "
              f"{n_val + args.seq_len + 2:,} (a training and a held-out split)", file=sys.stderr)
        return 2
    if tokens.size and int(tokens.max()) >= tok.vocab_size:
        print(f"error: the tokenizer produced id {int(tokens.max())} outside its vocabulary ({tok.vocab_size})",
              file=sys.stderr)
        return 2
    train_tokens, val_tokens = tokens[:-n_val], tokens[-n_val:]
    print(f"jmamba LM | jax {jax.__version__} on {jax.default_backend()} | corpus {len(data):,} bytes = "
          f"{len(tokens):,} {unit}s ({tok.name}), {n_val:,} held out")

    cfg = build_config(args)
    lm = MambaLM(cfg, tok.vocab_size, rngs=nnx.Rngs(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(lm, nnx.Param)))
    print(f"model: {args.arch} d_model={cfg.d_model} layers={cfg.n_layers} d_state={cfg.d_state} "
          f"vocab={tok.vocab_size} params={n_params:,} precision={args.precision}")

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.1)
    optimizer = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay)
    state = TrainState.create(lm, optimizer, args.batch_size, precision=args.precision)
    batches = StreamBatcher(train_tokens, args.batch_size, args.seq_len)
    losses: list[float] = []
    evals: list[list] = []   # [step, held-out loss]
    ckpt_dir = os.path.join(args.out, "checkpoints")
    if args.fresh:
        for folder in (ckpt_dir, os.path.join(args.out, TENSORBOARD_DIR)):
            if os.path.isdir(folder):
                shutil.rmtree(folder)
    if latest_step(ckpt_dir) is not None:
        extras = checkpoint_info(ckpt_dir)["extras"]
        saved_tok = extras.get("tokenizer", {"kind": "bytes", "vocab_size": 256})
        if saved_tok != tok.fingerprint():
            return _refuse(ckpt_dir, f"tokenizer {saved_tok} vs given {tok.fingerprint()}")
        try:
            state = restore_checkpoint(ckpt_dir, state, config=lm.config)
        except CheckpointMismatchError as e:
            return _refuse(ckpt_dir, e)
        batches.position = np.asarray(extras["data_position"], np.int64)
        batches.fresh[:] = False
        losses = [float(x) for x in extras["losses"]]
        evals = [[int(s), float(v)] for s, v in extras.get("evals", [])]
        calls = int(extras.get("calls", int(state.step)))   # train-step calls (skipped steps included)
        print(f"resumed from {ckpt_dir} at step {int(state.step)} (call {calls})")
    else:
        calls = 0

    train_step = make_train_step(lm, optimizer, loss_fn=cross_entropy, precision=args.precision,
                                 clip_max_norm=args.clip)
    evaluate = make_evaluator(lm, val_tokens, args.batch_size * args.seq_len)

    def checkpoint(calls_done):
        # A step the guard skipped does not advance state.step, the checkpoint's number: the newest
        # checkpoint then already holds these parameters, and the resume replays from its data position.
        if latest_step(ckpt_dir) == int(state.step):
            return
        save_checkpoint(ckpt_dir, state, config=lm.config,
                        extras={"data_position": batches.position, "losses": losses, "evals": evals,
                                "seed": args.seed, "tokenizer": tok.fingerprint(), "calls": calls_done})

    def held_out(step_no):
        loss = evaluate(state.params)
        if evals and evals[-1][0] == step_no:
            evals.pop()
        evals.append([step_no, loss])
        log.log(step_no, {"loss": loss}, split="eval")
        return loss

    start = calls
    log = MetricsLogger(args.out, tensorboard=args.tensorboard, resume_step=start)
    tokens_per_step = args.batch_size * args.seq_len
    bar = tqdm(range(start, args.steps), desc="train", unit="step", dynamic_ncols=True,
               initial=start, total=args.steps)
    timed_tokens = timed_s = 0.0            # throughput of train steps only: no compilation, eval, checkpoint
    window_tokens = window_s = 0.0          # the same since the last metrics row
    for i in bar:
        t_start = time.perf_counter()
        batch = {k: jnp.asarray(v) for k, v in batches.next().items()}
        state, metrics = train_step(state, batch)
        metrics = jax.device_get(metrics)
        losses.append(float(metrics["loss"]))
        if i == start:
            # Compilation leaves ~10^5 long-lived Python objects; every step allocates new objects for the
            # returned state and metrics, so full collections keep rescanning them (0.1-0.2 s pauses every
            # ~50 steps at 24 layers, measured when the state still held nnx Variables). Freezing what exists now takes them out of every later collection
            # (docs/training_loop.md, "Host pauses").
            gc.collect()
            gc.freeze()
        if i > start:   # the first step of a process compiles
            dt = time.perf_counter() - t_start
            timed_tokens, timed_s = timed_tokens + tokens_per_step, timed_s + dt
            window_tokens, window_s = window_tokens + tokens_per_step, window_s + dt
        step_no = i + 1
        if step_no % args.log_every == 0 or step_no == args.steps:
            row = dict(metrics, lr=learning_rate(schedule, metrics["updates"]))
            if window_s > 0:
                row["tokens_per_s"] = window_tokens / window_s
            log.log(step_no, row)
            window_tokens = window_s = 0.0
        if i % 10 == 0 or step_no == args.steps:
            bar.set_postfix(loss=f"{np.nanmean(losses[-10:]):.3f}", tok_s=f"{timed_tokens / max(timed_s, 1e-9):,.0f}")
        if args.eval_every and step_no % args.eval_every == 0 and step_no < args.steps:
            bar.write(f"step {step_no}: held-out loss {held_out(step_no):.3f} nats/{unit}")
        if args.ckpt_every and step_no % args.ckpt_every == 0 and step_no < args.steps:
            checkpoint(step_no)
    bar.close()
    final_step = max(args.steps, start)
    final_eval = held_out(final_step)
    checkpoint(max(args.steps, start))   # the final evaluation goes into it too
    log.close()
    if losses:
        print(f"loss: first step {losses[0]:.3f} -> last {np.nanmean(losses[-10:]):.3f} nats/{unit} "
              f"(uniform would be {np.log(tok.vocab_size):.3f})")
    print(f"held-out loss: {final_eval:.3f} nats/{unit}")
    print(f"metrics: {log.path}" + (f", TensorBoard: {log.tensorboard_dir}" if args.tensorboard else ""))

    model = state.to_model(lm)
    path = model.save_pretrained(args.out)
    if args.tokenizer is not None:
        dst = os.path.join(args.out, "tokenizer.json")
        if not os.path.exists(dst) or not os.path.samefile(args.tokenizer, dst):
            shutil.copyfile(args.tokenizer, dst)
    print(f"model saved to {path} (config.json + model.safetensors"
          f"{' + tokenizer.json' if args.tokenizer else ''}; load with jmamba.MambaLM.from_pretrained)")
    plot_losses(losses, evals, os.path.join(args.out, "loss.png"), unit)

    prompt = jnp.asarray(tok.encode(args.prompt))[None]
    out = generate(model, prompt, args.sample_tokens, temperature=args.temperature, top_k=min(40, tok.vocab_size),
                   rng=jax.random.PRNGKey(args.seed))
    print("---- sample ----")
    print(tok.decode(out[0]))
    print("----------------")
    return 0


def make_evaluator(lm, tokens, chunk):
    """`evaluate(params) -> float`: mean next-token cross entropy (nats) of `tokens`, float32, as one row
    with the state carried through (run in windows of `chunk` tokens: memory stays bounded)."""
    graphdef = nnx.graphdef(lm)
    ids = np.asarray(tokens, np.int32)
    n = len(ids) - 1

    @jax.jit
    def window(params, state, x, y):
        logits, state = nnx.merge(graphdef, params)(x, state)
        return jnp.sum(per_token_loss(logits, y)), state

    def evaluate(params):
        state, total = lm.init_state(1), 0.0
        for a in range(0, n, chunk):
            z = min(a + chunk, n)
            s, state = window(params, state, ids[None, a:z], ids[None, a + 1:z + 1])
            total += float(s)
        return total / n

    return evaluate


def plot_losses(losses, evals, path, unit="byte"):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss plot (pip install 'jmamba[plot]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="train, per step")
    if len(losses) >= 20:
        k = 20
        ax.plot(steps[k - 1:], np.convolve(losses, np.ones(k) / k, mode="valid"), lw=1.5,
                label=f"train, mean of {k}")
    if evals:
        es, ev = zip(*evals)
        ax.plot(es, ev, "o-", lw=1.2, ms=4, color="C3", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel(f"cross entropy (nats/{unit})")
    ax.set_title(f"jmamba {unit}-level LM" if unit == "byte" else "jmamba LM")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"loss curve saved to {path}")


if __name__ == "__main__":
    sys.exit(main())
