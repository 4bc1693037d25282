"""Mamba1Backbone vs the independent numpy model, float64 finite differences, state carry, decode, resets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_mamba1 as npm
from helpers import assert_close, assert_directional_gradients
from helpers import perturbed as perturb
from jmamba import Mamba1Backbone, Mamba1Config

CFG = Mamba1Config(d_model=12, n_layers=2, d_state=4, d_conv=4, expand=2, input_dim=5)
CFG_LM = Mamba1Config(d_model=8, n_layers=2, d_state=3, d_conv=3, dt_rank=3)  # input_dim=None


def perturbed(cfg, seed=0):
    """A backbone whose every parameter is perturbed (so D != 1, norms != 1, A not the S4D init)."""
    return perturb(Mamba1Backbone(cfg, rngs=nnx.Rngs(seed)), seed)


def inputs(cfg, bsz, T, seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), (bsz, T, cfg.backbone_input_dim), dtype)


def run(model, x, state=None, reset=None, **static):
    """model(x, state, reset=reset, **static) compiled (eager dispatch of the scan is slow on CPU)."""
    return nnx.jit(lambda m, x, s, r: m(x, s, reset=r, **static))(model, x, state, reset)


def np_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.parametrize("cfg", [CFG, CFG_LM], ids=["input_proj", "identity_input"])
def test_forward_matches_numpy_model(cfg):
    model = perturbed(cfg)
    x = inputs(cfg, 2, 11)
    y, state = run(model, x)
    want_y, want_state = npm.backbone_forward(np_params(model), np.asarray(x), cfg)
    assert y.dtype == jnp.float32 and y.shape == (2, 11, cfg.d_model)
    assert_close("y", y, want_y, 1e-5)
    for i, (cs, ss) in enumerate(want_state):
        assert_close(f"layer {i} conv state", state[i].conv, cs, 1e-6)
        assert_close(f"layer {i} ssm state", state[i].ssm, ss, 1e-5)


def test_forward_from_carried_state_matches_numpy_model():
    model = perturbed(CFG)
    x = inputs(CFG, 2, 9)
    state = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(5), a.shape, a.dtype), model.init_state(2))
    y, new = run(model, x, state)
    want_y, want_state = npm.backbone_forward(np_params(model), np.asarray(x), CFG,
                                              [(np.asarray(s.conv), np.asarray(s.ssm)) for s in state])
    assert_close("y", y, want_y, 1e-5)
    assert_close("ssm state", new[1].ssm, want_state[1][1], 1e-5)


@pytest.mark.parametrize("split", [1, 2, 7])   # 1 and 2 are shorter than d_conv - 1 = 3
def test_two_windows_with_carried_state_equal_one_window(split):
    model = perturbed(CFG)
    x = inputs(CFG, 3, 14)
    y_full, s_full = run(model, x)
    y1, s1 = run(model, x[:, :split])
    y2, s2 = run(model, x[:, split:], s1)
    assert_close("y", jnp.concatenate([y1, y2], 1), y_full, 1e-5)
    for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(s_full)):
        assert_close("state", a, b, 1e-5)


def test_prefill_then_decode_equals_full_forward():
    model = perturbed(CFG)
    x = inputs(CFG, 2, 12)
    y_full, s_full = run(model, x)
    y_pre, state = run(model, x[:, :5])
    ys = [y_pre]
    step = nnx.jit(lambda m, xt, s: m.step(xt, s))
    for t in range(5, 12):
        yt, state = step(model, x[:, t], state)
        ys.append(yt[:, None])
    assert_close("y", jnp.concatenate(ys, 1), y_full, 1e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(s_full)):
        assert_close("state", a, b, 1e-5)


def test_reset_rows_and_positions():
    model = perturbed(CFG)
    x = inputs(CFG, 3, 10)
    junk = jax.tree.map(lambda a: jax.random.normal(jax.random.PRNGKey(9), a.shape, a.dtype), model.init_state(3))
    # a [B] row mask = starting that row from zeros
    rows = jnp.array([True, False, True])
    y_rows, _ = run(model, x, junk, rows)
    y_zero, _ = run(model, x)
    y_junk, _ = run(model, x, junk)
    assert_close("reset rows", y_rows[0], y_zero[0], 1e-6)
    assert_close("kept row", y_rows[1], y_junk[1], 1e-6)
    # a reset at position 6 of row 1 = a fresh sequence from position 6 on
    mask = jnp.zeros((3, 10), bool).at[1, 6].set(True)
    y_pos, s_pos = run(model, x, junk, mask)
    y_tail, s_tail = run(model, x[1:2, 6:])
    assert_close("after reset", y_pos[1, 6:], y_tail[0], 1e-5)
    assert_close("before reset", y_pos[1, :6], y_junk[1, :6], 1e-6)
    assert_close("conv state after reset", s_pos[0].conv[1], s_tail[0].conv[0], 1e-6)
    # a reset in the last K-1 positions: the carried conv state must not leak pre-reset inputs
    mask2 = jnp.zeros((3, 10), bool).at[0, 9].set(True)
    _, s2 = run(model, x, junk, mask2)
    y_next, _ = run(model, x[:, :4], s2)
    y_ref, _ = run(model, jnp.concatenate([x[:1, 9:], x[:1, :4]], 1))
    assert_close("window after late reset", y_next[0], y_ref[0, 1:], 1e-5)


def test_step_reset_mask():
    model = perturbed(CFG)
    x = inputs(CFG, 2, 3)
    junk = jax.tree.map(lambda a: jnp.ones_like(a), model.init_state(2))
    y_reset, _ = model.step(x[:, 0], junk, reset=jnp.array([True, False]))
    y_zero, _ = model.step(x[:, 0], model.init_state(2))
    assert_close("row 0", y_reset[0], y_zero[0], 1e-6)
    assert float(jnp.abs(y_reset[1] - y_zero[1]).max()) > 1e-3


def test_truncated_bptt_by_default_exact_on_request():
    model = perturbed(CFG)
    graphdef, params = nnx.split(model)
    x = inputs(CFG, 2, 8)
    state = jax.tree.map(lambda a: 0.5 * jnp.ones_like(a), model.init_state(2))

    def loss(state, truncate):
        y, _ = nnx.merge(graphdef, params)(x, state, truncate_bptt=truncate)
        return jnp.sum(jnp.sin(y))

    g_trunc = jax.jit(jax.grad(loss), static_argnums=1)(state, True)
    g_exact = jax.jit(jax.grad(loss), static_argnums=1)(state, False)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(g_trunc))
    assert all(float(jnp.abs(g).max()) > 0.0 for g in jax.tree.leaves(g_exact))


def test_exact_bptt_through_two_windows_equals_one_window():
    """With truncate_bptt=False, chaining windows in one program gives the full-sequence gradients."""
    model = perturbed(CFG)
    graphdef, params = nnx.split(model)
    x = inputs(CFG, 2, 12)

    def full(params):
        y, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(y * jnp.cos(y))

    def chained(params, truncate):
        m = nnx.merge(graphdef, params)
        y1, s = m(x[:, :5])
        y2, _ = m(x[:, 5:], s, truncate_bptt=truncate)
        y = jnp.concatenate([y1, y2], 1)
        return jnp.sum(y * jnp.cos(y))

    g_full = jax.jit(jax.grad(full))(params)
    g_exact = jax.jit(jax.grad(chained), static_argnums=1)(params, False)
    g_trunc = jax.jit(jax.grad(chained), static_argnums=1)(params, True)
    for a, b in zip(jax.tree.leaves(g_exact), jax.tree.leaves(g_full)):
        assert_close("grad", a, b, 1e-4)
    diffs = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g_trunc), jax.tree.leaves(g_full))]
    assert max(diffs) > 1e-4, "truncation must change the gradient"


def test_float64_finite_differences_of_every_parameter_input_and_state():
    """Directional central differences (h=1e-6, float64) vs jax.grad for every tensor (mamba-rs grad oracle)."""
    cfg = Mamba1Config(d_model=8, n_layers=2, d_state=3, d_conv=3, expand=2, input_dim=4)
    model = perturbed(cfg, seed=3)
    with jax.enable_x64(True):
        graphdef, params = nnx.split(model)
        params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
        x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 4)))
        state = jax.tree.map(lambda a: jnp.asarray(np.random.default_rng(1).normal(size=a.shape)), model.init_state(2))
        proj = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 8)))

        def loss(params, x, state):
            y, new = nnx.merge(graphdef, params)(x, state, precision="f64", truncate_bptt=False)
            return jnp.sum(y * proj) + 0.3 * sum(jnp.sum(jnp.sin(s)) for s in jax.tree.leaves(new))

        checked = assert_directional_gradients(loss, (params, x, state), np.random.default_rng(4))
        assert checked >= 2 * 20


def test_bf16_compute_close_to_f32():
    model = perturbed(CFG)
    x = inputs(CFG, 2, 16)
    y32, _ = run(model, x)
    y16, s16 = run(model, x, precision="bf16")
    assert y16.dtype == jnp.float32 and s16[0].ssm.dtype == jnp.float32
    assert_close("bf16 vs f32", y16, y32, 5e-2)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("make,err,match", [
    (lambda m: m(jnp.ones((2, 5))), ValueError, r"x must have shape \[batch, seqlen, 5\]"),
    (lambda m: m(jnp.ones((2, 5, 6))), ValueError, "input_dim"),
    (lambda m: m(jnp.ones((2, 5, 5), jnp.int32)), TypeError, "x must be a floating"),
    (lambda m: m(jnp.ones((2, 5, 5)), m.init_state(3)), ValueError, r"state\[0\].conv must have shape"),
    (lambda m: m(jnp.ones((2, 5, 5)), m.init_state(2)[:1]), ValueError, "tuple of 2 per-layer states"),
    (lambda m: m(jnp.ones((2, 5, 5)), {"conv": 1}), ValueError, "tuple of 2"),
    (lambda m: m(jnp.ones((2, 5, 5)), reset=jnp.ones((2, 4), bool)), ValueError, "reset must have shape"),
    (lambda m: m.step(jnp.ones((2, 5, 5)), m.init_state(2)), ValueError, r"x must have shape \[batch, 5\]"),
    (lambda m: m.init_state(0), ValueError, "batch must be a positive int"),
    (lambda m: m(jnp.ones((2, 5, 5)), tuple(s._replace(ssm=s.ssm.astype(jnp.bfloat16)) for s in m.init_state(2))),
     TypeError, "ssm must have dtype float32"),
])
def test_bad_input_raises(make, err, match):
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(err, match=match):
        make(model)
