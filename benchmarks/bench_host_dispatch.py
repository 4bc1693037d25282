"""Host cost of passing a `TrainState` through a jit boundary: pytree flatten / unflatten and dispatch.

Every call of the train step flattens the incoming TrainState into its leaf arrays (jax's argument
parsing) and unflattens the returned one; for a 130m-class LM that is ~780 parameter leaves, times
three with AdamW's moments. This script times that host work on its own, for the state as
`TrainState.create` builds it (params and optimizer state as plain dicts) and for its
`nnx_view()`, the same arrays in the `nnx.State` trees the TrainState held before (one
`nnx.Variable` per parameter leaf, each a Python pytree callback both ways):

- `flatten`: `jax.tree.flatten(state)`;
- `unflatten`: `jax.tree.unflatten(treedef, leaves)`;
- `dispatch`: a cheap jitted function with the train step's input/output pytree structure
  (`state -> state.replace(step=state.step + 1)`, the state donated), timed from the call to its
  return, without waiting for the device (median over `--iters` calls, each fed the previous output);
- `dispatch + sync`: the same call followed by `jax.block_until_ready` (what a loop that syncs every
  step pays on top of the kernels).

A third row is the state of `TrainState.create(..., flat=True)`: params and AdamW's moments in one flat
buffer each (the per-layer recurrent states stay apart: 54 leaves for the 130m Mamba-1 LM, 102 for
Mamba-3), the same bytes in a few dozen buffers.

    python benchmarks/bench_host_dispatch.py [--arch mamba1|mamba3] [--d-model 768] [--n-layers 24]
                                             [--vocab 50280] [--batch 8] [--iters 300]

Medians in milliseconds. `--tiny` runs a 2-layer model with few iterations (CPU smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jmamba  # noqa: E402


def build_state(arch, d_model, n_layers, vocab, batch, flat=False):
    """(lm, TrainState) of a MambaLM with fused AdamW, bf16 precision (`flat`: TrainState.create's)."""
    if arch == "mamba1":
        cfg = jmamba.Mamba1Config(d_model=d_model, n_layers=n_layers)
    elif arch == "mamba3":
        cfg = jmamba.Mamba3Config(d_model=d_model, n_layers=n_layers)
    else:
        raise ValueError(f"arch must be 'mamba1' or 'mamba3', got {arch!r}")
    lm = jmamba.MambaLM(cfg, vocab, rngs=nnx.Rngs(0))
    state = jmamba.TrainState.create(lm, jmamba.optim.fused_adamw(1e-4, weight_decay=0.1), batch, precision="bf16",
                                     flat=flat)
    return lm, state


def _median_ms(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(state, iters):
    """{flatten, unflatten, dispatch, dispatch + sync}: median seconds per call for `state`."""
    leaves, treedef = jax.tree.flatten(state)
    out = {"flatten": _median_ms(lambda: jax.tree.flatten(state), iters),
           "unflatten": _median_ms(lambda: jax.tree.unflatten(treedef, leaves), iters)}

    echo = jax.jit(lambda s: s.replace(step=s.step + 1), donate_argnums=0)
    # the state is donated: run on a copy, and feed each call the previous call's output
    cur = [jax.tree.map(lambda x: x.copy(), state)]

    def call():
        cur[0] = echo(cur[0])

    def call_sync():
        cur[0] = jax.block_until_ready(echo(cur[0]))

    call_sync()
    out["dispatch"] = _median_ms(call, iters)
    jax.block_until_ready(cur[0])
    out["dispatch + sync"] = _median_ms(call_sync, iters)
    jax.block_until_ready(cur[0])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="mamba1", choices=("mamba1", "mamba3"))
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50280)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--tiny", action="store_true", help="2 layers, d_model 32, vocab 64, 5 iterations (CPU smoke run)")
    a = p.parse_args(argv)
    if a.tiny:
        a.d_model, a.n_layers, a.vocab, a.iters = 32, 2, 64, 5
    _, state = build_state(a.arch, a.d_model, a.n_layers, a.vocab, a.batch)
    n = len(jax.tree.leaves(state))
    print(f"# TrainState host cost, {a.arch} d_model={a.d_model} n_layers={a.n_layers} vocab={a.vocab} "
          f"batch={a.batch}, {n} leaves, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| state | flatten ms | unflatten ms | dispatch ms | dispatch + sync ms |")
    print("|---|---|---|---|---|")
    rows = []
    variants = [("TrainState.create", state)]
    if getattr(state, "nnx_layout", None) is not None:   # the nnx.State layout the state had before
        variants.append(("nnx trees (nnx_view)", state.nnx_view()))
    _, flat = build_state(a.arch, a.d_model, a.n_layers, a.vocab, a.batch, flat=True)
    variants.append((f"flat=True ({len(jax.tree.leaves(flat))} leaves)", flat))
    for name, st in variants:
        s = measure(st, a.iters)
        print(f"| {name} | {s['flatten'] * 1e3:.3f} | {s['unflatten'] * 1e3:.3f} | {s['dispatch'] * 1e3:.3f} | "
              f"{s['dispatch + sync'] * 1e3:.3f} |", flush=True)
        rows.append(dict(state=name, leaves=len(jax.tree.leaves(st)), seconds=s))
    return rows


if __name__ == "__main__":
    main()
