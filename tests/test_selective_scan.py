"""selective_scan: reference and xla vs the independent numpy algorithm (values and every cotangent),
the state type, xla tuning, resets, bad input, jit/vmap and implementation choice."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_mamba1 as npm
from builders import mamba1_implementation_args, mamba1_numpy_window, mamba1_scan_inputs
from helpers import assert_close
from jmamba import ops
from jmamba.ops import SelectiveScanState, SelectiveScanTuning, dispatch, selective_scan
from jmamba.ops.selective_scan.reference import selective_scan_reference
from jmamba.ops.selective_scan.xla import selective_scan_xla

# (Bt, T, d, n, groups): T never a multiple of the chunk sizes, d not a power of two.
SHAPES = [(2, 37, 6, 4, 1), (1, 1, 3, 2, 1), (2, 13, 6, 5, 2), (3, 70, 10, 8, 5)]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2.5e-2}


def numpy_ref(kw, reset, gout, glast):
    """(out, final state, gradients keyed like kw) of the float64 numpy model."""
    out, h, cache = mamba1_numpy_window(kw, reset)
    grads = npm.scan_backward(cache, np.asarray(gout, np.float64), np.asarray(glast, np.float64))
    if kw["B"].ndim == 3:
        grads["B"], grads["C"] = grads["B"][:, :, 0], grads["C"][:, :, 0]
    grads["initial_state"] = grads.pop("h0")
    return out, h, grads


def run_vjp(impl, kw, reset, gout, glast):
    """(out, final state, cotangent per present argument); the state's cotangent is a SelectiveScanState."""
    names = [k for k, v in kw.items() if v is not None]

    def f(*vals):
        return selective_scan(**dict(zip(names, vals)), delta_softplus=True, return_final_state=True,
                              implementation=impl, reset=reset)

    (out, state), vjp = jax.vjp(f, *[kw[k] for k in names])
    cts = vjp((gout.astype(out.dtype), SelectiveScanState(glast)))
    return out, state, dict(zip(names, cts))


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_and_cotangents_match_numpy(impl, dtype, shape):
    kw, reset = mamba1_scan_inputs(shape, dtype, reset_prob=0.1 if shape[1] > 20 else 0.0)
    r = np.random.default_rng(1)
    gout = jnp.asarray(r.normal(size=kw["u"].shape), jnp.float32)
    glast = jnp.asarray(r.normal(size=(shape[0], shape[2], shape[3])), jnp.float32)
    out, state, grads = run_vjp(impl, kw, reset, gout, glast)
    want_out, want_h, want_grads = numpy_ref(kw, reset, np.asarray(gout.astype(dtype).astype(jnp.float32)), glast)
    tol = TOL[dtype]
    assert isinstance(state, SelectiveScanState)
    assert out.dtype == dtype and state.ssm.dtype == jnp.float32
    assert_close("out", out, want_out, tol)
    assert_close("final_state", state.ssm, want_h, tol)
    assert isinstance(grads["initial_state"], SelectiveScanState)
    grads["initial_state"] = grads["initial_state"].ssm
    for k, want in want_grads.items():
        assert grads[k].dtype == (jnp.float32 if k == "initial_state" else kw[k].dtype), k
        assert_close(f"d{k}", grads[k], want, tol * (4 if k in ("A", "delta", "delta_bias") else 1))
    assert set(grads) == set(want_grads), "every array argument has a cotangent"


