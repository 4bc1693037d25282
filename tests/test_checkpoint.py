"""Checkpoints: round trip, mismatch errors, atomicity under a kill, bit-continuous resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, struct

import jmamba
from builders import TINY_MAMBA1 as CFG
from builders import TINY_MAMBA3, tiny_backbone
from jmamba import Mamba1Backbone, Mamba1Config, TrainState, restore_checkpoint, save_checkpoint
from jmamba.io.checkpoint import checkpoint_info, latest_step

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")


def worker(*args):
    res = subprocess.run([sys.executable, WORKER, *map(str, args)], capture_output=True, text=True, timeout=600)
    return res


def test_round_trip_with_extras_and_mismatch_errors(tmp_path):
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-2)
    state = TrainState.create(model, opt, 3, precision="f16", accumulate=True)
    state = state.replace(recurrent_state=jax.tree.map(lambda a: a + 0.5, state.recurrent_state),
                          step=jnp.asarray(7, jnp.int32))
    rng = jax.random.PRNGKey(42)
    save_checkpoint(tmp_path, state, config=CFG, extras={"rng": rng, "data_position": np.array([3, 9, 27])})
    restored = restore_checkpoint(tmp_path, TrainState.create(model, opt, 3, precision="f16", accumulate=True),
                                  config=CFG)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, b)
    info = checkpoint_info(tmp_path)
    assert info["step"] == 7 and info["config"] == CFG and latest_step(tmp_path) == 7
    np.testing.assert_array_equal(info["extras"]["rng"], jax.random.key_data(rng))
    np.testing.assert_array_equal(info["extras"]["data_position"], [3, 9, 27])

    like = TrainState.create(model, opt, 3, precision="f16", accumulate=True)
    with pytest.raises(ValueError, match="n_layers: saved 2 vs given 3"):
        restore_checkpoint(tmp_path, like, config=Mamba1Config(d_model=16, n_layers=3, d_state=4, input_dim=3))
    other = Mamba1Backbone(Mamba1Config(d_model=16, n_layers=2, d_state=8, input_dim=3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"A_log.*\(32, 4\).*\(32, 8\)"):
        restore_checkpoint(tmp_path, TrainState.create(other, opt, 3, precision="f16", accumulate=True))
    with pytest.raises(ValueError, match="structure differs"):
        restore_checkpoint(tmp_path, TrainState.create(model, optax.sgd(0.1), 3))
    with pytest.raises(ValueError, match="recurrent_state"):
        restore_checkpoint(tmp_path, TrainState.create(model, opt, 5, precision="f16", accumulate=True))
    with pytest.raises(FileExistsError):
        save_checkpoint(tmp_path, state, config=CFG)
    with pytest.raises(FileNotFoundError):
        restore_checkpoint(os.path.join(tmp_path, "nope"), like)
    with pytest.raises(FileNotFoundError, match="step 3"):
        restore_checkpoint(tmp_path, like, step=3)


def test_keep_and_refusals(tmp_path):
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    opt = optax.sgd(0.1)
    state = TrainState.create(model, opt, 2)
    for s in range(4):
        save_checkpoint(tmp_path, state.replace(step=jnp.asarray(s, jnp.int32)), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]
    with pytest.raises(TypeError, match="TrainState"):
        save_checkpoint(tmp_path, {"a": 1})
    _, ctx, pending = jmamba.forward(model, state, {"inputs": jnp.ones((2, 4, 3))})
    with pytest.raises(RuntimeError, match="pending"):
        save_checkpoint(tmp_path, pending)
    with pytest.raises(TypeError, match="JSON|serializable"):
        save_checkpoint(tmp_path, state.replace(step=jnp.asarray(9, jnp.int32)), extras={"f": object()})
    assert 9 not in (latest_step(tmp_path),)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    res = worker("crash", tmp_path)
    assert res.returncode == -9, (res.returncode, res.stdout, res.stderr[-2000:])
    assert latest_step(tmp_path) == 1
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    restored = restore_checkpoint(tmp_path, TrainState.create(model, optax.adamw(1e-2), 2), config=CFG)
    assert int(restored.step) == 1
    # the next save (in this process) succeeds and cleans up the debris
    save_checkpoint(tmp_path, restored.replace(step=jnp.asarray(2, jnp.int32)))
    assert latest_step(tmp_path) == 2


class OldTrainState(struct.PyTreeNode):
    """The TrainState layout before `updates` existed (same fields, same order, no `updates`)."""

    params: Any
    opt_state: Any
    recurrent_state: Any
    step: jax.Array
    loss_scale: Any = None
    grad_accum: Any = None
    accumulating: bool = struct.field(pytree_node=False, default=False)
    pending_forward: Any = struct.field(pytree_node=False, default=None)


def test_a_checkpoint_of_the_old_layout_restores(tmp_path):
    """Written before the redesign: no `.updates` leaf (filled from `.step`) and a Mamba-3 config that
    still holds `chunk_size` (ignored). The old checkpoint is made by saving the old TrainState
    layout and adding chunk_size to the stored config, as the old writer stored it."""
    model = tiny_backbone("mamba3")
    opt = optax.adamw(1e-2)
    new = TrainState.create(model, opt, 2)
    new = new.replace(params=jax.tree.map(lambda a: a + 0.25, new.params), step=jnp.asarray(5, jnp.int32))
    old = OldTrainState(params=new.nnx_params(), opt_state=new.nnx_opt_state(), recurrent_state=new.recurrent_state,
                        step=new.step)
    save_checkpoint(tmp_path, old, config=TINY_MAMBA3)
    meta_path = os.path.join(tmp_path, "5", "meta", "metadata")
    meta = json.load(open(meta_path))
    assert ".updates" not in meta["leaves"] and ".step" in meta["leaves"]
    meta["config"]["chunk_size"] = 64
    json.dump(meta, open(meta_path, "w"))

    restored = restore_checkpoint(tmp_path, TrainState.create(model, opt, 2), config=TINY_MAMBA3)
    assert int(restored.step) == 5 and int(restored.updates) == 5 and restored.updates.dtype == jnp.int32
    for a, b in zip(jax.tree.leaves((restored.params, restored.opt_state)), jax.tree.leaves((new.params, new.opt_state))):
        np.testing.assert_array_equal(a, b)
    assert checkpoint_info(tmp_path)["config"] == TINY_MAMBA3


@pytest.mark.parametrize("arch", ["mamba1", "mamba3"])
def test_resume_in_a_fresh_process_is_bit_continuous(tmp_path, arch):
    res = worker("train", tmp_path, arch, 3, 2)
    assert res.returncode == 0, res.stderr[-3000:]
    res = worker("resume", tmp_path, arch, 3, 2)
    assert res.returncode == 0, res.stderr[-3000:]
    for precision in ("f32", "bf16"):
        a = np.load(os.path.join(tmp_path, f"straight_{precision}.npz"))
        b = np.load(os.path.join(tmp_path, f"resumed_{precision}.npz"))
        assert len(a.files) == len(b.files) > 10
        for k in a.files:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{arch} {precision} leaf {k}")
