"""mamba3_siso_scan: reference and xla vs the independent numpy algorithm (values, final states and
every cotangent, the four initial states included), chunking, resets, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_mamba3 as npm
from helpers import assert_close
from jmamba.ops import dispatch, mamba3_siso_scan

ARRAYS = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z")
STATES = ("angle", "ssm", "k", "v")
# name: (Bt, T, H, G, N, P, S, per-head angles, chunk_size, with Z, with initial states, with reset)
CASES = {
    # T = 13 is not a multiple of the chunk (4); G = 2 groups of 2 heads; S = N/4 (rope_fraction 0.5)
    "groups-states-reset": (2, 13, 4, 2, 8, 3, 2, True, 4, True, True, True),
    # T = 1; S = N/2 (rope_fraction 1.0); no Z (the is_outproj_norm call); fresh sequence
    "T1-fullrope-noZ": (2, 1, 2, 1, 6, 4, 3, False, 64, False, False, False),
}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2.5e-2}


def make_inputs(case, dtype, seed=0):
    """(kwargs of jnp arrays, initial states or None, reset or None). Activations in `dtype`."""
    bsz, T, H, G, N, P, S, per_head, _, with_z, with_states, with_reset = case
    r = np.random.default_rng(seed)
    dt = np.exp(r.uniform(np.log(1e-3), np.log(0.5), (bsz, T, H)))
    a = dict(Q=r.normal(size=(bsz, T, G, N)), K=r.normal(size=(bsz, T, G, N)), V=r.normal(size=(bsz, T, H, P)),
             ADT=-r.uniform(1, 4, (bsz, T, H)) * dt, DT=dt, Trap=r.normal(size=(bsz, T, H)),
             Q_bias=r.normal(size=(H, N)), K_bias=r.normal(size=(H, N)),
             Angles=r.normal(size=(bsz, T, H, S) if per_head else (bsz, T, S)), D=r.normal(size=(H,)),
             Z=r.normal(size=(bsz, T, H, P)) if with_z else None)
    low = ("Q", "K", "V", "Z", "Trap")      # activations; the rest stays float32 as in the mixer
    kw = {k: None if v is None else jnp.asarray(v, dtype if k in low else jnp.float32) for k, v in a.items()}
    states = None
    if with_states:
        states = (jnp.asarray(r.uniform(0, 2 * np.pi, (bsz, H, S)), jnp.float32),
                  jnp.asarray(r.normal(size=(bsz, H, P, N)), jnp.float32),
                  jnp.asarray(r.normal(size=(bsz, H, N)), jnp.float32),
                  jnp.asarray(r.normal(size=(bsz, H, P)), jnp.float32))
    reset = None
    if with_reset:
        reset = np.zeros((bsz, T), bool)
        reset[0, 4] = reset[1, 7] = reset[1, 9] = True     # 4: a chunk boundary; 7, 9: inside chunks
        reset = jnp.asarray(reset)
    return kw, states, reset


def numpy_ref(kw, states, reset, gout, gfinal):
    a = {k: None if v is None else np.asarray(v.astype(jnp.float32), np.float64) for k, v in kw.items()}
    H = a["V"].shape[2]
    ang = a["Angles"]
    if ang.ndim == 3:
        ang = np.broadcast_to(ang[:, :, None], ang.shape[:2] + (H,) + ang.shape[2:])
    init = None if states is None else [np.asarray(s, np.float64) for s in states]
    out, final, cache = npm.scan_forward(a["Q"], a["K"], a["V"], a["ADT"], a["DT"], a["Trap"], a["Q_bias"], a["K_bias"],
                                         ang, a["D"], a["Z"], init, None if reset is None else np.asarray(reset))
    g = npm.scan_backward(cache, gout, gfinal)
    g["Q_bias"], g["K_bias"], g["Angles"] = g.pop("Qb"), g.pop("Kb"), g.pop("Ang")
    if a["Angles"].ndim == 3:
        g["Angles"] = g["Angles"].sum(2)      # the op broadcasts shared angles over heads
    return out, final, g


def run_vjp(impl, kw, states, reset, chunk_size, gout, gfinal):
    names = [k for k in ARRAYS if kw[k] is not None]

    @jax.jit
    def f(vals, states):
        return mamba3_siso_scan(**dict(zip(names, vals)), initial_states=states, return_final_states=True,
                                chunk_size=chunk_size, implementation=impl, reset=reset)

    (out, final), vjp = jax.vjp(f, [kw[k] for k in names], states)
    ct_vals, ct_states = vjp((gout.astype(out.dtype), type(final)(*gfinal)))
    return out, final, dict(zip(names, ct_vals)), ct_states


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("dtype,case", [(jnp.float32, "groups-states-reset"), (jnp.bfloat16, "groups-states-reset"),
                                        (jnp.float32, "T1-fullrope-noZ")], ids=["f32-full", "bf16-full", "f32-T1"])
def test_values_and_cotangents_match_numpy(impl, dtype, case):
    c = CASES[case]
    kw, states, reset = make_inputs(c, dtype)
    bsz, T, H, G, N, P, S = c[:7]
    r = np.random.default_rng(1)
    gout = jnp.asarray(r.normal(size=(bsz, T, H, P)), jnp.float32).astype(dtype).astype(jnp.float32)
    gfinal = [jnp.asarray(r.normal(size=s), jnp.float32) for s in ((bsz, H, S), (bsz, H, P, N), (bsz, H, N), (bsz, H, P))]
    out, final, grads, state_grads = run_vjp(impl, kw, states, reset, c[8], gout, gfinal)
    want_out, want_final, want = numpy_ref(kw, states, reset, np.asarray(gout, np.float64),
                                           [np.asarray(g, np.float64) for g in gfinal])
    tol = TOL[dtype]
    assert out.dtype == dtype and out.shape == (bsz, T, H, P)
    assert_close("out", out, want_out, tol)
    for name, got, w in zip(STATES, final, want_final):
        assert got.dtype == jnp.float32, name
        assert_close(f"final {name}", got, w, 2e-5 if name == "angle" else tol)
    for k, g in grads.items():
        assert g.dtype == kw[k].dtype, k
        assert_close(f"d{k}", g, want[k], tol * (3 if k in ("ADT", "DT", "Angles") else 1))
    assert set(grads) == {k for k in ARRAYS if kw[k] is not None}, "every array argument has a cotangent"
    if states is not None:
        for name, g in zip(STATES, state_grads):
            assert_close(f"d initial {name}", g, want[name], tol)


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 13, 64])
def test_xla_chunk_size_changes_nothing_but_rounding(chunk_size):
    """Chunks that do / don't divide T, a reset on a chunk boundary and inside chunks, T < chunk."""
    kw, states, reset = make_inputs(CASES["groups-states-reset"], jnp.float32, seed=2)
    out, final = jax.jit(lambda kw, s: mamba3_siso_scan(**kw, initial_states=s, return_final_states=True,
                                                        chunk_size=chunk_size, implementation="xla", reset=reset))(kw, states)
    want_out, want_final, _ = numpy_ref(kw, states, reset, np.zeros(out.shape), None)
    assert_close("out", out, want_out, 2e-5)
    for name, got, w in zip(STATES, final, want_final):
        assert_close(f"final {name}", got, w, 2e-5)