@pytest.mark.parametrize("options", [
    dict(with_D=False, with_z=False, with_bias=False, with_h0=False),
    dict(with_D=True, with_z=False, with_bias=False, with_h0=False, grouped=False),
    dict(with_D=False, with_z=True, with_bias=True, with_h0=False, grouped=False),
], ids=["bare", "D-only-ungrouped", "z-bias-ungrouped"])
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_optional_arguments(impl, options):
    kw, reset = mamba1_scan_inputs((2, 19, 4, 3, 1), jnp.float32, **options)
    r = np.random.default_rng(2)
    gout = jnp.asarray(r.normal(size=kw["u"].shape), jnp.float32)
    glast = jnp.zeros((2, 4, 3), jnp.float32)
    out, state, grads = run_vjp(impl, kw, reset, gout, glast)
    want_out, want_h, want_grads = numpy_ref(kw, reset, gout, glast)
    assert_close("out", out, want_out, 2e-5)
    assert_close("final_state", state.ssm, want_h, 2e-5)
    for k, want in want_grads.items():
        if k in grads:
            assert_close(f"d{k}", grads[k], want, 1e-4)


def test_without_return_final_state_the_result_is_the_output_only():
    kw, _ = mamba1_scan_inputs((1, 5, 2, 2, 1), jnp.float32)
    out = selective_scan(**kw, delta_softplus=True, implementation="xla")
    both = selective_scan(**kw, delta_softplus=True, implementation="xla", return_final_state=True)
    assert isinstance(out, jax.Array) and out.shape == (1, 5, 2)
    np.testing.assert_array_equal(out, both[0])


# ------------------------------------------------------------------------------------------- tuning
@pytest.mark.parametrize("inner,chunk", [("associative", 8), ("associative", 64), ("sequential", 3)])
def test_xla_inner_modes_and_chunks(inner, chunk):
    """Both within-chunk strategies, chunk sizes that do and don't divide T, match the reference."""
    kw, reset = mamba1_scan_inputs((2, 29, 6, 4, 2), jnp.float32, reset_prob=0.1)
    u, delta, A, B, C, D, z, bias, h0 = mamba1_implementation_args(kw)
    xla = functools.partial(selective_scan_xla, delta_softplus=True,
                            tuning=SelectiveScanTuning(xla_chunk_size=chunk, xla_inner=inner))
    ref = functools.partial(selective_scan_reference, delta_softplus=True)

    def loss(impl, u, delta, B, C, h0):
        y, h = impl(u, delta, A, B, C, D, z, bias, h0, reset)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(h * h)

    args = (u, delta, B, C, h0)
    g_ref = jax.grad(functools.partial(loss, ref), argnums=range(5))(*args)
    g_xla = jax.grad(functools.partial(loss, xla), argnums=range(5))(*args)
    for name, a, b in zip(("u", "delta", "B", "C", "h0"), g_xla, g_ref):
        assert_close(f"d{name}", a, b, 1e-4)


def test_tuning_reaches_the_xla_implementation(monkeypatch):
    """`tuning=` and the `jmamba.ops.tuning` block both arrive at the implementation; another chunk
    size gives the same values to rounding; the keyword wins over the block."""
    from jmamba.ops.selective_scan import xla
    seen = []
    real = xla.selective_scan_xla
    monkeypatch.setattr(xla, "selective_scan_xla", lambda *a, tuning, **k: seen.append(tuning) or real(*a, tuning=tuning, **k))
    kw, reset = mamba1_scan_inputs((2, 11, 4, 3, 1), jnp.float32, reset_prob=0.2)
    run = lambda **t: selective_scan(**kw, delta_softplus=True, reset=reset, implementation="xla", **t)   # noqa: E731
    default = run()
    assert seen[-1] == SelectiveScanTuning()
    by_keyword = run(tuning=SelectiveScanTuning(xla_chunk_size=3, xla_inner="associative"))
    assert seen[-1] == SelectiveScanTuning(xla_chunk_size=3, xla_inner="associative")
    with ops.tuning("selective_scan", xla_chunk_size=5):
        by_block = run()
        assert seen[-1].xla_chunk_size == 5
        run(tuning=SelectiveScanTuning(xla_chunk_size=2))
        assert seen[-1].xla_chunk_size == 2
    run()
    assert seen[-1] == SelectiveScanTuning(), "the block's settings end with the block"
    assert_close("chunk 3 associative vs default", by_keyword, default, 2e-6)
    assert_close("chunk 5 vs default", by_block, default, 2e-6)


