"""selective_scan: reference and xla vs the independent numpy algorithm (values and every cotangent)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_mamba1 as npm
from helpers import assert_close
from jmamba.ops import selective_scan
from jmamba.ops.selective_scan.xla import selective_scan_xla
from jmamba.ops import dispatch

# (Bt, T, d, n, groups): T never a multiple of the chunk sizes, d not a power of two.
SHAPES = [(2, 37, 6, 4, 1), (1, 1, 3, 2, 1), (2, 13, 6, 5, 2), (3, 70, 10, 8, 5)]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2.5e-2}


def make_inputs(shape, dtype, *, with_D=True, with_z=True, with_bias=True, with_h0=True,
                with_reset=False, grouped=True, seed=0):
    bsz, T, d, n, g = shape
    r = np.random.default_rng(seed)
    args = dict(
        u=r.normal(size=(bsz, T, d)),
        delta=r.normal(size=(bsz, T, d)) * 0.5 - 0.5,
        A=-np.exp(r.normal(size=(d, n)) * 0.5),
        B=r.normal(size=(bsz, T, g, n)),
        C=r.normal(size=(bsz, T, g, n)),
        D=r.normal(size=(d,)) if with_D else None,
        z=r.normal(size=(bsz, T, d)) if with_z else None,
        delta_bias=r.normal(size=(d,)) * 0.3 if with_bias else None,
        initial_state=r.normal(size=(bsz, d, n)) if with_h0 else None,
    )
    if not grouped and g == 1:
        args["B"], args["C"] = args["B"][:, :, 0], args["C"][:, :, 0]
    jargs = {}
    for k, v in args.items():
        if v is None:
            jargs[k] = None
        elif k in ("A", "D", "delta_bias", "initial_state"):   # parameters and state stay float32
            jargs[k] = jnp.asarray(v, jnp.float32)
        else:
            jargs[k] = jnp.asarray(v, dtype)
    reset = None
    if with_reset:
        reset = jnp.asarray(r.random((bsz, T)) < 0.1)
    return jargs, reset


def numpy_ref(jargs, reset, gout, glast):
    a = {k: None if v is None else np.asarray(v.astype(jnp.float32), np.float64) for k, v in jargs.items()}
    B, C = a["B"], a["C"]
    if B.ndim == 3:
        B, C = B[:, :, None], C[:, :, None]
    out, h, cache = npm.scan_forward(a["u"], a["delta"], a["A"], B, C, a["D"], a["z"], a["delta_bias"],
                                     True, a["initial_state"], None if reset is None else np.asarray(reset))
    grads = npm.scan_backward(cache, np.asarray(gout, np.float64), np.asarray(glast, np.float64))
    if jargs["B"].ndim == 3:
        grads["B"], grads["C"] = grads["B"][:, :, 0], grads["C"][:, :, 0]
    grads["initial_state"] = grads.pop("h0")
    return out, h, grads


def run_vjp(impl, jargs, reset, gout, glast):
    names = [k for k, v in jargs.items() if v is not None]

    def f(*vals):
        kw = dict(zip(names, vals))
        return selective_scan(**kw, delta_softplus=True, return_final_state=True, implementation=impl, reset=reset)

    (out, h), vjp = jax.vjp(f, *[jargs[k] for k in names])
    cts = vjp((gout.astype(out.dtype), glast))
    return out, h, dict(zip(names, cts))


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_values_and_cotangents_match_numpy(impl, dtype, shape):
    jargs, reset = make_inputs(shape, dtype, with_reset=shape[1] > 20)
    r = np.random.default_rng(1)
    gout = jnp.asarray(r.normal(size=jargs["u"].shape), jnp.float32)
    glast = jnp.asarray(r.normal(size=(shape[0], shape[2], shape[3])), jnp.float32)
    out, h, grads = run_vjp(impl, jargs, reset, gout, glast)
    want_out, want_h, want_grads = numpy_ref(jargs, reset, np.asarray(gout.astype(dtype).astype(jnp.float32)), glast)
    tol = TOL[dtype]
    assert out.dtype == dtype and h.dtype == jnp.float32
    assert_close("out", out, want_out, tol)
    assert_close("final_state", h, want_h, tol)
    for k, want in want_grads.items():
        assert grads[k].dtype == jargs[k].dtype, k
        assert_close(f"d{k}", grads[k], want, tol * (4 if k in ("A", "delta", "delta_bias") else 1))
    assert set(grads) == set(want_grads), "every array argument has a cotangent"


@pytest.mark.parametrize("options", [
    dict(with_D=False, with_z=False, with_bias=False, with_h0=False),
    dict(with_D=True, with_z=False, with_bias=False, with_h0=False, grouped=False),
    dict(with_D=False, with_z=True, with_bias=True, with_h0=False, grouped=False),
], ids=["bare", "D-only-ungrouped", "z-bias-ungrouped"])
@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_optional_arguments(impl, options):
    jargs, reset = make_inputs((2, 19, 4, 3, 1), jnp.float32, **options)
    r = np.random.default_rng(2)
    gout = jnp.asarray(r.normal(size=jargs["u"].shape), jnp.float32)
    glast = jnp.zeros((2, 4, 3), jnp.float32)
    out, h, grads = run_vjp(impl, jargs, reset, gout, glast)
    want_out, want_h, want_grads = numpy_ref(jargs, reset, gout, glast)
    assert_close("out", out, want_out, 2e-5)
    assert_close("final_state", h, want_h, 2e-5)
    for k, want in want_grads.items():
        if k in grads:
            assert_close(f"d{k}", grads[k], want, 1e-4)


@pytest.mark.parametrize("inner,chunk", [("associative", 8), ("associative", 64), ("sequential", 3)])
def test_xla_inner_modes_and_chunks(inner, chunk):
    """Both within-chunk strategies, chunk sizes that do and don't divide T, match the reference."""
    jargs, reset = make_inputs((2, 29, 6, 4, 2), jnp.float32, with_reset=True)
    B, C = jargs["B"], jargs["C"]
    fn = functools.partial(selective_scan_xla, delta_softplus=True, chunk_size=chunk, inner=inner)

    def loss(impl, u, delta, B, C, h0):
        y, h = impl(u, delta, jargs["A"], B, C, jargs["D"], jargs["z"], jargs["delta_bias"], h0, reset)
        return jnp.sum(y * jnp.cos(y)) + jnp.sum(h * h)

    from jmamba.ops.selective_scan.reference import selective_scan_reference
    ref = functools.partial(selective_scan_reference, delta_softplus=True)
    args = (jargs["u"], jargs["delta"], B, C, jargs["initial_state"])
    g_ref = jax.grad(functools.partial(loss, ref), argnums=range(5))(*args)
    g_xla = jax.grad(functools.partial(loss, fn), argnums=range(5))(*args)
    for name, a, b in zip(("u", "delta", "B", "C", "h0"), g_xla, g_ref):
        assert_close(f"d{name}", a, b, 1e-4)


