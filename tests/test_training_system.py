"""Mixed precision, dynamic loss scaling, clipping, accumulation and the split API."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from builders import TINY_MAMBA1 as CFG
from builders import d_out_batch, delayed_copy_batch, gradient_capture, mse_first_feature
from helpers import assert_close
from jmamba import Mamba1Backbone, Mamba1Config, TrainState, backward_step, forward, make_train_step
from jmamba.ops import dispatch
from jmamba.optim import fused_adamw
from jmamba.training.loss_scale import DynamicLossScale, update_loss_scale


def data(seed, bsz=4, T=10):
    """(inputs [bsz, T, 3], d_out [bsz, T, 16]) of `d_out_batch`."""
    b = d_out_batch(seed, bsz, T)
    return b["inputs"], b["d_out"]


def leaves_equal(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def snapshot(tree):
    return jax.tree.map(lambda a: np.array(a), tree)


# ------------------------------------------------------------------------------------ loss scale
def test_loss_scale_growth_backoff_and_clamp():
    ls = DynamicLossScale.create()
    assert float(ls.scale) == 2.0 ** 16 and int(ls.good_steps) == 0
    upd = jax.jit(update_loss_scale)
    for _ in range(1999):
        ls = upd(ls, jnp.asarray(True))
    assert float(ls.scale) == 2.0 ** 16 and int(ls.good_steps) == 1999
    ls = upd(ls, jnp.asarray(True))
    assert float(ls.scale) == 2.0 ** 17 and int(ls.good_steps) == 0
    ls = upd(ls, jnp.asarray(False))
    assert float(ls.scale) == 2.0 ** 16 and int(ls.good_steps) == 0
    low = DynamicLossScale(jnp.asarray(1.0), jnp.asarray(0, jnp.int32))
    assert float(upd(low, jnp.asarray(False)).scale) == 1.0                 # clamped at 1
    high = DynamicLossScale(jnp.asarray(2.0 ** 24), jnp.asarray(1999, jnp.int32))
    assert float(upd(high, jnp.asarray(True)).scale) == 2.0 ** 24           # clamped at 2^24
    with pytest.raises(ValueError, match="initial_scale"):
        DynamicLossScale.create(0.5)


@pytest.mark.parametrize("poison,opt", [(np.inf, "optax"), (np.nan, "fused")])
def test_f16_overflow_step_is_skipped_bit_identically(poison, opt):
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(0))
    opt = optax.adamw(1e-2) if opt == "optax" else fused_adamw(1e-2)
    step = make_train_step(model, opt, precision="f16", clip_max_norm=1.0, donate=False)
    state = TrainState.create(model, opt, 4, precision="f16")
    state = state.replace(loss_scale=DynamicLossScale(jnp.asarray(8.0), jnp.asarray(5, jnp.int32)))
    x, d = data(0)
    state, m = step(state, {"inputs": x, "d_out": d * 1e-3})
    assert not bool(m["overflow_skipped"]) and int(m["step"]) == 1
    before = snapshot(state)
    state2, m2 = step(state, {"inputs": x, "d_out": d.at[1, 3, 2].set(poison)})
    assert bool(m2["overflow_skipped"]) and float(m2["loss_scale"]) == 8.0
    assert leaves_equal(state2.params, before.params)
    assert leaves_equal(state2.opt_state, before.opt_state)
    assert int(state2.step) == 1
    assert float(state2.loss_scale.scale) == 4.0 and int(state2.loss_scale.good_steps) == 0


def _delayed_copy_run(prec):
    """(mean loss of the first 10 steps, of the last 10, the last metrics) of 150 steps on the delayed copy."""
    model = Mamba1Backbone(Mamba1Config(d_model=16, n_layers=1, d_state=4, input_dim=3), rngs=nnx.Rngs(0))
    opt = optax.adam(1e-2)
    state = TrainState.create(model, opt, 8, precision=prec)
    step = make_train_step(model, opt, precision=prec, loss_fn=mse_first_feature)
    r = np.random.default_rng(0)
    losses = []
    for _ in range(150):
        state = state.reset_recurrent_state()
        state, m = step(state, delayed_copy_batch(r))
        losses.append(float(m["loss"]))
    return np.mean(losses[:10]), np.mean(losses[-10:]), m


_F32_RUN = []   # the float32 run, shared by both precisions' cases


@pytest.mark.parametrize("precision", ["bf16", "f16"])
def test_reduced_precision_training_lowers_the_loss_like_f32(precision):
    if not _F32_RUN:
        _F32_RUN.append(_delayed_copy_run("f32"))
    f0, f1, _ = _F32_RUN[0]
    p0, p1, m = _delayed_copy_run(precision)
    assert p1 < 0.3 * p0, f"{precision}: {p0:.4f} -> {p1:.4f}"
    assert p1 < 2.0 * f1 + 0.02, f"{precision} ends at {p1:.4f}, f32 at {f1:.4f}"
    if precision == "f16":
        assert "loss_scale" in m and "overflow_skipped" in m


# ------------------------------------------------------------------------------------ clipping
@pytest.mark.parametrize("max_norm,norm_impl", [(1e-3, "xla"), (1e6, "xla"), (1e-3, "pallas")],
                         ids=["clipped", "unclipped", "clipped-pallas-norm"])
def test_clipping_matches_hand_computation(max_norm, norm_impl):
    """The step's global norm (`jmamba.ops.sum_of_squares`, the automatic per-leaf XLA sums or the
    one-launch Pallas kernel, interpreted here) and the clipped gradients against float64 by hand."""
    with dispatch.prefer("sum_of_squares", norm_impl):
        _check_clipping(max_norm)


def _check_clipping(max_norm):
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(1))
    x, d = data(1)
    # gradients by hand: vjp of the model outputs with d_out
    graphdef, params = nnx.split(model, nnx.Param)
    _, vjp = jax.vjp(lambda p: nnx.merge(graphdef, p)(x)[0], params)
    (g,) = vjp(d)
    g = [np.asarray(a, np.float64) for a in jax.tree.leaves(g)]
    norm = np.sqrt(sum((a * a).sum() for a in g))
    coef = max_norm / (norm + 1e-6)
    want = [a * min(coef, 1.0) for a in g]

    # an "optimizer" that stores the gradient it receives in its state
    capture = gradient_capture()
    state = TrainState.create(model, capture, 4)
    step = make_train_step(model, capture, clip_max_norm=max_norm, donate=False)
    new, m = step(state, {"inputs": x, "d_out": d})
    assert abs(float(m["grad_norm"]) - norm) <= 1e-5 * norm
    got = jax.tree.leaves(new.opt_state)
    for a, b in zip(got, want):
        assert_close("clipped gradient", a, b, 1e-4)


# --------------------------------------------------------------------------------- accumulation
def mse(y, t):
    return jnp.mean((y - t) ** 2)


def test_two_half_batches_accumulated_equal_one_full_batch():
    """Two micro-batches of B/2 (loss scaled by 1/2) equal one batch of B, f32, to 1e-5 relative."""
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(2))
    x, t = data(2, bsz=8)
    for opt in (optax.sgd(0.5),):
        full = TrainState.create(model, opt, 8)
        full_step = make_train_step(model, opt, loss_fn=lambda y, b: mse(y, b["t"]), clip_max_norm=0.05,
                                    donate=False)
        want, m_full = full_step(full, {"inputs": x, "t": t})

        state = TrainState.create(model, opt, 4, accumulate=True)
        for half, last in ((slice(0, 4), False), (slice(4, 8), True)):
            state = state.reset_recurrent_state()     # both halves start from zero state, like the full batch
            out, ctx, state = forward(model, state, {"inputs": x[half]})
            d_out = jax.grad(lambda y: 0.5 * mse(y, t[half]))(out)     # the loss lives outside the library
            state, m = backward_step(opt, state, ctx, d_out, clip_max_norm=0.05 if last else None,
                                     accumulate_only=not last)
            if not last:
                assert state.accumulating and int(state.step) == 0 and set(m) == {"skipped"} and not bool(m["skipped"])
        assert not state.accumulating and int(state.step) == 1
        assert_close("grad_norm", m["grad_norm"], m_full["grad_norm"], 1e-5)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(want.params)):
            assert_close("params", a, b, 1e-5)
        assert all(float(jnp.abs(a).max()) == 0 for a in jax.tree.leaves(state.grad_accum))


# ------------------------------------------------------------------------------------ split API
@pytest.mark.parametrize("precision,opt", [("f32", "optax"), ("bf16", "optax"), ("f32", "fused")])
def test_split_api_is_bit_identical_to_the_fused_step(precision, opt):
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(3))
    opt = optax.adamw(1e-2) if opt == "optax" else fused_adamw(1e-2)
    fused = make_train_step(model, opt, precision=precision, clip_max_norm=1.0)
    s_fused = TrainState.create(model, opt, 4, precision=precision)
    s_split = TrainState.create(model, opt, 4, precision=precision)
    for i in range(3):
        x, d = data(10 + i)
        s_fused, m_fused = fused(s_fused, {"inputs": x, "d_out": d})
        out, ctx, s_split = forward(model, s_split, {"inputs": x}, precision=precision)
        assert out.dtype == jnp.float32 and out.shape == (4, 10, CFG.d_model)
        s_split, m_split = backward_step(opt, s_split, ctx, d, clip_max_norm=1.0)
    assert leaves_equal(s_fused, s_split)
    assert float(m_fused["grad_norm"]) == float(m_split["grad_norm"])


def test_split_api_refusals_change_nothing():
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(4))
    opt = optax.adamw(1e-2)
    state = TrainState.create(model, opt, 4, accumulate=True)
    x, d = data(4)
    with pytest.raises(RuntimeError, match="without its forward"):
        from jmamba.training.split import ForwardContext
        backward_step(opt, state, ForwardContext(None, (4, 10, 16), "f32", -1), d)
    out, ctx, pending = forward(model, state, {"inputs": x})
    before = snapshot(pending)
    with pytest.raises(ValueError, match="d_out must have the shape"):
        backward_step(opt, pending, ctx, d[:, :5])
    with pytest.raises(ValueError, match="clip_max_norm with accumulate_only"):
        backward_step(opt, pending, ctx, d, clip_max_norm=1.0, accumulate_only=True)
    with pytest.raises(RuntimeError, match="another forward is pending"):
        forward(model, pending, {"inputs": x})
    with pytest.raises(RuntimeError, match="split-API forward is pending"):
        make_train_step(model, opt)(pending, {"inputs": x, "d_out": d})
    assert leaves_equal(pending, before) and not ctx.consumed
    done, _ = backward_step(opt, pending, ctx, d)
    with pytest.raises(RuntimeError, match="second backward"):
        backward_step(opt, pending, ctx, d)
    with pytest.raises(RuntimeError, match="no pending forward"):
        _, ctx2, _ = forward(model, done, {"inputs": x})
        backward_step(opt, done, ctx2, d)
    assert int(done.step) == 1


def test_accumulation_refusals():
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(5))
    opt = optax.sgd(0.1)
    x, d = data(5)
    no_acc = TrainState.create(model, opt, 4)
    _, ctx, s = forward(model, no_acc, {"inputs": x})
    with pytest.raises(ValueError, match="accumulate=True"):
        backward_step(opt, s, ctx, d, accumulate_only=True)
    f16 = TrainState.create(model, opt, 4, precision="f16", accumulate=True)
    _, ctx, s = forward(model, f16, {"inputs": x}, precision="f16")
    with pytest.raises(ValueError, match="float16"):
        backward_step(opt, s, ctx, d, accumulate_only=True)
    acc = TrainState.create(model, opt, 4, accumulate=True)
    _, ctx, s = forward(model, acc, {"inputs": x})
    s, _ = backward_step(opt, s, ctx, d, accumulate_only=True)
    with pytest.raises(RuntimeError, match="accumulation window is open"):
        make_train_step(model, opt)(s, {"inputs": x, "d_out": d})


def test_f16_needs_a_loss_scale_and_metrics_per_mode():
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(6))
    opt = optax.sgd(0.1)
    x, d = data(6)
    with pytest.raises(ValueError, match="precision='f16'"):
        make_train_step(model, opt, precision="f16")(TrainState.create(model, opt, 4), {"inputs": x, "d_out": d})
    _, m = make_train_step(model, opt, loss_fn=lambda y, b: jnp.mean(y ** 2))(
        TrainState.create(model, opt, 4), {"inputs": x})
    guard = {"skipped", "consecutive_skips", "state_rows_reset"}
    assert set(m) == {"step", "updates", "loss", "grad_norm"} | guard
    _, m = make_train_step(model, opt, precision="f16", clip_max_norm=1.0)(
        TrainState.create(model, opt, 4, precision="f16"), {"inputs": x, "d_out": d})
    assert set(m) == {"step", "updates", "grad_norm", "loss_scale", "overflow_skipped"} | guard
    with pytest.raises(ValueError, match="clip_max_norm"):
        make_train_step(model, opt, clip_max_norm=-1.0)


def test_fused_adamw_in_the_train_step_matches_optax_adamw():
    """Clip + fused AdamW (factors folded into the kernel pass) == clip + optax.adamw, 10 steps."""
    model = Mamba1Backbone(CFG, rngs=nnx.Rngs(7))
    states = {}
    for name, opt in (("optax", optax.adamw(1e-2, weight_decay=0.1)), ("fused", fused_adamw(1e-2, weight_decay=0.1))):
        state = TrainState.create(model, opt, 4)
        step = make_train_step(model, opt, clip_max_norm=0.5)
        for i in range(10):
            x, d = data(20 + i)
            state, m = step(state, {"inputs": x, "d_out": d})
        states[name] = state
    for a, b in zip(jax.tree.leaves(states["fused"].params), jax.tree.leaves(states["optax"].params)):
        assert_close("params", a, b, 1e-5)
    assert int(states["fused"].step) == 10