def test_bad_tuning_raises():
    with pytest.raises(ValueError, match="xla_chunk_size"):
        SelectiveScanTuning(xla_chunk_size=0)
    with pytest.raises(ValueError, match="xla_inner"):
        SelectiveScanTuning(xla_inner="parallel")
    with pytest.raises(ValueError, match="no field"):
        with ops.tuning("selective_scan", chunk_size=8):
            pass
    kw, _ = mamba1_scan_inputs((1, 4, 2, 2, 1), jnp.float32)
    with pytest.raises(TypeError, match="SelectiveScanTuning"):
        selective_scan(**kw, tuning=ops.Mamba3ScanTuning())


# ------------------------------------------------------------------------------------------- resets
def test_reset_row_mask_equals_zero_initial_state():
    kw, _ = mamba1_scan_inputs((3, 11, 4, 3, 1), jnp.float32)
    rows = jnp.array([True, False, True])
    y_reset = selective_scan(**kw, delta_softplus=True, implementation="xla", reset=rows)
    h0 = SelectiveScanState(jnp.where(rows[:, None, None], 0.0, kw["initial_state"].ssm))
    y_zero = selective_scan(**{**kw, "initial_state": h0}, delta_softplus=True, implementation="xla")
    np.testing.assert_allclose(y_reset, y_zero, rtol=1e-6, atol=1e-6)


def test_numpy_adjoint_matches_finite_differences():
    """The numpy oracle's hand-written backward is itself checked (central differences, float64)."""
    r = np.random.default_rng(3)
    bsz, T, d, n, g = 1, 5, 4, 3, 2
    a = dict(u=r.normal(size=(bsz, T, d)), delta=r.normal(size=(bsz, T, d)) * 0.5, A=-np.exp(r.normal(size=(d, n))),
             B=r.normal(size=(bsz, T, g, n)), C=r.normal(size=(bsz, T, g, n)), D=r.normal(size=d),
             z=r.normal(size=(bsz, T, d)), delta_bias=r.normal(size=d), h0=r.normal(size=(bsz, d, n)))
    reset = np.array([[False, False, True, False, False]])
    gout, glast = r.normal(size=(bsz, T, d)), r.normal(size=(bsz, d, n))

    def loss(a):
        out, h, _ = npm.scan_forward(a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"],
                                     True, a["h0"], reset)
        return (out * gout).sum() + (h * glast).sum()

    _, _, cache = npm.scan_forward(a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"],
                                   True, a["h0"], reset)
    grads = npm.scan_backward(cache, gout, glast)
    for k, v in a.items():
        num = np.zeros_like(v)
        for i in np.ndindex(v.shape):
            old = v[i]
            v[i] = old + 1e-6
            lp = loss(a)
            v[i] = old - 1e-6
            lm = loss(a)
            v[i] = old
            num[i] = (lp - lm) / 2e-6
        assert_close(f"numpy d{k}", grads[k], num, 1e-6)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("mutate,err,match", [
    (lambda a: a.update(u=a["u"][0]), ValueError, "u must have shape"),
    (lambda a: a.update(delta=a["delta"][:, :-1]), ValueError, "delta must have shape"),
    (lambda a: a.update(A=a["A"][:-1]), ValueError, "A must have shape"),
    (lambda a: a.update(B=a["B"][:, :, :, :-1]), ValueError, "B must have shape"),
    (lambda a: a.update(C=jnp.ones((2, 9, 3, 3))), ValueError, "groups"),
    (lambda a: a.update(D=jnp.ones((5,))), ValueError, "D must have shape"),
    (lambda a: a.update(z=jnp.ones((2, 9))), ValueError, "z must have shape"),
    (lambda a: a.update(initial_state=SelectiveScanState(jnp.ones((2, 6, 5)))), ValueError,
     r"initial_state\.ssm must have shape"),
    (lambda a: a.update(initial_state=(jnp.ones((2, 6, 4)),)), TypeError, "initial_state must be a jmamba.ops.SelectiveScanState"),
    (lambda a: a.update(initial_state={"ssm": jnp.ones((2, 6, 4))}), TypeError, "SelectiveScanState"),
    (lambda a: a.update(u=a["u"].astype(jnp.int32)), TypeError, "u must be a floating"),
    (lambda a: a.update(reset=jnp.ones((2, 8), bool)), ValueError, "reset must have shape"),
    (lambda a: a.update(reset=jnp.ones((2,), jnp.float32)), TypeError, "reset must be a bool"),
    (lambda a: a.update(delta_softplus=1), TypeError, "delta_softplus must be a bool"),
    (lambda a: a.update(return_final_state="yes"), TypeError, "return_final_state must be a bool"),
    (lambda a: a.update(implementation="cuda"), ValueError, "implementation must be"),
])
def test_bad_input_raises_naming_the_argument(mutate, err, match):
    kw, _ = mamba1_scan_inputs((2, 9, 6, 4, 2), jnp.float32)
    kw = dict(kw, delta_softplus=True)
    mutate(kw)
    with pytest.raises(err, match=match):
        selective_scan(**kw)


