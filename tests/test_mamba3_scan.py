"""mamba3_siso_scan: reference and xla vs the independent numpy algorithm (values, final states and
every cotangent, the four initial states included), chunking through `tuning`, resets, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_mamba3 as npm
from builders import MAMBA3_ARRAYS, mamba3_numpy_window, mamba3_scan_inputs, mamba3_state_shapes
from helpers import assert_close
from jmamba import ops
from jmamba.ops import Mamba3ScanState, Mamba3ScanTuning, mamba3_siso_scan

STATES = Mamba3ScanState._fields
# name: ((Bt, T, H, G, N, P, S), per-head angles, chunk_size, with z, with initial states, with reset)
CASES = {
    # T = 13 is not a multiple of the chunk (4); G = 2 groups of 2 heads; S = N/4 (rope_fraction 0.5)
    "groups-states-reset": ((2, 13, 4, 2, 8, 3, 2), True, 4, True, True, True),
    # T = 1; S = N/2 (rope_fraction 1.0); no z (the is_outproj_norm call); fresh sequence
    "T1-fullrope-noZ": ((2, 1, 2, 1, 6, 4, 3), False, 64, False, False, False),
}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2.5e-2}


def make_inputs(case, dtype, seed=0):
    """(arrays, initial state or None, reset or None) of a CASES entry."""
    shape, per_head, _, with_z, with_states, with_reset = case
    arrays, state = mamba3_scan_inputs(shape, dtype, per_head_angles=per_head, with_z=with_z,
                                       with_states=with_states, seed=seed)
    reset = None
    if with_reset:
        bsz, T = shape[:2]
        reset = np.zeros((bsz, T), bool)
        reset[0, 4] = reset[1, 7] = reset[1, 9] = True     # 4: a chunk boundary; 7, 9: inside chunks
        reset = jnp.asarray(reset)
    return arrays, state, reset


def numpy_ref(arrays, state, reset, gout, gfinal):
    out, final, cache = mamba3_numpy_window(arrays, state, reset)
    g = npm.scan_backward(cache, gout, gfinal)
    g["Q_bias"], g["K_bias"], g["Angles"] = g.pop("Qb"), g.pop("Kb"), g.pop("Ang")
    if "Z" in g:
        g["z"] = g.pop("Z")
    if arrays["Angles"].ndim == 3:
        g["Angles"] = g["Angles"].sum(2)      # the op broadcasts shared angles over heads
    return out, final, g


def run_vjp(impl, arrays, state, reset, chunk_size, gout, gfinal):
    names = [k for k in MAMBA3_ARRAYS if arrays[k] is not None]

    @jax.jit
    def f(vals, state):
        return mamba3_siso_scan(**dict(zip(names, vals)), initial_state=state, return_final_state=True,
                                tuning=Mamba3ScanTuning(chunk_size=chunk_size), implementation=impl, reset=reset)

    (out, final), vjp = jax.vjp(f, [arrays[k] for k in names], state)
    ct_vals, ct_state = vjp((gout.astype(out.dtype), Mamba3ScanState(*gfinal)))
    return out, final, dict(zip(names, ct_vals)), ct_state


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("dtype,case", [(jnp.float32, "groups-states-reset"), (jnp.bfloat16, "groups-states-reset"),
                                        (jnp.float32, "T1-fullrope-noZ")], ids=["f32-full", "bf16-full", "f32-T1"])
def test_values_and_cotangents_match_numpy(impl, dtype, case):
    c = CASES[case]
    arrays, state, reset = make_inputs(c, dtype)
    bsz, T, H, G, N, P, S = c[0]
    r = np.random.default_rng(1)
    gout = jnp.asarray(r.normal(size=(bsz, T, H, P)), jnp.float32).astype(dtype).astype(jnp.float32)
    gfinal = [jnp.asarray(r.normal(size=s), jnp.float32) for s in mamba3_state_shapes(c[0])]
    out, final, grads, state_grads = run_vjp(impl, arrays, state, reset, c[2], gout, gfinal)
    want_out, want_final, want = numpy_ref(arrays, state, reset, np.asarray(gout, np.float64),
                                           [np.asarray(g, np.float64) for g in gfinal])
    tol = TOL[dtype]
    assert out.dtype == dtype and out.shape == (bsz, T, H, P)
    assert isinstance(final, Mamba3ScanState)
    assert_close("out", out, want_out, tol)
    for name, got, w in zip(STATES, final, want_final):
        assert got.dtype == jnp.float32, name
        assert_close(f"final {name}", got, w, 2e-5 if name == "angle" else tol)
    for k, g in grads.items():
        assert g.dtype == arrays[k].dtype, k
        assert_close(f"d{k}", g, want[k], tol * (3 if k in ("ADT", "DT", "Angles") else 1))
    assert set(grads) == {k for k in MAMBA3_ARRAYS if arrays[k] is not None}, "every array argument has a cotangent"
    if state is not None:
        assert isinstance(state_grads, Mamba3ScanState)
        for name, g in zip(STATES, state_grads):
            assert_close(f"d initial {name}", g, want[name], tol)


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 13, 64])
def test_xla_chunk_size_changes_nothing_but_rounding(chunk_size):
    """Chunks that do / don't divide T, a reset on a chunk boundary and inside chunks, T < chunk."""
    arrays, state, reset = make_inputs(CASES["groups-states-reset"], jnp.float32, seed=2)
    out, final = jax.jit(lambda a, s: mamba3_siso_scan(
        **a, initial_state=s, return_final_state=True, tuning=Mamba3ScanTuning(chunk_size=chunk_size),
        implementation="xla", reset=reset))(arrays, state)
    want_out, want_final, _ = mamba3_numpy_window(arrays, state, reset)
    assert_close("out", out, want_out, 2e-5)
    for name, got, w in zip(STATES, final, want_final):
        assert_close(f"final {name}", got, w, 2e-5)


