"""Mamba3Backbone vs the independent numpy model (both output modes, groups, carried state, resets),
float64 finite differences, window carry, prefill + decode, BPTT modes, bf16, training, bad input.

Every test runs the scans with chunks of 4 (a `jmamba.ops.tuning` block around the module), so the
windows here span several chunks."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import numpy_mamba3 as npm
from builders import TINY_CHUNK, delayed_copy_batch, mse_first_feature
from helpers import assert_close, assert_directional_gradients
from helpers import perturbed as perturb
from jmamba import Mamba3Backbone, Mamba3Config, TrainState, make_train_step, ops

# G = 2 groups of 2 heads, rope_fraction 0.5 (S = 2 of N/2 = 4 pairs), y·silu(z) gate, input_proj
CFG = Mamba3Config(d_model=8, n_layers=2, d_state=8, expand=2, headdim=4, ngroups=2, input_dim=5)
# gated RMSNorm output, rope_fraction 1.0 (all N dims rotate), identity input
CFG_NORM = Mamba3Config(d_model=8, n_layers=2, d_state=6, expand=2, headdim=4, rope_fraction=1.0,
                        is_outproj_norm=True)
CONFIGS = {"gate-groups-input_proj": CFG, "outproj_norm-fullrope": CFG_NORM}


@pytest.fixture(autouse=True, scope="module")
def short_chunks():
    with ops.tuning("mamba3_siso_scan", chunk_size=TINY_CHUNK):
        yield


def perturbed(cfg, seed=0):
    """A backbone with every parameter perturbed (biases, norm weights, D no longer their init)."""
    return perturb(Mamba3Backbone(cfg, rngs=nnx.Rngs(seed)), seed, scale=0.3)


def inputs(cfg, bsz, T, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(bsz, T, cfg.backbone_input_dim)), jnp.float32)


def random_state(model, bsz, seed=5):
    rng = np.random.default_rng(seed)
    return tuple(type(s)(angle=jnp.asarray(rng.uniform(0, 2 * np.pi, s.angle.shape), jnp.float32),
                         **{f: jnp.asarray(rng.normal(size=getattr(s, f).shape), jnp.float32) for f in ("ssm", "k", "v")})
                 for s in model.init_state(bsz))


_FORWARD = nnx.jit(lambda m, x, s, r: m(x, s, reset=r))
_STEP = nnx.jit(lambda m, x, s: m.step(x, s))


def run(model, x, state=None, reset=None):
    """model(x, state, reset=reset), compiled once per (config, shape): state and reset are always
    passed (zeros / all-False when not given) so every call of a shape shares one program."""
    bsz, T = x.shape[:2]
    state = model.init_state(bsz) if state is None else state
    reset = jnp.zeros((bsz, T), bool) if reset is None else reset
    return _FORWARD(model, x, state, reset)


def np_params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def np_state(state):
    return [tuple(np.asarray(a, np.float64) for a in s) for s in state]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_from_carried_state_with_resets_matches_numpy_model(name):
    cfg = CONFIGS[name]
    model = perturbed(cfg)
    x = inputs(cfg, 2, 12)
    state = random_state(model, 2)
    reset = jnp.zeros((2, 12), bool).at[0, 0].set(True).at[1, 6].set(True)
    y, new = run(model, x, state, reset)
    want_y, want_state = npm.backbone_forward(np_params(model), np.asarray(x), cfg, np_state(state), np.asarray(reset))
    assert y.dtype == jnp.float32 and y.shape == (2, 12, cfg.d_model)
    assert_close("y", y, want_y, 2e-5)
    for i, (got, want) in enumerate(zip(new, want_state)):
        for field, g, w in zip(got._fields, got, want):
            assert g.dtype == jnp.float32
            assert_close(f"layer {i} {field} state", g, w, 2e-5)


def test_two_windows_with_carried_state_equal_one_window():
    model = perturbed(CFG)
    x = inputs(CFG, 2, 12)
    y_full, s_full = run(model, x)
    y1, s1 = run(model, x[:, :5])
    y2, s2 = run(model, x[:, 5:], s1)
    assert_close("y", jnp.concatenate([y1, y2], 1), y_full, 2e-5)
    for a, b in zip(jax.tree.leaves(s2), jax.tree.leaves(s_full)):
        assert_close("state", a, b, 2e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_equals_full_forward(name):
    cfg = CONFIGS[name]
    model = perturbed(cfg)
    x = inputs(cfg, 2, 12)
    y_full, s_full = run(model, x)
    y_pre, state = run(model, x[:, :5])
    ys = [y_pre]
    for t in range(5, 12):
        yt, state = _STEP(model, x[:, t], state)
        ys.append(yt[:, None])
    assert_close("y", jnp.concatenate(ys, 1), y_full, 2e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(s_full)):
        assert_close("state", a, b, 2e-5)


def test_reset_restarts_a_row_as_a_fresh_sequence():
    model = perturbed(CFG)
    x = inputs(CFG, 2, 12)
    junk = random_state(model, 2, seed=9)
    reset = jnp.zeros((2, 12), bool).at[0, 0].set(True).at[1, 6].set(True)
    y, _ = run(model, x, junk, reset)
    y_fresh, _ = run(model, x)
    y_junk, _ = run(model, x, junk)
    assert_close("row reset at t=0 = zero state", y[0], y_fresh[0], 1e-6)
    assert_close("before the reset the carried state is used", y[1, :6], y_junk[1, :6], 1e-6)
    # positions 6.. of row 1 equal a fresh run on x[1, 6:] (placed at the start of a window)
    shifted = jnp.concatenate([x[:, 6:], x[:, :6]], axis=1)
    y_shift, _ = run(model, shifted)
    assert_close("after the reset = fresh sequence", y[1, 6:], y_shift[1, :6], 2e-5)
    assert float(jnp.abs(y_junk[1, 6:] - y[1, 6:]).max()) > 1e-3, "the reset must matter"
    # backbone.step's [B] reset
    yt, _ = model.step(x[:, 0], junk, reset=jnp.array([True, False]))
    assert_close("step reset row", yt[0], y_fresh[0, 0], 1e-5)
    assert float(jnp.abs(yt[1] - y_fresh[1, 0]).max()) > 1e-3


def test_bptt_truncated_by_default_exact_on_request():
    """Exact BPTT through two chained windows = the one-window gradient (parameters and all four
    incoming states); the default truncation changes the gradient. One layer keeps compiles short."""
    cfg = dataclasses.replace(CFG, n_layers=1)
    model = perturbed(cfg)
    graphdef, params = nnx.split(model)
    x = inputs(cfg, 2, 12)
    state0 = random_state(model, 2)

    def objective(y):
        return jnp.sum(y * jnp.cos(y))

    def full(params, state0):
        return objective(nnx.merge(graphdef, params)(x, state0, truncate_bptt=False)[0])

    def chained(params, state0, truncate):
        m = nnx.merge(graphdef, params)
        y1, s = m(x[:, :5], state0, truncate_bptt=False)
        y2, _ = m(x[:, 5:], s) if truncate else m(x[:, 5:], s, truncate_bptt=False)
        return objective(jnp.concatenate([y1, y2], 1))

    g_full = jax.jit(jax.grad(full, argnums=(0, 1)))(params, state0)
    g_exact = jax.jit(jax.grad(chained, argnums=(0, 1)), static_argnums=2)(params, state0, False)
    g_trunc = jax.jit(jax.grad(chained), static_argnums=2)(params, state0, True)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_exact), jax.tree.leaves(g_full)):
        assert float(jnp.abs(b).max()) > 0.0, f"no gradient reaches {jax.tree_util.keystr(path)}"
        assert_close(f"exact BPTT grad {jax.tree_util.keystr(path)}", a, b, 1e-4)
    diffs = [float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g_trunc), jax.tree.leaves(g_full[0]))]
    assert max(diffs) > 1e-4, "truncation must change the gradient"


def test_float64_finite_differences_of_every_parameter_input_and_state():
    """Directional central differences (h=1e-6, float64) vs jax.grad for every tensor: parameters
    (both B/C biases, norms, gated norm), the input and all four states of both layers, with a reset."""
    cfg = Mamba3Config(d_model=4, n_layers=2, d_state=4, expand=2, headdim=2, ngroups=2, input_dim=3,
                       is_outproj_norm=True)
    model = perturbed(cfg, seed=3)
    with jax.enable_x64(True):
        graphdef, params = nnx.split(model)
        params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.normal(size=(2, 5, 3)))
        state = jax.tree.map(lambda a: jnp.asarray(rng.uniform(0.2, 1.5, size=a.shape)), model.init_state(2))
        reset = jnp.zeros((2, 5), bool).at[1, 2].set(True)
        proj = jnp.asarray(rng.normal(size=(2, 5, 4)))

        def loss(params, x, state):
            y, new = nnx.merge(graphdef, params)(x, state, reset=reset, precision="f64", truncate_bptt=False)
            return jnp.sum(y * proj) + 0.3 * sum(jnp.sum(jnp.sin(s)) for s in jax.tree.leaves(new))

        checked = assert_directional_gradients(loss, (params, x, state), rng)
        assert checked == 2 * (2 * 10 + 3 + 1 + 2 * 4)


def test_bf16_compute_close_to_f32():
    model = perturbed(CFG)
    x = inputs(CFG, 2, 12)
    y32, _ = run(model, x)
    y16, s16 = nnx.jit(lambda m, x: m(x, precision="bf16"))(model, x)
    assert y16.dtype == jnp.float32 and all(a.dtype == jnp.float32 for a in jax.tree.leaves(s16))
    assert_close("bf16 vs f32", y16, y32, 5e-2)


def test_train_step_trains_a_mamba3_backbone():
    cfg = Mamba3Config(d_model=16, n_layers=2, d_state=8, expand=2, headdim=8, input_dim=3)
    model = Mamba3Backbone(cfg, rngs=nnx.Rngs(0))
    opt = optax.adam(1e-2)
    state = TrainState.create(model, opt, batch_size=8)
    step = jax.jit(chex.assert_max_traces(make_train_step(model, opt, loss_fn=mse_first_feature, jit=False), n=1))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(150):
        state = state.reset_recurrent_state()
        state, metrics = step(state, delayed_copy_batch(rng))
        losses.append(float(metrics["loss"]))
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.25 * first, f"loss did not fall enough: {first:.4f} -> {last:.4f}"


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("make,err,match", [
    (lambda m: m(jnp.ones((2, 5))), ValueError, r"x must have shape \[batch, seqlen, 5\]"),
    (lambda m: m(jnp.ones((2, 5, 6))), ValueError, "input_dim"),
    (lambda m: m(jnp.ones((2, 5, 5), jnp.int32)), TypeError, "x must be a floating"),
    (lambda m: m(jnp.ones((2, 5, 5)), m.init_state(3)), ValueError, r"state\[0\].angle must have shape"),
    (lambda m: m(jnp.ones((2, 5, 5)), m.init_state(2)[:1]), ValueError, "tuple of 2 per-layer states"),
    (lambda m: m(jnp.ones((2, 5, 5)), tuple(tuple(s) for s in m.init_state(2))), TypeError,
     r"state\[0\] must be a Mamba3ScanState"),
    (lambda m: m(jnp.ones((2, 5, 5)), tuple(s._replace(k=s.k[..., :3]) for s in m.init_state(2))),
     ValueError, r"state\[0\].k must have shape"),
    (lambda m: m(jnp.ones((2, 5, 5)), tuple(s._replace(ssm=s.ssm.astype(jnp.bfloat16)) for s in m.init_state(2))),
     TypeError, "ssm must have dtype float32"),
    (lambda m: m(jnp.ones((2, 5, 5)), reset=jnp.ones((2, 4), bool)), ValueError, "reset must have shape"),
    (lambda m: m.step(jnp.ones((2, 5, 5)), m.init_state(2)), ValueError, r"x must have shape \[batch, 5\]"),
    (lambda m: m.layers[0].mixer(jnp.ones((2, 5, 7))), ValueError, r"x must have shape \[batch, seqlen, 8\] \(d_model\)"),
    (lambda m: m.layers[0].mixer(jnp.ones((2, 5, 8)), m.init_state(2)[0]._replace(v=jnp.ones((2, 3)))),
     ValueError, r"initial_state\.v must have shape"),
    (lambda m: m.layers[0].mixer.step(jnp.ones((2, 8)), {"ssm": 0}), ValueError, "state must be a Mamba3ScanState"),
    (lambda m: m.layers[0].mixer.step(jnp.ones((2, 8)), m.init_state(3)[0]), ValueError, r"state.angle must have shape"),
    (lambda m: m.init_state(0), ValueError, "batch must be a positive int"),
])
def test_bad_input_raises(make, err, match):
    model = Mamba3Backbone(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(err, match=match):
        make(model)
