"""selective_scan_step (one decode token of the Mamba-1 selective scan): each step and a sequence of
T steps vs the independent float64 numpy model and vs the scan op on the same window; resets,
groups, odd sizes, bf16/f32, gradients (vs numpy's adjoint and float64 finite differences), bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_mamba1 as npm
from builders import MAMBA1_TIME_ARRAYS, at_time, mamba1_numpy_window, mamba1_scan_inputs
from helpers import assert_close, assert_directional_gradients
from jmamba.ops import SelectiveScanState, selective_scan, selective_scan_step

f32 = jnp.float32
TOL = {f32: 2e-5, jnp.bfloat16: 2.5e-2}
PARAMS = ("A", "D", "delta_bias")


def run_steps(kw, reset, *, impl="reference", softplus=True):
    """The window of `kw` one token at a time: a lax.scan over selective_scan_step.

    Returns (out [Bt, T, d], final SelectiveScanState). A missing initial state starts from zeros;
    the [Bt, T] reset mask becomes one [Bt] mask per step."""
    bsz, T, d = kw["u"].shape
    n = kw["A"].shape[1]
    tokens = {k: jnp.moveaxis(kw[k], 1, 0) for k in MAMBA1_TIME_ARRAYS if kw[k] is not None}
    resets = jnp.zeros((T, bsz), bool) if reset is None else jnp.asarray(reset).T
    state0 = kw["initial_state"] or SelectiveScanState(jnp.zeros((bsz, d, n), f32))

    def body(state, xs):
        token, r = xs
        out, state = selective_scan_step(**token, **{k: kw[k] for k in PARAMS}, initial_state=state, reset=r,
                                         delta_softplus=softplus, implementation=impl)
        return state, out

    state, outs = jax.lax.scan(body, state0, (tokens, resets))
    return jnp.moveaxis(outs, 0, 1), state


CASES = {  # name: (shape (Bt, T, d, n, g), options of mamba1_scan_inputs)
    "groups-reset": ((2, 13, 6, 4, 3), dict(reset_prob=0.15, forced_resets=[(0, 0), (1, 7)])),
    "odd-ungrouped-bare": ((3, 6, 5, 3, 1), dict(grouped=False, with_D=False, with_z=False, with_bias=False)),
    "fresh-no-state": ((1, 9, 4, 2, 2), dict(with_h0=False)),
}


# Both registered implementations in float32; bf16 through the automatic choice.
@pytest.mark.parametrize("dtype,impl", [(f32, "reference"), (f32, "xla"), (jnp.bfloat16, None)],
                         ids=["f32-reference", "f32-xla", "bf16-auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_steps_equal_the_numpy_model_and_the_scan(case, dtype, impl):
    shape, options = CASES[case]
    kw, reset = mamba1_scan_inputs(shape, dtype, **options)
    out, state = jax.jit(lambda kw, reset: run_steps(kw, reset, impl=impl))(kw, reset)
    want_out, want_h, _ = mamba1_numpy_window(kw, reset)
    assert out.dtype == dtype and out.shape == kw["u"].shape
    assert isinstance(state, SelectiveScanState) and state.ssm.dtype == f32
    assert_close("outputs of the steps vs numpy", out, want_out, TOL[dtype])
    assert_close("state after the steps vs numpy", state.ssm, want_h, TOL[dtype])
    scan_out, scan_state = selective_scan(**kw, delta_softplus=True, reset=reset, return_final_state=True,
                                          implementation="xla")
    # the same float32 recurrence: only the rounding of out to dtype can differ
    assert_close("steps vs the scan op", out, scan_out, 1e-5 if dtype == f32 else 8e-3)
    assert_close("state vs the scan op", state.ssm, scan_state.ssm, 1e-5)


@pytest.mark.parametrize("softplus", [True, False])
def test_one_step_is_the_scan_of_a_one_token_window(softplus):
    kw, _ = mamba1_scan_inputs((2, 1, 6, 4, 2), f32, seed=3)
    token = at_time(kw, 0, MAMBA1_TIME_ARRAYS)
    reset = jnp.array([False, True])
    out, state = selective_scan_step(**token, delta_softplus=softplus, reset=reset)
    want_out, want_state = selective_scan(**kw, delta_softplus=softplus, reset=reset, return_final_state=True,
                                          implementation="reference")
    assert out.shape == (2, 6) and state.ssm.shape == (2, 6, 4)
    assert_close("out", out, want_out[:, 0], 1e-6)
    assert_close("state", state.ssm, want_state.ssm, 1e-6)
    numpy_out, numpy_h, _ = mamba1_numpy_window(kw, reset[:, None], softplus)
    assert_close("out vs numpy", out, numpy_out[:, 0], 2e-6)
    assert_close("state vs numpy", state.ssm, numpy_h, 2e-6)


def test_no_initial_state_and_reset_both_start_from_zeros():
    kw, _ = mamba1_scan_inputs((2, 1, 4, 3, 1), f32, seed=4)
    token = at_time(kw, 0, MAMBA1_TIME_ARRAYS)
    fresh = selective_scan_step(**dict(token, initial_state=None), delta_softplus=True)
    reset = selective_scan_step(**token, delta_softplus=True, reset=jnp.array([True, True]))
    carried = selective_scan_step(**token, delta_softplus=True)
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(reset)):
        np.testing.assert_array_equal(a, b)
    assert float(jnp.abs(carried[0] - fresh[0]).max()) > 1e-3, "the carried state must matter"


def test_gradients_through_the_steps_equal_the_numpy_adjoint():
    """jax.grad through T chained steps (every array, the initial state included) = the hand-written
    adjoint of the numpy scan on the window."""
    kw, reset = mamba1_scan_inputs((2, 7, 6, 3, 2), f32, seed=5, forced_resets=[(1, 4)])
    r = np.random.default_rng(6)
    gout = r.normal(size=kw["u"].shape)
    glast = r.normal(size=kw["initial_state"].ssm.shape)

    def loss(kw):
        out, state = run_steps(kw, reset)
        return jnp.sum(out * gout) + jnp.sum(state.ssm * glast)

    grads = jax.jit(jax.grad(loss))(kw)
    _, _, cache = mamba1_numpy_window(kw, reset)
    want = npm.scan_backward(cache, gout, glast)
    want["initial_state"] = want.pop("h0")
    got = dict(grads, initial_state=grads["initial_state"].ssm)
    for k, w in want.items():
        assert_close(f"d{k}", got[k], w, 4e-5)


def test_float64_finite_differences_of_one_step():
    kw, _ = mamba1_scan_inputs((2, 1, 4, 3, 2), f32, seed=7)
    with jax.enable_x64(True):
        token = {k: None if v is None else jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), v)
                 for k, v in at_time(kw, 0, MAMBA1_TIME_ARRAYS).items()}
        names = [k for k, v in token.items() if v is not None]
        rng = np.random.default_rng(8)
        proj = jnp.asarray(rng.normal(size=(2, 4)))

        def loss(*vals):
            out, state = selective_scan_step(**dict(zip(names, vals)), delta_softplus=True,
                                             reset=jnp.array([False, True]))
            return jnp.sum(out * proj) + jnp.sum(jnp.sin(state.ssm))

        checked = assert_directional_gradients(loss, [token[k] for k in names], rng)
        assert checked == 2 * len(names)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("mutate,err,match", [
    (lambda a: a.update(u=a["u"][0]), ValueError, r"u must have shape \[batch, d\]"),
    (lambda a: a.update(delta=a["delta"][:, :-1]), ValueError, "delta must have shape"),
    (lambda a: a.update(A=a["A"][:-1]), ValueError, "A must have shape"),
    (lambda a: a.update(B=a["B"][..., :-1]), ValueError, "B must have shape"),
    (lambda a: a.update(C=jnp.ones((2, 3, 4))), ValueError, "same number of groups"),
    (lambda a: a.update(B=jnp.ones((2, 4, 4)), C=jnp.ones((2, 4, 4))), ValueError, "groups .* must divide d"),
    (lambda a: a.update(D=jnp.ones((5,))), ValueError, "D must have shape"),
    (lambda a: a.update(delta_bias=jnp.ones((6, 1))), ValueError, "delta_bias must have shape"),
    (lambda a: a.update(z=jnp.ones((2, 5))), ValueError, "z must have shape"),
    (lambda a: a.update(u=a["u"].astype(jnp.int32)), TypeError, "u must be a floating"),
    (lambda a: a.update(initial_state=SelectiveScanState(jnp.ones((2, 6, 5)))), ValueError,
     r"initial_state\.ssm must have shape"),
    (lambda a: a.update(initial_state=[jnp.ones((2, 6, 4))]), TypeError, "initial_state must be a jmamba.ops.SelectiveScanState"),
    (lambda a: a.update(reset=jnp.ones((2, 3), bool)), ValueError, r"reset must have shape \[batch\]"),
    (lambda a: a.update(reset=jnp.ones((2,), jnp.int32)), TypeError, "reset must be a bool"),
    (lambda a: a.update(delta_softplus="yes"), TypeError, "delta_softplus must be a bool"),
    (lambda a: a.update(implementation="pallas"), NotImplementedError, "no 'pallas' implementation"),
    (lambda a: a.update(implementation="cuda"), ValueError, "implementation must be"),
])
def test_bad_input_raises_naming_the_argument(mutate, err, match):
    kw, _ = mamba1_scan_inputs((2, 1, 6, 4, 2), f32)
    kw = dict(at_time(kw, 0, MAMBA1_TIME_ARRAYS), delta_softplus=True)
    mutate(kw)
    with pytest.raises(err, match=match):
        selective_scan_step(**kw)