def test_tuning_block_and_keyword_reach_the_xla_implementation(monkeypatch):
    """The chunk size of a `jmamba.ops.tuning` block (or of `tuning=`, which wins) is the one the
    implementation runs with; the result changes only by rounding."""
    from jmamba.ops.mamba3_siso_scan import xla
    seen = []
    real = xla.mamba3_siso_scan_xla
    monkeypatch.setattr(xla, "mamba3_siso_scan_xla", lambda *a, tuning: seen.append(tuning.chunk_size) or real(*a, tuning=tuning))
    arrays, state, reset = make_inputs(CASES["groups-states-reset"], jnp.float32, seed=7)
    run = lambda **t: mamba3_siso_scan(**arrays, initial_state=state, reset=reset, implementation="xla", **t)   # noqa: E731
    default = run()
    with ops.tuning("mamba3_siso_scan", chunk_size=3):
        blocked = run()
        keyword = run(tuning=Mamba3ScanTuning(chunk_size=5))
    after = run()
    assert seen == [Mamba3ScanTuning().chunk_size, 3, 5, Mamba3ScanTuning().chunk_size]
    assert_close("chunk 3 vs default", blocked, default, 2e-6)
    assert_close("chunk 5 vs default", keyword, default, 2e-6)
    np.testing.assert_array_equal(after, default)


