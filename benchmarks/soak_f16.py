"""Soak test of the non-finite guard: float16 training with injected overflows and a NaN batch.

    python3 benchmarks/soak_f16.py                 # 2,000 steps on the GPU (the BENCHMARKS.md run)
    python3 benchmarks/soak_f16.py --tiny          # 60 steps on the CPU (smoke)

The selective-copying task (examples/selective_copying.py), a Mamba-1 LM in float16 with dynamic
loss scaling, fused AdamW and the recurrent state carried between steps (the stream is not reset,
so a poisoned state would stay poisoned). Every ~`--overflow-every` steps the loss is multiplied
by 1e30, which overflows the float16 backward; at step `--nan-step` the batch carries a NaN loss
weight and out-of-range token ids (they embed as NaN on the device). Reported: skipped steps
(expected: the injected ones, plus the loss scaler's own growth overflows), the loss-scale range,
whether any weight or state ever became non-finite, and the task accuracy at the end.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmamba

HERE = os.path.dirname(os.path.abspath(__file__))


def _task():
    path = os.path.join(HERE, "..", "examples", "selective_copying.py")
    spec = importlib.util.spec_from_file_location("selective_copying", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--overflow-every", type=int, default=100)
    p.add_argument("--nan-step", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--scan-impl", default=None, help="force the scan implementation (dispatch.prefer)")
    p.add_argument("--precision", default="f16", choices=["f32", "bf16", "f16"])
    p.add_argument("--verbose", type=int, default=0, help="print the metrics of the first N steps")
    p.add_argument("--print-every", type=int, default=100, help="print the metrics every N steps (0: never)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--tiny", action="store_true", help="60 small steps (CPU smoke run)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.tiny:
        args.steps, args.overflow_every, args.nan_step = 60, 10, 30
        args.batch_size, args.length, args.d_model, args.print_every = 4, 16, 16, 0
    task = _task()
    k, n_tokens = 8, 4
    cfg = jmamba.Mamba1Config(d_model=args.d_model, n_layers=2, d_state=16)
    lm = jmamba.MambaLM(cfg, k + 2, rngs=nnx.Rngs(0))
    opt = jmamba.fused_adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 50, args.steps, args.lr / 10),
                             mask=jmamba.no_decay_mask(lm))

    def loss_fn(logits, batch):
        loss, aux = task.masked_loss(logits, batch)
        return loss * batch["loss_factor"], aux

    import contextlib
    def prefer():   # a fresh context each time (a generator-based context manager is single-use)
        return (jmamba.ops.dispatch.prefer("selective_scan", args.scan_impl) if args.scan_impl
                else contextlib.nullcontext())
    state = jmamba.TrainState.create(lm, opt, args.batch_size, precision=args.precision)
    with prefer():
        step = jmamba.make_train_step(lm, opt, loss_fn=loss_fn, precision=args.precision, clip_max_norm=1.0)
    rng = np.random.default_rng(0)
    injected, skips, resets, accs, scales = set(), 0, 0, [], []
    nonfinite_seen = False
    t0 = time.perf_counter()
    for i in range(args.steps):
        batch = task.make_batch(rng, args.batch_size, args.length, n_tokens, k)
        factor = 1.0
        if i and i % args.overflow_every == 0 and i != args.nan_step:
            factor = 1e30
            injected.add(i)
        if i == args.nan_step:
            factor = float("nan")
            batch["inputs"] = batch["inputs"].at[0, 3].set(k + 7)    # an out-of-range id, on the device
            injected.add(i)
        batch["loss_factor"] = jnp.float32(factor)
        with prefer():
            state, m = step(state, batch)
        if i < args.verbose or (args.print_every and i % args.print_every == 0):
            print(f"step {i:4d} " + " ".join(f"{k}={float(v):.4g}" for k, v in sorted(m.items())))
        skips += int(m["skipped"])
        resets += int(m["state_rows_reset"])
        scales.append(float(m.get("loss_scale", 1.0)))
        if not bool(m["skipped"]):
            accs.append(float(m["accuracy"]))
        if i % max(1, args.steps // 20) == 0 or i in injected:
            finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((state.params, state.recurrent_state)))
            nonfinite_seen |= not finite
    elapsed = time.perf_counter() - t0
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves((state.params, state.recurrent_state)))
    nonfinite_seen |= not finite
    acc = float(np.mean(accs[-50:])) if accs else float("nan")
    row = {"steps": args.steps, "injected": len(injected), "skipped": skips, "applied": int(state.step),
           "state_rows_reset": resets, "loss_scale_min": min(scales), "loss_scale_max": max(scales),
           "final_loss_scale": float(state.loss_scale.scale) if state.loss_scale is not None else None,
           "nonfinite_weights_or_state": nonfinite_seen,
           "accuracy_last_50": acc, "chance": 1.0 / k, "seconds": {"total": elapsed}}
    print(f"jmamba f16 soak | jax {jax.__version__} on {jax.devices()[0].device_kind}")
    for key, value in row.items():
        print(f"  {key:28s} {value}")
    return [row]


if __name__ == "__main__":
    main()