def test_reset_row_mask_equals_zero_initial_state():
    jargs, _ = make_inputs((3, 11, 4, 3, 1), jnp.float32)
    rows = jnp.array([True, False, True])
    y_reset = selective_scan(**jargs, delta_softplus=True, implementation="xla", reset=rows)
    h0 = jnp.where(rows[:, None, None], 0.0, jargs["initial_state"])
    y_zero = selective_scan(**{**jargs, "initial_state": h0}, delta_softplus=True, implementation="xla")
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
        assert_close(f"numpy d{k}", grads["delta" if k == "delta" else k], num, 1e-6)


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("mutate,err,match", [
    (lambda a: a.update(u=a["u"][0]), ValueError, "u must have shape"),
    (lambda a: a.update(delta=a["delta"][:, :-1]), ValueError, "delta must have shape"),
    (lambda a: a.update(A=a["A"][:-1]), ValueError, "A must have shape"),
    (lambda a: a.update(B=a["B"][:, :, :, :-1]), ValueError, "B must have shape"),
    (lambda a: a.update(C=jnp.ones((2, 9, 3, 3))), ValueError, "groups"),
    (lambda a: a.update(D=jnp.ones((5,))), ValueError, "D must have shape"),
    (lambda a: a.update(z=jnp.ones((2, 9))), ValueError, "z must have shape"),
    (lambda a: a.update(initial_state=jnp.ones((2, 6, 5))), ValueError, "initial_state must have shape"),
    (lambda a: a.update(u=a["u"].astype(jnp.int32)), TypeError, "u must be a floating"),
    (lambda a: a.update(reset=jnp.ones((2, 8), bool)), ValueError, "reset must have shape"),
    (lambda a: a.update(reset=jnp.ones((2,), jnp.float32)), TypeError, "reset must be a bool"),
])
def test_bad_input_raises_naming_the_argument(mutate, err, match):
    jargs, _ = make_inputs((2, 9, 6, 4, 2), jnp.float32)
    jargs = dict(jargs)
    mutate(jargs)
    with pytest.raises(err, match=match):
        selective_scan(**jargs, delta_softplus=True)


def test_unknown_implementation_and_unavailable_pallas():
    jargs, _ = make_inputs((1, 4, 2, 2, 1), jnp.float32)
    with pytest.raises(ValueError, match="implementation must be"):
        selective_scan(**jargs, implementation="cuda")
    if "pallas" not in dispatch._REGISTRY.get("selective_scan", {}):
        with pytest.raises(NotImplementedError, match="pallas"):
            selective_scan(**jargs, implementation="pallas")


def test_works_under_jit_and_vmap():
    jargs, _ = make_inputs((2, 9, 6, 4, 2), jnp.float32)
    f = jax.jit(lambda u: selective_scan(u, *[jargs[k] for k in ("delta", "A", "B", "C", "D", "z", "delta_bias")],
                                         delta_softplus=True))
    y = f(jargs["u"])
    per_row = jax.vmap(lambda u, dl, B, C, z: selective_scan(
        u[None], dl[None], jargs["A"], B[None], C[None], jargs["D"], z[None], jargs["delta_bias"], True)[0])(
        jargs["u"], jargs["delta"], jargs["B"], jargs["C"], jargs["z"])
    np.testing.assert_allclose(y, per_row, rtol=1e-5, atol=1e-5)


def test_prefer_context_selects_the_implementation_for_auto_calls(monkeypatch):
    jargs, _ = make_inputs((1, 5, 2, 2, 1), jnp.float32)
    calls = []
    from jmamba.ops.selective_scan import reference
    real = reference.selective_scan_reference
    monkeypatch.setattr(reference, "selective_scan_reference", lambda *a, **k: calls.append(1) or real(*a, **k))
    with dispatch.prefer("selective_scan", "reference"):
        selective_scan(**jargs, delta_softplus=True)
    selective_scan(**jargs, delta_softplus=True)
    assert calls == [1]
    with pytest.raises(ValueError, match="implementation must be"):
        with dispatch.prefer("selective_scan", "fast"):
            pass
