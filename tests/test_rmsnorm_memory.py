"""`rms_norm`'s custom VJP: the forward equal bit for bit to the plain autodiff formula, dx and dweight
against autodiff of that formula (float32, bfloat16) and central differences (float64), jit / vmap /
nnx / remat, and what the backward saves (x, weight and r [..., 1], not the float32 x·r [..., D])."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import assert_close, assert_directional_gradients
from jmamba.core.dtypes import accum_dtype
from jmamba.layers.rmsnorm import RMSNorm, rms_norm

EPS = 1e-5


def old_rms_norm(x, weight, eps, out_dtype=None):
    """The formula before the custom VJP (plain autodiff saves the float32 x·r and more)."""
    acc = accum_dtype(x.dtype)
    xf = x.astype(acc)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = xf * r * weight.astype(acc)
    return y.astype(out_dtype or x.dtype)


def inputs(lead, d, x_dtype, w_dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=lead + (d,)) * 3.0, x_dtype)
    w = jnp.asarray(1.0 + 0.3 * rng.normal(size=(d,)), w_dtype)
    dy = rng.normal(size=lead + (d,))
    return x, w, dy


def vjp(f, x, w, dy, out_dtype):
    y, pull = jax.vjp(lambda a, b: f(a, b, EPS, out_dtype), x, w)
    return pull(jnp.asarray(dy, y.dtype))


CASES = [((2, 5), 8, jnp.float32, jnp.float32, None),
         ((3,), 8, jnp.bfloat16, jnp.float32, jnp.bfloat16),
         ((2, 5), 8, jnp.bfloat16, jnp.float32, None),
         ((2, 5), 8, jnp.bfloat16, jnp.float32, jnp.float32),
         ((3,), 8, jnp.float32, jnp.bfloat16, jnp.bfloat16)]


@pytest.mark.parametrize("lead,d,x_dtype,w_dtype,out_dtype", CASES)
def test_forward_bit_identical(lead, d, x_dtype, w_dtype, out_dtype):
    """Same ops in the same order: equal to the old formula eagerly, under jit (XLA's fusion may round
    the two modes differently, so each is compared with the same mode) and as the primal of a vjp."""
    x, w, _ = inputs(lead, d, x_dtype, w_dtype)
    jit = lambda f: jax.jit(f, static_argnums=(2, 3))
    primal = lambda f: lambda *a: jax.vjp(lambda x, w: f(x, w, *a[2:]), *a[:2])[0]
    for mode in (lambda f: f, jit, primal, lambda f: jit(primal(f))):
        got, want = mode(rms_norm)(x, w, EPS, out_dtype), mode(old_rms_norm)(x, w, EPS, out_dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("lead", [(2, 5), (3,)])
@pytest.mark.parametrize("x_dtype,out_dtype,tol", [(jnp.float32, None, 1e-6), (jnp.bfloat16, jnp.bfloat16, 1e-2)])
def test_gradients_match_autodiff(lead, x_dtype, out_dtype, tol):
    x, w, dy = inputs(lead, 8, x_dtype)
    got = jax.jit(lambda *a: vjp(rms_norm, *a, out_dtype))(x, w, dy)
    want = jax.jit(lambda *a: vjp(old_rms_norm, *a, out_dtype))(x, w, dy)
    for name, g, h in zip(("dx", "dweight"), got, want):
        assert g.dtype == h.dtype and g.shape == h.shape, name
        assert_close(name, np.asarray(g, np.float32), np.asarray(h, np.float32), tol)


def test_grouped_weight_gradients():
    """The Mamba-3 gated norm passes weight [H, P] against x [..., H, P]: dweight reduces to [H, P]."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(2, 5, 3, 4)), jnp.float32)
    w = jnp.asarray(1.0 + 0.3 * rng.normal(size=(3, 4)), jnp.float32)
    dy = rng.normal(size=x.shape)
    for name, g, h in zip(("dx", "dweight"), vjp(rms_norm, x, w, dy, None), vjp(old_rms_norm, x, w, dy, None)):
        assert g.shape == h.shape, name
        assert_close(name, g, h, 1e-6)


