"""Writes tests/goldens/train_state/: what four short training runs on tiny models produce, and one
training checkpoint, through the public API only (so the same script runs on any jmamba version).

    python tests/goldens/make_train_state_goldens.py [OUT_DIR]

It was run on the commit before the TrainState kept its parameters and optimizer state as plain
dicts (the `nnx.State` layout), so `tests/test_train_state_pure.py` can check that the new layout
gives bit-identical steps and that a checkpoint written by the old code restores. XLA flags as in
tests/conftest.py (the values depend on them).

Files:
  steps.npz: for each run `<run>/leaf_<i>` (the final TrainState's leaves, `jax.tree.leaves` order)
    and `<run>/metrics_<k>/<name>` (step k's metrics);
  checkpoint/<step>/: `save_checkpoint` of run `lm_fused_bf16`'s final state, with its config and
    extras {"data_position": [3, 5]};
  versions.json: jax, jaxlib, flax, optax versions and the jmamba commit it was made on.
"""

from __future__ import annotations

import os

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jmamba  # noqa: E402

M1 = jmamba.Mamba1Config(d_model=16, n_layers=2, d_state=4, input_dim=3)
M3 = jmamba.Mamba3Config(d_model=16, n_layers=2, d_state=8, headdim=8, input_dim=3)
LM_BACKBONE = jmamba.Mamba1Config(d_model=16, n_layers=2, d_state=4)
VOCAB = 32


def lm_model():
    return jmamba.MambaLM(LM_BACKBONE, VOCAB, rngs=nnx.Rngs(0))


def lm_optimizer(lm):
    return jmamba.fused_adamw(1e-2, weight_decay=0.1, mask=jmamba.no_decay_mask(lm))


def lm_batch(k):
    r = np.random.default_rng(100 + k)
    ids = r.integers(0, VOCAB, size=(2, 9))
    return {"inputs": jnp.asarray(ids[:, :-1], jnp.int32), "targets": jnp.asarray(ids[:, 1:], jnp.int32)}


def d_out_batch(k, bsz=2, T=8, d_model=16):
    r = np.random.default_rng(200 + k)
    return {"inputs": jnp.asarray(r.normal(size=(bsz, T, 3)), jnp.float32),
            "d_out": jnp.asarray(r.normal(size=(bsz, T, d_model)), jnp.float32)}


def run_steps(step, state, batches):
    """(final state, [metrics per step]) of `step` applied to each batch in turn."""
    metrics = []
    for batch in batches:
        state, m = step(state, batch)
        metrics.append(m)
    return state, metrics


def run_lm_fused_bf16():
    """MambaLM (Mamba-1), fused AdamW with the no-decay mask, bf16, clipping, 3 fused steps."""
    lm = lm_model()
    opt = lm_optimizer(lm)
    state = jmamba.TrainState.create(lm, opt, 2, precision="bf16")
    step = jmamba.make_train_step(lm, opt, loss_fn=jmamba.next_token_loss, precision="bf16", clip_max_norm=1.0)
    return run_steps(step, state, [lm_batch(k) for k in range(3)])


def run_m3_f16_chain():
    """Mamba-3 backbone, optax.chain(clip, adamw with mask), f16 loss scaling, d_out mode, 2 fused steps."""
    model = jmamba.Mamba3Backbone(M3, rngs=nnx.Rngs(1))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, mask=jmamba.no_decay_mask(model)))
    state = jmamba.TrainState.create(model, opt, 2, precision="f16")
    step = jmamba.make_train_step(model, opt, precision="f16")
    return run_steps(step, state, [d_out_batch(k) for k in range(2)])


def run_m1_split_accum():
    """Mamba-1 backbone, optax.adamw, split API: one accumulate_only micro-batch, then an applying one
    with clipping (f32)."""
    model = jmamba.Mamba1Backbone(M1, rngs=nnx.Rngs(2))
    opt = optax.adamw(1e-2)
    state = jmamba.TrainState.create(model, opt, 2, accumulate=True)
    metrics = []
    for k, acc in enumerate((True, False)):
        b = d_out_batch(k)
        _, ctx, state = jmamba.forward(model, state, {"inputs": b["inputs"]})
        state, m = jmamba.backward_step(opt, state, ctx, b["d_out"], accumulate_only=acc,
                                        clip_max_norm=None if acc else 0.5)
        metrics.append(m)
    return state, metrics


def run_m1_multisteps():
    """Mamba-1 backbone, optax.MultiSteps(fused_adamw, 2) (runs unfused), 3 fused steps (f32)."""
    model = jmamba.Mamba1Backbone(M1, rngs=nnx.Rngs(3))
    opt = optax.MultiSteps(jmamba.fused_adamw(1e-2), 2)
    state = jmamba.TrainState.create(model, opt, 2)
    step = jmamba.make_train_step(model, opt)
    return run_steps(step, state, [d_out_batch(10 + k) for k in range(3)])


RUNS = {"lm_fused_bf16": run_lm_fused_bf16, "m3_f16_chain": run_m3_f16_chain,
        "m1_split_accum": run_m1_split_accum, "m1_multisteps": run_m1_multisteps}


def flat_results(state, metrics, run):
    out = {f"{run}/leaf_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(state))}
    for k, m in enumerate(metrics):
        for name, v in m.items():
            out[f"{run}/metrics_{k}/{name}"] = np.asarray(v)
    return out


def main(out_dir):
    import warnings
    os.makedirs(out_dir, exist_ok=True)
    arrays, lm_state = {}, None
    for run, fn in RUNS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the MultiSteps run warns that the fused kernel is not used
            state, metrics = fn()
        arrays.update(flat_results(state, metrics, run))
        if run == "lm_fused_bf16":
            lm_state = state
    np.savez_compressed(os.path.join(out_dir, "steps.npz"), **arrays)
    shutil.rmtree(os.path.join(out_dir, "checkpoint"), ignore_errors=True)   # a rerun replaces it
    jmamba.save_checkpoint(os.path.join(out_dir, "checkpoint"), lm_state, config=lm_model().config,
                           extras={"data_position": [3, 5]}, keep=None)
    here = os.path.dirname(os.path.abspath(__file__))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
    import flax
    import jaxlib
    versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
                "optax": optax.__version__, "jmamba_commit": commit}
    with open(os.path.join(out_dir, "versions.json"), "w") as f:
        json.dump(versions, f, indent=2, sort_keys=True)
    print(f"wrote {len(arrays)} arrays and a checkpoint to {out_dir}: {versions}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_state"))