def test_reset_row_mask_equals_zero_initial_states():
    kw, states, _ = make_inputs(CASES["groups-states-reset"], jnp.float32, seed=3)
    rows = jnp.array([True, False])
    out, final = jax.jit(lambda kw, s: mamba3_siso_scan(**kw, initial_states=s, return_final_states=True,
                                                        chunk_size=4, implementation="xla", reset=rows))(kw, states)
    zeroed = [np.where(np.asarray(rows).reshape((2,) + (1,) * (s.ndim - 1)), 0.0, np.asarray(s)) for s in states]
    want_out, want_final, _ = numpy_ref(kw, zeroed, None, np.zeros(out.shape), None)
    assert_close("out", out, want_out, 2e-5)
    assert_close("final ssm", final.ssm, want_final[1], 2e-5)
    # and the states really mattered for the kept row
    fresh, _, _ = numpy_ref(kw, None, None, np.zeros(out.shape), None)
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
    kw, states, _ = make_inputs(CASES["groups-states-reset"], jnp.float32)
    kw = dict(kw, initial_states=states)
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
    (lambda a: a.update(Z=a["Z"][..., :2]), ValueError, "Z must have shape"),
    (lambda a: a.update(V=a["V"].astype(jnp.int32)), TypeError, "V must be a floating"),
    (lambda a: a.update(initial_states=a["initial_states"][:3]), ValueError, "initial_states must be a tuple"),
    (lambda a: a.update(initial_states={"ssm": 1}), ValueError, "initial_states must be a tuple"),
    (lambda a: a.update(initial_states=(a["initial_states"][0], a["initial_states"][1][:, :2]) + a["initial_states"][2:]),
     ValueError, r"initial_states.ssm must have shape"),
    (lambda a: a.update(initial_states=a["initial_states"][:3] + (None,)), TypeError, "initial_states.v"),
    (lambda a: a.update(reset=jnp.ones((2, 12), bool)), ValueError, "reset must have shape"),
    (lambda a: a.update(reset=jnp.ones((2,), jnp.float32)), TypeError, "reset must be a bool"),
    (lambda a: a.update(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (lambda a: a.update(chunk_size=4.0), ValueError, "chunk_size"),
    (lambda a: a.update(implementation="cuda"), ValueError, "implementation must be"),
])
def test_bad_input_raises_naming_the_argument(mutate, err, match):
    kw = _bad(mutate)
    with pytest.raises(err, match=match):
        mamba3_siso_scan(**kw)


def test_unregistered_pallas_is_refused_when_asked_for():
    kw, _, _ = make_inputs(CASES["T1-fullrope-noZ"], jnp.float32)
    if "pallas" in dispatch._REGISTRY.get("mamba3_siso_scan", {}):
        pytest.skip("a pallas implementation is registered")
    with pytest.raises(NotImplementedError, match="pallas"):
        mamba3_siso_scan(**kw, implementation="pallas")


def test_xla_large_log_decays_lose_no_precision():
    """A huge decay at the start of each chunk makes |cumsum(ADT)| ~ 1e4 inside the chunk; the
    decays between later positions must still be exact (no cs_i − cs_j cancellation)."""
    kw, states, _ = make_inputs(CASES["groups-states-reset"], jnp.float32, seed=6)
    kw["ADT"] = kw["ADT"].at[:, ::4].set(-1e4)
    out = jax.jit(lambda kw: mamba3_siso_scan(**kw, chunk_size=4, implementation="xla"))(kw)
    want_out, _, _ = numpy_ref(kw, None, None, np.zeros(out.shape), None)
    assert_close("out", out, want_out, 2e-5)