def test_options_are_keyword_only_in_the_new_spelling():
    """The arrays are positional; a ninth positional argument is the deprecated option order."""
    kw, _ = mamba1_scan_inputs((1, 4, 2, 2, 1), jnp.float32, with_h0=False)
    arrays = [kw[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    with pytest.raises(TypeError, match="both positionally and by keyword"):
        selective_scan(*arrays, True, delta_softplus=True)
    with pytest.raises(TypeError, match="at most 8 positional arrays"):
        selective_scan(*arrays, True, None, False, None, "extra")


# ------------------------------------------------------------------------------ jit, vmap, dispatch
def test_works_under_jit_and_vmap():
    kw, _ = mamba1_scan_inputs((2, 9, 6, 4, 2), jnp.float32, with_h0=False)
    A, D, bias = kw["A"], kw["D"], kw["delta_bias"]
    f = jax.jit(lambda u: selective_scan(u, kw["delta"], A, kw["B"], kw["C"], D, kw["z"], bias, delta_softplus=True))
    y = f(kw["u"])
    per_row = jax.vmap(lambda u, dl, B, C, z: selective_scan(
        u[None], dl[None], A, B[None], C[None], D, z[None], bias, delta_softplus=True)[0])(
        kw["u"], kw["delta"], kw["B"], kw["C"], kw["z"])
    np.testing.assert_allclose(y, per_row, rtol=1e-5, atol=1e-5)


def test_explicitly_requested_pallas_runs_in_interpret_mode_or_says_why():
    """On CPU an explicit "pallas" runs the kernels in the interpreter (tests/test_selective_scan_pallas.py
    checks their values); an implementation that cannot run raises NotImplementedError with the reason."""
    kw, _ = mamba1_scan_inputs((1, 4, 2, 2, 1), jnp.float32)
    with jax.enable_x64(True):
        kw64 = {k: None if v is None else jax.tree.map(lambda x: x.astype(jnp.float64), v) for k, v in kw.items()}
        with pytest.raises(NotImplementedError, match="float64"):
            selective_scan(**kw64, implementation="pallas")
        y = selective_scan(**kw64, implementation="reference")
        assert y.dtype == jnp.float64


def test_prefer_context_selects_the_implementation_for_auto_calls(monkeypatch):
    kw, _ = mamba1_scan_inputs((1, 5, 2, 2, 1), jnp.float32)
    calls = []
    from jmamba.ops.selective_scan import reference
    real = reference.selective_scan_reference
    monkeypatch.setattr(reference, "selective_scan_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    with dispatch.prefer("selective_scan", "reference"):
        selective_scan(**kw, delta_softplus=True)
    selective_scan(**kw, delta_softplus=True)
    assert calls == [1]
    with pytest.raises(ValueError, match="implementation must be"):
        with dispatch.prefer("selective_scan", "fast"):
            pass