def test_float64_finite_differences():
    with jax.enable_x64(True):
        x, w, dy = inputs((2, 5), 8, jnp.float64, jnp.float64)
        dy = jnp.asarray(dy)
        assert rms_norm(x, w, EPS).dtype == jnp.float64
        loss = lambda a, b: jnp.sum(rms_norm(a, b, EPS) * dy)
        assert assert_directional_gradients(loss, (x, w), np.random.default_rng(2)) == 4
        got = vjp(rms_norm, x, w, dy, None)
        want = vjp(old_rms_norm, x, w, dy, None)
        for name, g, h in zip(("dx", "dweight"), got, want):
            assert g.dtype == jnp.float64, name
            assert_close(name, g, h, 1e-12)


def test_vmap_module_and_remat():
    x, w, dy = inputs((4, 6), 8, jnp.float32)
    dy = jnp.asarray(dy)
    want = vjp(old_rms_norm, x, w, dy, None)
    # vmap over the leading axis, with and without a batched weight
    per_row = jax.vmap(lambda a: rms_norm(a, w, EPS))
    np.testing.assert_array_equal(per_row(x), old_rms_norm(x, w, EPS))
    ws = jnp.stack([w * (1 + i) for i in range(4)])
    dws = jax.grad(lambda b: jnp.sum(jax.vmap(lambda a, c: rms_norm(a, c, EPS))(x, b) * dy))(ws)
    dws_old = jax.grad(lambda b: jnp.sum(jax.vmap(lambda a, c: old_rms_norm(a, c, EPS))(x, b) * dy))(ws)
    assert_close("vmap dweight", dws, dws_old, 1e-6)

    # nnx module under nnx.remat, and jax.checkpoint of the functional form, under jit
    norm = RMSNorm(8, EPS)
    norm.weight[...] = w

    @nnx.jit
    def module_grads(m, a):
        return nnx.grad(lambda m, a: jnp.sum(nnx.remat(lambda m, a: m(a))(m, a) * dy), argnums=(0, 1))(m, a)

    dm, dx = module_grads(norm, x)
    assert_close("nnx.remat dx", dx, want[0], 1e-6)
    assert_close("nnx.remat dweight", dm.weight[...], want[1], 1e-6)
    ck = jax.jit(jax.grad(lambda a, b: jnp.sum(jax.checkpoint(lambda a, b: rms_norm(a, b, EPS))(a, b) * dy),
                          argnums=(0, 1)))(x, w)
    for name, g, h in zip(("checkpoint dx", "checkpoint dweight"), ck, want):
        assert_close(name, g, h, 1e-6)


def test_backward_saves_no_float32_activation():
    """bf16 x [2, 16, 32]: the residuals are x (bf16), weight and r [2, 16, 1] float32; the autodiff
    formula also keeps a float32 [2, 16, 32] (x·r), which is what the custom VJP removes."""
    from jax._src.ad_checkpoint import saved_residuals   # print_saved_residuals only prints

    x, w, _ = inputs((2, 16), 32, jnp.bfloat16)

    def f32_full(fn):
        res = saved_residuals(lambda a, b: fn(a, b, EPS, jnp.bfloat16), x, w)
        return [aval for aval, _ in res if aval.dtype == jnp.float32 and tuple(aval.shape) == x.shape]

    assert f32_full(old_rms_norm), "the old formula should save a float32 [2, 16, 32]"
    assert not f32_full(rms_norm)
    res = saved_residuals(lambda a, b: rms_norm(a, b, EPS, jnp.bfloat16), x, w)
    shapes = sorted((tuple(a.shape), str(a.dtype)) for a, _ in res)
    assert shapes == sorted([((2, 16, 32), "bfloat16"), ((32,), "float32"), ((2, 16, 1), "float32")]), shapes
