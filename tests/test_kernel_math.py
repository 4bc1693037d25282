"""The selective-scan kernels' scalar math (pallas_kernels/selective_scan/kernel_math.py) against float64.

CPU: the fast softplus form (ex2 and a six-term atanh series, exact division in the interpreter) and
the exact libdevice-style forms, over |x| <= 20 and at the threshold (XLA on the CPU folds the fast σ
back into its own sigmoid, so only the GPU test below checks the fast σ's rounding). GPU (`-m gpu`):
the same functions inside a Triton kernel, where `fast_math` uses ex2.approx / rcp.approx and
`fused_multiply_add` emits `fma.rn.f32` through inline assembly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.selective_scan.kernel_math import SOFTPLUS_THRESHOLD, KernelMath

X = np.concatenate([np.linspace(-20.0, 20.0, 200_001), -np.logspace(-7, 1.3, 2001), np.logspace(-7, 1.3, 2001),
                    [SOFTPLUS_THRESHOLD, np.nextafter(np.float32(SOFTPLUS_THRESHOLD), np.float32(30)), 25.0, 80.0,
                     -80.0]]).astype(np.float32)


def softplus64(x):
    x = x.astype(np.float64)
    return np.where(x > SOFTPLUS_THRESHOLD, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_THRESHOLD))))


def sigmoid64(x):
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)))


def _apply(m: KernelMath, x):
    return m.softplus(x), m.sigmoid(x), m.softplus_grad(x)


@pytest.mark.parametrize("fast,sp_tol,sig_tol", [(True, 1.5e-6, 5e-6), (False, 5e-7, 5e-7)], ids=["fast", "exact"])
def test_softplus_and_sigmoid_match_float64(fast, sp_tol, sig_tol):
    m = KernelMath(fast=fast, fused=True, gpu=False)
    sp, sig, grad = jax.jit(lambda x: _apply(m, x))(jnp.asarray(X))
    assert rel_err(sp, softplus64(X)) < sp_tol
    assert rel_err(sig, sigmoid64(X)) < sig_tol
    above = X > SOFTPLUS_THRESHOLD
    np.testing.assert_array_equal(np.asarray(sp)[above], X[above])       # the threshold is exact
    np.testing.assert_array_equal(np.asarray(grad)[above], 1.0)
    assert rel_err(np.asarray(grad)[~above], sigmoid64(X[~above])) < sig_tol


def test_fast_softplus_is_not_the_exact_one():
    """The two forms are different computations (the test above would not notice a flag ignored)."""
    x = jnp.asarray(X)
    fast = np.asarray(KernelMath(fast=True, fused=False, gpu=False).softplus(x))
    exact = np.asarray(KernelMath(fast=False, fused=False, gpu=False).softplus(x))
    assert np.any(fast != exact)


def test_fma_off_the_gpu_rounds_twice():
    """In the interpreter fma is a·b + c with two roundings: fma(x, x, −x·x) is exactly 0 there (the GPU
    test below checks that the inline-assembly fma gives the rounding error of x·x instead)."""
    m = KernelMath(fast=True, fused=True, gpu=False)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64,)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: m.fma(v, v, -(v * v)))(x)), 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "exact"])
def test_gpu_kernel_math_matches_float64(fast):
    """Inside a Triton kernel (inline assembly for ex2 / rcp / fma on the GPU)."""
    from jax.experimental import pallas as pl

    m = KernelMath(fast=fast, fused=True, gpu=True)
    n = 1024
    xs = np.resize(X, (len(X) + n - 1) // n * n).reshape(-1, n)

    def kernel(x_ref, sp_ref, sig_ref, grad_ref, fma_ref):
        x = x_ref[...]
        sp_ref[...], sig_ref[...], grad_ref[...] = _apply(m, x)
        fma_ref[...] = m.fma(x, x, -x * x)          # one rounding: the exact error of x·x, not 0

    call = pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct(xs.shape, jnp.float32)] * 4, grid=(xs.shape[0],),
                          in_specs=[pl.BlockSpec((1, n), lambda i: (i, 0))],
                          out_specs=[pl.BlockSpec((1, n), lambda i: (i, 0))] * 4)
    sp, sig, grad, fma_err = (np.asarray(v).reshape(-1) for v in jax.jit(call)(jnp.asarray(xs)))
    x = xs.reshape(-1)
    assert rel_err(sp, softplus64(x)) < (3e-6 if fast else 5e-7)
    assert rel_err(sig, sigmoid64(x)) < (6e-6 if fast else 5e-7)
    above = x > SOFTPLUS_THRESHOLD
    np.testing.assert_array_equal(sp[above], x[above])
    np.testing.assert_array_equal(grad[above], 1.0)
    # fma(x, x, -round(x·x)) is the rounding error of x·x, exactly (nonzero for most x)
    x64 = x.astype(np.float64)
    np.testing.assert_array_equal(fma_err, (x64 * x64 - (x * x).astype(np.float64)).astype(np.float32))
    assert np.count_nonzero(fma_err) > len(x) // 4
