"""mamba3_siso_step (one decode token of the Mamba-3 SISO scan): each step and a sequence of T steps
vs the independent float64 numpy model and vs the scan op on the same window; resets, groups, odd
sizes, shared / per-head angles, bf16/f32, gradients (vs numpy's adjoint and float64 finite
differences), bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_mamba3 as npm
from builders import MAMBA3_TIME_ARRAYS, at_time, mamba3_numpy_window, mamba3_scan_inputs
from helpers import assert_close, assert_directional_gradients
from jmamba.ops import Mamba3ScanState, Mamba3ScanTuning, mamba3_siso_scan, mamba3_siso_step

f32 = jnp.float32
TOL = {f32: 2e-5, jnp.bfloat16: 2.5e-2}
STATES = Mamba3ScanState._fields
FIXED = ("Q_bias", "K_bias", "D")


def zero_state(arrays):
    bsz, _, H, P = arrays["V"].shape
    N, S = arrays["Q"].shape[-1], arrays["Angles"].shape[-1]
    return Mamba3ScanState(jnp.zeros((bsz, H, S), f32), jnp.zeros((bsz, H, P, N), f32), jnp.zeros((bsz, H, N), f32),
                           jnp.zeros((bsz, H, P), f32))


def run_steps(arrays, state, reset, *, impl="reference"):
    """The window one token at a time (a lax.scan over mamba3_siso_step): (out [Bt,T,H,P], final state).
    A missing state starts from zeros; the [Bt, T] reset mask becomes one [Bt] mask per step."""
    bsz, T = arrays["V"].shape[:2]
    tokens = {k: jnp.moveaxis(arrays[k], 1, 0) for k in MAMBA3_TIME_ARRAYS if arrays[k] is not None}
    resets = jnp.zeros((T, bsz), bool) if reset is None else jnp.asarray(reset).T

    def body(state, xs):
        token, r = xs
        out, state = mamba3_siso_step(**token, **{k: arrays[k] for k in FIXED}, initial_state=state, reset=r,
                                      implementation=impl)
        return state, out

    final, outs = jax.lax.scan(body, zero_state(arrays) if state is None else state, (tokens, resets))
    return jnp.moveaxis(outs, 0, 1), final


CASES = {  # name: ((Bt, T, H, G, N, P, S), options of mamba3_scan_inputs, reset positions)
    "groups-states-reset": ((2, 9, 4, 2, 8, 3, 2), dict(), [(0, 0), (1, 4), (1, 6)]),
    # odd sizes: N = 6 with one rotated pair, P = 3, 3 heads in 3 groups; angles shared by the heads
    "odd-shared-angles": ((3, 5, 3, 3, 6, 3, 1), dict(per_head_angles=False), []),
    # no z (the is_outproj_norm call), no D, fresh sequence, all N dims rotated
    "bare-fresh-fullrope": ((1, 7, 2, 1, 4, 5, 2), dict(with_z=False, with_D=False, with_states=False), []),
}


def case_inputs(case, dtype):
    shape, options, resets = CASES[case]
    arrays, state = mamba3_scan_inputs(shape, dtype, **options)
    reset = None
    if resets:
        mask = np.zeros(shape[:2], bool)
        for b, t in resets:
            mask[b, t] = True
        reset = jnp.asarray(mask)
    return arrays, state, reset


# Both registered implementations in float32; bf16 through the automatic choice.
@pytest.mark.parametrize("dtype,impl", [(f32, "reference"), (f32, "xla"), (jnp.bfloat16, None)],
                         ids=["f32-reference", "f32-xla", "bf16-auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_steps_equal_the_numpy_model_and_the_scan(case, dtype, impl):
    arrays, state, reset = case_inputs(case, dtype)
    out, final = jax.jit(lambda a, s, r: run_steps(a, s, r, impl=impl))(arrays, state, reset)
    want_out, want_final, _ = mamba3_numpy_window(arrays, state, reset)
    assert out.dtype == dtype and out.shape == arrays["V"].shape
    assert isinstance(final, Mamba3ScanState) and all(s.dtype == f32 for s in final)
    assert_close("outputs of the steps vs numpy", out, want_out, TOL[dtype])
    for name, got, want in zip(STATES, final, want_final):
        assert_close(f"{name} state after the steps vs numpy", got, want, 2e-5 if name == "angle" else TOL[dtype])
    scan_out, scan_final = mamba3_siso_scan(**arrays, initial_state=state, reset=reset, return_final_state=True,
                                            implementation="xla", tuning=Mamba3ScanTuning(chunk_size=4))
    assert_close("steps vs the scan op", out, scan_out, 1e-5 if dtype == f32 else 8e-3)
    for name, got, want in zip(STATES, final, scan_final):
        assert_close(f"{name} state vs the scan op", got, want, 1e-5)


def test_one_step_is_the_scan_of_a_one_token_window():
    arrays, state = mamba3_scan_inputs((2, 1, 4, 2, 8, 3, 2), f32, seed=3)
    token = at_time(arrays, 0, MAMBA3_TIME_ARRAYS)
    reset = jnp.array([True, False])
    out, new = mamba3_siso_step(**token, initial_state=state, reset=reset)
    want_out, want_state = mamba3_siso_scan(**arrays, initial_state=state, reset=reset, return_final_state=True,
                                            implementation="reference")
    assert out.shape == (2, 4, 3)
    assert_close("out", out, want_out[:, 0], 1e-6)
    for name, got, want in zip(STATES, new, want_state):
        assert_close(f"{name} state", got, want, 1e-6)
    numpy_out, numpy_final, _ = mamba3_numpy_window(arrays, state, reset[:, None])
    assert_close("out vs numpy", out, numpy_out[:, 0], 2e-6)
    for name, got, want in zip(STATES, new, numpy_final):
        assert_close(f"{name} state vs numpy", got, want, 2e-6)


def test_no_initial_state_and_reset_both_start_from_zeros():
    arrays, state = mamba3_scan_inputs((2, 1, 2, 1, 4, 2, 1), f32, seed=4)
    token = at_time(arrays, 0, MAMBA3_TIME_ARRAYS)
    fresh = mamba3_siso_step(**token)
    reset = mamba3_siso_step(**token, initial_state=state, reset=jnp.array([True, True]))
    carried = mamba3_siso_step(**token, initial_state=state)
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(reset)):
        np.testing.assert_array_equal(a, b)
    assert float(jnp.abs(carried[0] - fresh[0]).max()) > 1e-3, "the carried state must matter"


def test_gradients_through_the_steps_equal_the_numpy_adjoint():
    """jax.grad through T chained steps (every array and all four initial states) = the hand-written
    adjoint of the numpy scan on the window."""
    arrays, state, reset = case_inputs("groups-states-reset", f32)
    r = np.random.default_rng(6)
    gout = r.normal(size=arrays["V"].shape)
    gfinal = [r.normal(size=s.shape) for s in state]

    def loss(arrays, state):
        out, final = run_steps(arrays, state, reset)
        return jnp.sum(out * gout) + sum(jnp.sum(f * g) for f, g in zip(final, gfinal))

    grads, state_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(arrays, state)
    _, _, cache = mamba3_numpy_window(arrays, state, reset)
    want = npm.scan_backward(cache, gout, gfinal)
    names = {"Q_bias": "Qb", "K_bias": "Kb", "Angles": "Ang", "z": "Z"}
    for k, g in grads.items():
        assert_close(f"d{k}", g, want[names.get(k, k)], 5e-5)
    for name, g in zip(STATES, state_grads):
        assert_close(f"d initial {name}", g, want[name], 5e-5)


def test_float64_finite_differences_of_one_step():
    arrays, state = mamba3_scan_inputs((2, 1, 4, 2, 6, 2, 2), f32, seed=7)
    with jax.enable_x64(True):
        token = {k: jnp.asarray(v, jnp.float64) for k, v in at_time(arrays, 0, MAMBA3_TIME_ARRAYS).items()}
        state64 = Mamba3ScanState(*(jnp.asarray(s, jnp.float64) for s in state))
        rng = np.random.default_rng(8)
        proj = jnp.asarray(rng.normal(size=(2, 4, 2)))

        def loss(token, state):
            out, new = mamba3_siso_step(**token, initial_state=state, reset=jnp.array([False, True]))
            return jnp.sum(out * proj) + 0.3 * sum(jnp.sum(jnp.sin(s)) for s in new)

        checked = assert_directional_gradients(loss, (token, state64), rng)
        assert checked == 2 * (len(token) + 4)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("mutate,err,match", [
    (lambda a: a.update(V=a["V"][0]), ValueError, r"V must have shape \[batch, nheads, headdim\]"),
    (lambda a: a.update(Q=a["Q"][:1]), ValueError, r"Q must have shape \[batch, ngroups, d_state\]"),
    (lambda a: a.update(Q=jnp.ones((2, 3, 8)), K=jnp.ones((2, 3, 8))), ValueError, "number of groups"),
    (lambda a: a.update(K=a["K"][..., :-2]), ValueError, "K must have shape"),
    (lambda a: a.update(ADT=a["ADT"][:, :2]), ValueError, "ADT must have shape"),
    (lambda a: a.update(DT=a["DT"][None]), ValueError, "DT must have shape"),
    (lambda a: a.update(Trap=a["Trap"][..., None]), ValueError, "Trap must have shape"),
    (lambda a: a.update(Q_bias=a["Q_bias"][:2]), ValueError, "Q_bias must have shape"),
    (lambda a: a.update(K_bias=a["K_bias"].T), ValueError, "K_bias must have shape"),
    (lambda a: a.update(Angles=jnp.ones((2, 5))), ValueError, "num_angles .* at most d_state/2"),
    (lambda a: a.update(Angles=jnp.ones((2, 3, 2))), ValueError, "Angles must have shape"),
    (lambda a: a.update(D=jnp.ones((3,))), ValueError, "D must have shape"),
    (lambda a: a.update(z=a["z"][..., :2]), ValueError, "z must have shape"),
    (lambda a: a.update(V=a["V"].astype(jnp.int32)), TypeError, "V must be a floating"),
    (lambda a: a.update(initial_state=a["initial_state"][:3]), ValueError, "initial_state must be a Mamba3ScanState"),
    (lambda a: a.update(initial_state=a["initial_state"]._replace(k=a["initial_state"].k[..., :3])),
     ValueError, r"initial_state\.k must have shape"),
    (lambda a: a.update(reset=jnp.ones((2, 1), bool)), ValueError, r"reset must have shape \[batch\]"),
    (lambda a: a.update(reset=jnp.ones((2,), jnp.float32)), TypeError, "reset must be a bool"),
    (lambda a: a.update(implementation="pallas"), NotImplementedError, "no 'pallas' implementation"),
    (lambda a: a.update(implementation="cuda"), ValueError, "implementation must be"),
])
def test_bad_input_raises_naming_the_argument(mutate, err, match):
    arrays, state = mamba3_scan_inputs((2, 1, 4, 2, 8, 3, 2), f32)
    kw = dict(at_time(arrays, 0, MAMBA3_TIME_ARRAYS), initial_state=state)
    mutate(kw)
    with pytest.raises(err, match=match):
        mamba3_siso_step(**kw)
