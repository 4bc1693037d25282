"""The optimizer inside the train step (jmamba/optim/fused_apply.py, jmamba/training/optimizer_update.py):
`find_fused_apply`, fused_adamw fused also as the last element of an `optax.chain`, one warning when
a fused_adamw cannot be fused (middle of a chain, inside MultiSteps), and `optax.MultiSteps` (params
change every k-th step, `updates` counts them) in make_train_step and backward_step. Oracles are
plain optax `update` + `apply_updates` run by hand on gradients taken by hand."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jmamba
from builders import TINY_MAMBA1, d_out_batch, tiny_backbone
from helpers import assert_close
from jmamba import TrainState, backward_step, find_fused_apply, forward, fused_adamw, make_train_step

LR, WD, CLIP = 1e-2, 0.1, 0.05     # CLIP well below the gradient norms: the clip is active
CFG = dataclasses.replace(TINY_MAMBA1, n_layers=1)


def model(seed):
    return tiny_backbone(cfg=CFG, seed=seed)


def batch(i):
    return d_out_batch(i, bsz=4, T=6)


def hand_run(model, tx, n_steps, seed0=0):
    """`n_steps` of tx on the model's gradients for `batch(seed0 + i)`, each window from a zero
    state, with plain optax: grads by jax.vjp, then tx.update + optax.apply_updates."""
    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(jnp.copy, params)
    opt_state = tx.init(params)

    @jax.jit
    def one(params, opt_state, batch):
        _, vjp = jax.vjp(lambda p: nnx.merge(graphdef, p)(batch["inputs"])[0], params)
        (grads,) = vjp(batch["d_out"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for i in range(n_steps):
        params, opt_state = one(params, opt_state, batch(seed0 + i))
    return params, opt_state


def step_run(model, tx, n_steps, seed0=0, **step_kw):
    """The same through make_train_step: (final TrainState, [metrics per step])."""
    state = TrainState.create(model, tx, 4)
    step = make_train_step(model, tx, **step_kw)
    metrics = []
    for i in range(n_steps):
        state, m = step(state.reset_recurrent_state(), batch(seed0 + i))
        metrics.append(m)
    return state, metrics


def trace_step(model, tx):
    """Traces (does not compile) one train step of `model` with `tx`: enough for what happens at
    trace time (the fused-or-not decision, its warning, the op calls)."""
    state = TrainState.create(model, tx, 4)
    return jax.eval_shape(make_train_step(model, tx, jit=False), state, batch(0))


@pytest.fixture
def adamw_calls(monkeypatch):
    """Records the `implementation=` of every `jmamba.ops.adamw_update` call (made at trace time).

    fused_adamw's optax `update` always asks for "xla"; its fused apply asks for the implementation
    it was built with, so an optimizer built with implementation="reference" shows which path ran."""
    calls = []
    real = jmamba.ops.adamw_update

    def spy(*args, implementation=None, **kw):
        calls.append(implementation)
        return real(*args, implementation=implementation, **kw)

    monkeypatch.setattr(jmamba.ops, "adamw_update", spy)
    return calls


def test_find_fused_apply_on_the_transformation_and_last_in_a_chain():
    fused = fused_adamw(LR)
    assert find_fused_apply(fused) is not None
    assert find_fused_apply(optax.chain(fused)) is not None
    assert find_fused_apply(optax.chain(optax.clip_by_global_norm(1.0), fused)) is not None
    assert find_fused_apply(optax.chain(optax.clip(1.0), optax.chain(optax.clip_by_global_norm(1.0), fused))) is not None
    assert find_fused_apply(optax.chain(fused, optax.scale(1.0))) is None
    assert find_fused_apply(optax.adamw(LR)) is None
    assert find_fused_apply(optax.MultiSteps(fused, every_k_schedule=2)) is None
    assert find_fused_apply(object()) is None


def test_clip_then_fused_adamw_chain_runs_fused_and_equals_the_chain_run_by_hand(adamw_calls):
    m = model(7)
    chain = optax.chain(optax.clip_by_global_norm(CLIP), fused_adamw(LR, weight_decay=WD, implementation="reference"))
    state, metrics = step_run(m, chain, 4)
    assert adamw_calls == ["reference"], "the step traced once, through the fused apply"
    want, want_opt = hand_run(m, chain, 4)
    assert set(adamw_calls) == {"reference", "xla"}     # the hand run went through optax `update`
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(want)):
        assert_close(f"params {jax.tree_util.keystr(path)}", a, b, 1e-6)
    assert int(state.opt_state[1].count) == 4 == int(want_opt[1].count)
    assert [int(m["updates"]) for m in metrics] == [1, 2, 3, 4]
    assert all(float(m["grad_norm"]) > CLIP for m in metrics), "the clip must be active"


def test_a_fused_adamw_that_cannot_be_fused_warns_once(adamw_calls):
    m = model(8)
    middle = optax.chain(fused_adamw(LR, weight_decay=WD, implementation="reference"), optax.scale(1.0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trace_step(m, middle)
        trace_step(m, middle)                     # the same optimizer in another step: no second warning
    mine = [w for w in seen if "fused optimizer kernel is not used" in str(w.message)]
    assert len(mine) == 1 and "sits earlier in the chain" in str(mine[0].message)
    assert adamw_calls == ["xla", "xla"], "update + apply_updates ran, not the fused apply"
    with pytest.warns(UserWarning, match="combinator .*MultiSteps"):
        trace_step(m, optax.MultiSteps(fused_adamw(LR), every_k_schedule=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # nothing to say about an optimizer without fused_adamw
        trace_step(m, optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR)))


def test_multisteps_updates_every_kth_step_and_equals_multisteps_by_hand():
    model_ = model(9)
    ms = optax.MultiSteps(optax.adamw(LR, weight_decay=WD), every_k_schedule=2)
    state0 = TrainState.create(model_, ms, 4)
    step = make_train_step(model_, ms, donate=False)
    state, params_seen = state0, [state0.params]
    for i in range(4):
        state, m = step(state.reset_recurrent_state(), batch(i))
        params_seen.append(state.params)
        assert int(state.step) == int(m["step"]) == i + 1
        assert int(state.updates) == int(m["updates"]) == (i + 1) // 2
    moved = [any(bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)))
             for p0, p1 in zip(params_seen, params_seen[1:])]
    assert moved == [False, True, False, True], "params change only on every 2nd step"
    want, _ = hand_run(model_, ms, 4)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
        assert_close("params", a, b, 1e-6)
    # the split API takes the MultiSteps too, and counts the same way
    split = state0
    for i in range(2):
        _, ctx, split = forward(model_, split.reset_recurrent_state(), {"inputs": batch(i)["inputs"]})
        split, m = backward_step(ms, split, ctx, batch(i)["d_out"])
    assert (int(split.step), int(split.updates)) == (2, 1)
    for a, b in zip(jax.tree.leaves(split.params), jax.tree.leaves(params_seen[2])):
        assert_close("split API params after 2 micro-steps", a, b, 1e-6)
