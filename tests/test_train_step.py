"""make_train_step / TrainState: learning, tracing once, the d_out contract, state carry, bad batches."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from builders import delayed_copy_batch, mse_first_feature
from helpers import assert_close
from jmamba import Mamba1Backbone, Mamba1Config, TrainState, make_train_step

CFG = Mamba1Config(d_model=16, n_layers=1, d_state=4, input_dim=3)


def test_train_step_learns_a_toy_problem_and_traces_once():
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    opt = optax.adam(1e-2)
    state = TrainState.create(model, opt, batch_size=8)
    raw_step = make_train_step(model, opt, loss_fn=mse_first_feature, jit=False)
    step = jax.jit(chex.assert_max_traces(raw_step, n=1), donate_argnums=0)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(200):
        batch = delayed_copy_batch(rng)
        state = state.reset_recurrent_state()      # independent sequences
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 200 and int(metrics["step"]) == 200
    assert int(state.updates) == 200 and int(metrics["updates"]) == 200   # no MultiSteps: one update a step
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.25 * first, f"loss did not fall enough: {first:.4f} -> {last:.4f}"


def test_library_jit_compiles_once_across_steps():
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-3)
    state = TrainState.create(model, opt, batch_size=8)
    step = make_train_step(model, opt, loss_fn=mse_first_feature)
    rng = np.random.default_rng(0)
    for _ in range(4):
        state, _ = step(state, delayed_copy_batch(rng))
    assert step.compiled._cache_size() == 1


def test_d_out_contract_equals_loss_inside():
    """Passing d_out = ∂L/∂y gives the same update as differentiating L inside the step."""
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(1))
    opt = optax.sgd(0.1)
    rng = np.random.default_rng(1)
    batch = delayed_copy_batch(rng)
    proj = jnp.asarray(rng.normal(size=(8, 16, CFG.d_model)), jnp.float32)
    s0 = TrainState.create(model, opt, batch_size=8)
    s0 = s0.replace(recurrent_state=jax.tree.map(lambda a: jnp.full_like(a, 0.3), s0.recurrent_state))
    loss_step = make_train_step(model, opt, loss_fn=lambda y, b: jnp.sum(y * proj), donate=False)
    dout_step = make_train_step(model, opt, donate=False)
    s_loss, m_loss = loss_step(s0, batch)
    s_dout, m_dout = dout_step(s0, {**batch, "d_out": proj})
    for a, b in zip(jax.tree.leaves(s_dout.params), jax.tree.leaves(s_loss.params)):
        assert_close("params", a, b, 1e-6)
    for a, b in zip(jax.tree.leaves(s_dout.recurrent_state), jax.tree.leaves(s_loss.recurrent_state)):
        np.testing.assert_array_equal(a, b)
    assert "loss" in m_loss and "loss" not in m_dout
    changed = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(s_dout.params), jax.tree.leaves(s0.params)))
    assert changed > 0


def test_recurrent_state_is_carried_between_steps():
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(2))
    opt = optax.sgd(0.0)   # params fixed: the carried state must equal a two-window forward
    state = TrainState.create(model, opt, batch_size=2)
    step = make_train_step(model, opt, loss_fn=lambda y, b: jnp.mean(y ** 2))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 10, 3)), jnp.float32)
    state, _ = step(state, {"inputs": x[:, :5]})   # two windows of one shape: one compiled step
    state, _ = step(state, {"inputs": x[:, 5:]})
    _, want = nnx.jit(lambda m, x: m(x))(model, x)
    for a, b in zip(jax.tree.leaves(state.recurrent_state), jax.tree.leaves(want)):
        assert_close("carried state", a, b, 1e-5)
    # reset in the batch zeroes the carried state of that row first
    s_reset, _ = step(state, {"inputs": x[:, :5], "reset": jnp.array([True, False])})
    _, fresh = nnx.jit(lambda m, x: m(x))(model, x[:1, :5])
    assert_close("reset row", s_reset.recurrent_state[0].ssm[0], fresh[0].ssm[0], 1e-5)


def test_train_state_create_and_reset_rows():
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    state = TrainState.create(model, optax.adam(1e-3), batch_size=3)
    assert int(state.step) == 0 and state.step.dtype == jnp.int32
    assert int(state.updates) == 0 and state.updates.dtype == jnp.int32
    ones = state.replace(recurrent_state=jax.tree.map(jnp.ones_like, state.recurrent_state))
    part = ones.reset_recurrent_state(jnp.array([False, True, False]))
    assert float(part.recurrent_state[0].ssm[1].max()) == 0.0 and float(part.recurrent_state[0].ssm[0].min()) == 1.0
    leaves = jax.tree.leaves(state)   # the whole TrainState is a pytree of arrays
    assert all(isinstance(l, jax.Array) for l in leaves)


@pytest.mark.parametrize("batch,err,match", [
    ([1, 2], TypeError, "batch must be a dict"),
    ({"targets": 1}, ValueError, "inputs"),
    ({"inputs": jnp.ones((8, 16, 3))}, ValueError, "d_out"),
    ({"inputs": jnp.ones((8, 16, 3)), "d_out": jnp.ones((8, 16, 4))}, ValueError, "d_out"),
])
def test_bad_batch_raises(batch, err, match):
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    opt = optax.sgd(0.1)
    state = TrainState.create(model, opt, batch_size=8)
    step = make_train_step(model, opt, donate=False)
    with pytest.raises(err, match=match):
        step(state, batch)


def test_bad_arguments_to_make_train_step():
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="precision"):
        make_train_step(model, optax.sgd(0.1), precision="f8")
    with pytest.raises(TypeError, match="optimizer"):
        make_train_step(model, "adam")
    with pytest.raises(TypeError, match="loss_fn"):
        make_train_step(model, optax.sgd(0.1), loss_fn=3)


def test_compiler_options_reach_the_steps_compilation():
    """The options go to this step's jit: an unknown name fails its first compile (so the dict is really
    passed on), a valid GPU option compiles on the CPU and changes nothing there, bad types raise first."""
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    opt = optax.sgd(0.1)
    rng = np.random.default_rng(0)
    batch = delayed_copy_batch(rng)
    state = TrainState.create(model, opt, batch_size=8)
    plain = make_train_step(model, opt, loss_fn=mse_first_feature, donate=False)
    gpu_opt = make_train_step(model, opt, loss_fn=mse_first_feature, donate=False,
                              compiler_options={"xla_gpu_triton_gemm_any": False})
    s_plain, _ = plain(state, batch)
    s_opt, _ = gpu_opt(state, batch)
    for a, b in zip(jax.tree.leaves(s_plain.params), jax.tree.leaves(s_opt.params)):
        np.testing.assert_array_equal(a, b)
    unknown = make_train_step(model, opt, loss_fn=mse_first_feature, donate=False,
                              compiler_options={"xla_no_such_option_for_jmamba": True})
    with pytest.raises(Exception, match="xla_no_such_option_for_jmamba"):
        unknown(state, batch)
    for bad, match in (([("a", 1)], "compiler_options must be a dict"),
                       ({3: True}, "keys must be XLA option names"),
                       ({"xla_gpu_triton_gemm_any": [1]}, "must be a bool")):
        with pytest.raises(TypeError, match=match):
            make_train_step(model, opt, compiler_options=bad)
    with pytest.raises(ValueError, match="needs jit=True"):
        make_train_step(model, opt, jit=False, compiler_options={"xla_gpu_triton_gemm_any": False})