def test_bad_tuning_raises():
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        Mamba3ScanTuning(chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        Mamba3ScanTuning(chunk_size=4.0)
    with pytest.raises(ValueError, match=r"Mamba3ScanTuning has no field\(s\) \['xla_chunk_size'\]"):
        with ops.tuning("mamba3_siso_scan", xla_chunk_size=8):
            pass
    with pytest.raises(ValueError, match="op must be one of"):
        with ops.tuning("mamba2_scan", chunk_size=8):
            pass
    arrays, _, _ = make_inputs(CASES["T1-fullrope-noZ"], jnp.float32)
    with pytest.raises(TypeError, match="Mamba3ScanTuning"):
        mamba3_siso_scan(**arrays, tuning=ops.SelectiveScanTuning())


def test_reset_row_mask_equals_zero_initial_state():
    arrays, state, _ = make_inputs(CASES["groups-states-reset"], jnp.float32, seed=3)
    rows = jnp.array([True, False])
    out, final = jax.jit(lambda a, s: mamba3_siso_scan(
        **a, initial_state=s, return_final_state=True, tuning=Mamba3ScanTuning(chunk_size=4), implementation="xla",
        reset=rows))(arrays, state)
    zeroed = Mamba3ScanState(*(np.where(np.asarray(rows).reshape((2,) + (1,) * (s.ndim - 1)), 0.0, np.asarray(s))
                               for s in state))
    want_out, want_final, _ = mamba3_numpy_window(arrays, zeroed, None)
    assert_close("out", out, want_out, 2e-5)
    assert_close("final ssm", final.ssm, want_final[1], 2e-5)
    # and the states really mattered for the kept row
    fresh, _, _ = mamba3_numpy_window(arrays, None, None)
    assert np.abs(np.asarray(out[1]) - fresh[1]).max() > 1e-2


def test_numpy_adjoint_matches_finite_differences():
    """The numpy oracle's hand-written backward is itself checked (central differences, float64),
    with groups, per-head angles, D, Z, all four initial states, final-state cotangents and a reset."""
    r = np.random.default_rng(4)
    bsz, T, H, G, N, P, S = 1, 5, 4, 2, 6, 2, 2
    dt = np.exp(r.uniform(np.log(1e-2), np.log(0.5), (bsz, T, H)))
    a = dict(Q=r.normal(size=(bsz, T, G, N)), K=r.normal(size=(bsz, T, G, N)), V=r.normal(size=(bsz, T, H, P)),
             ADT=-r.uniform(1, 4, (bsz, T, H)) * dt, DT=dt, Trap=r.normal(size=(bsz, T, H)), Qb=r.normal(size=(H, N)),
             Kb=r.normal(size=(H, N)), Ang=r.normal(size=(bsz, T, H, S)), D=r.normal(size=H), Z=r.normal(size=(bsz, T, H, P)))
    init = dict(angle=r.uniform(0, 6, (bsz, H, S)), ssm=r.normal(size=(bsz, H, P, N)), k=r.normal(size=(bsz, H, N)),
                v=r.normal(size=(bsz, H, P)))
    reset = np.array([[False, False, False, True, False]])
    gout = r.normal(size=(bsz, T, H, P))
    gfin = [r.normal(size=init[k].shape) for k in STATES]

    def loss():
        out, fin, _ = npm.scan_forward(**a, init=[init[k] for k in STATES], reset=reset)
        return (out * gout).sum() + sum((f * g).sum() for f, g in zip(fin, gfin))

    _, _, cache = npm.scan_forward(**a, init=[init[k] for k in STATES], reset=reset)
    grads = npm.scan_backward(cache, gout, gfin)
    for name, arr in list(a.items()) + list(init.items()):
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + 1e-6
            lp = loss()
            arr[i] = old - 1e-6
            lm = loss()
            arr[i] = old
            num[i] = (lp - lm) / 2e-6
        assert_close(f"numpy d{name}", grads[name], num, 1e-6)


# ------------------------------------------------------------------------------------ bad input
def _bad(mutate):
    arrays, state, _ = make_inputs(CASES["groups-states-reset"], jnp.float32)
    kw = dict(arrays, initial_state=state)
    mutate(kw)
    return kw


@pytest.mark.parametrize("mutate,err,match", [
    (lambda a: a.update(V=a["V"][0]), ValueError, "V must have shape"),
    (lambda a: a.update(Q=a["Q"][:, :-1]), ValueError, "Q must have shape"),
    (lambda a: a.update(Q=jnp.ones((2, 13, 3, 8)), K=jnp.ones((2, 13, 3, 8))), ValueError, "groups"),
    (lambda a: a.update(K=a["K"][..., :-2]), ValueError, "K must have shape"),
    (lambda a: a.update(ADT=a["ADT"][:, :, :2]), ValueError, "ADT must have shape"),
    (lambda a: a.update(DT=a["DT"][:, :5]), ValueError, "DT must have shape"),
    (lambda a: a.update(Trap=a["Trap"][..., None]), ValueError, "Trap must have shape"),
    (lambda a: a.update(Q_bias=a["Q_bias"][:2]), ValueError, "Q_bias must have shape"),
    (lambda a: a.update(K_bias=a["K_bias"].T), ValueError, "K_bias must have shape"),
    (lambda a: a.update(Angles=jnp.ones((2, 13, 5))), ValueError, "num_angles .* at most d_state/2"),
    (lambda a: a.update(Angles=jnp.ones((2, 13, 3, 2))), ValueError, "Angles must have shape"),
    (lambda a: a.update(D=jnp.ones((3,))), ValueError, "D must have shape"),
    (lambda a: a.update(z=a["z"][..., :2]), ValueError, "z must have shape"),
    (lambda a: a.update(V=a["V"].astype(jnp.int32)), TypeError, "V must be a floating"),
    (lambda a: a.update(initial_state=a["initial_state"][:3]), ValueError, "initial_state must be a Mamba3ScanState"),
    (lambda a: a.update(initial_state={"ssm": 1}), ValueError, "initial_state must be a Mamba3ScanState"),
    (lambda a: a.update(initial_state=a["initial_state"]._replace(ssm=a["initial_state"].ssm[:, :2])),
     ValueError, r"initial_state\.ssm must have shape"),
    (lambda a: a.update(initial_state=a["initial_state"]._replace(v=None)), TypeError, r"initial_state\.v"),
    (lambda a: a.update(reset=jnp.ones((2, 12), bool)), ValueError, "reset must have shape"),
    (lambda a: a.update(reset=jnp.ones((2,), jnp.float32)), TypeError, "reset must be a bool"),
    (lambda a: a.update(return_final_state=1), TypeError, "return_final_state must be a bool"),
    (lambda a: a.update(implementation="cuda"), ValueError, "implementation must be"),
    (lambda a: a.update(chunk=4), TypeError, "unexpected keyword argument 'chunk'"),
])
def test_bad_input_raises_naming_the_argument(mutate, err, match):
    kw = _bad(mutate)
    with pytest.raises(err, match=match):
        mamba3_siso_scan(**kw)


def test_xla_large_log_decays_lose_no_precision():
    """A huge decay at the start of each chunk makes |cumsum(ADT)| ~ 1e4 inside the chunk; the
    decays between later positions must still be exact (no cs_i − cs_j cancellation)."""
    arrays, _, _ = make_inputs(CASES["groups-states-reset"], jnp.float32, seed=6)
    arrays["ADT"] = arrays["ADT"].at[:, ::4].set(-1e4)
    out = jax.jit(lambda a: mamba3_siso_scan(**a, tuning=Mamba3ScanTuning(chunk_size=4), implementation="xla"))(arrays)
    want_out, _, _ = mamba3_numpy_window(arrays, None, None)
    assert_close("out", out, want_out, 2e-5)
