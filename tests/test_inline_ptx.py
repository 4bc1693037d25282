"""pallas_kernels/common/inline_ptx.py: cos / sin of wrapped angles against float64.

CPU: the interpreter's form (the shift by π with jnp.cos / jnp.sin in float32) over [0, 2π] and just
outside it. GPU (`-m gpu`): the same inside a Triton kernel, where it is the hardware's cos.approx /
sin.approx (CUDA documents about 2^-21 absolute error on [−π, π] for __cosf / __sinf).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common.inline_ptx import cos_sin_of_wrapped

TWO_PI32 = np.float32(2 * math.pi)
THETA = np.concatenate([
    np.linspace(0.0, 2 * math.pi, 400_001),
    [0.0, np.nextafter(np.float32(0), np.float32(1)), math.pi, np.nextafter(TWO_PI32, np.float32(0)), TWO_PI32,
     -1e-7, np.nextafter(TWO_PI32, np.float32(7))],   # a rounding outside [0, 2π) (chunk_math.wrap_angle)
]).astype(np.float32)


def abs_errors(theta, c, s):
    t64 = theta.astype(np.float64)
    return (float(np.max(np.abs(np.asarray(c, np.float64) - np.cos(t64)))),
            float(np.max(np.abs(np.asarray(s, np.float64) - np.sin(t64)))))


def test_shifted_cos_sin_match_float64_in_the_interpreter():
    c, s = jax.jit(lambda t: cos_sin_of_wrapped(t, gpu=False))(jnp.asarray(THETA))
    err_c, err_s = abs_errors(THETA, c, s)
    # float32 cos / sin of θ − π: the subtraction's rounding (≤ ulp(2π)/2 = 2.4e-7) plus theirs
    assert err_c < 5e-7 and err_s < 5e-7


def test_the_shift_is_what_is_computed():
    """cos θ = −cos(θ − π): for θ where float32 θ − π is inexact the two forms differ in the last bits
    somewhere (a form that ignored the shift would agree with jnp.cos everywhere)."""
    c, s = cos_sin_of_wrapped(jnp.asarray(THETA), gpu=False)
    assert np.any(np.asarray(c) != np.cos(THETA)) and np.any(np.asarray(s) != np.sin(THETA))


@pytest.mark.gpu
def test_gpu_hardware_cos_sin_match_float64():
    from jax.experimental import pallas as pl

    n = 1024
    theta = np.resize(THETA, (len(THETA) + n - 1) // n * n).reshape(-1, n)

    def kernel(t_ref, c_ref, s_ref):
        c_ref[...], s_ref[...] = cos_sin_of_wrapped(t_ref[...], gpu=True)

    spec = pl.BlockSpec((1, n), lambda i: (i, 0))
    call = pl.pallas_call(kernel, out_shape=[jax.ShapeDtypeStruct(theta.shape, jnp.float32)] * 2,
                          grid=(theta.shape[0],), in_specs=[spec], out_specs=[spec] * 2)
    c, s = (np.asarray(v).reshape(-1) for v in jax.jit(call)(jnp.asarray(theta)))
    err_c, err_s = abs_errors(theta.reshape(-1), c, s)
    assert err_c < 2e-6 and err_s < 2e-6, (err_c, err_s)
    # not libdevice: the hardware approximation differs from the correctly rounded value somewhere
    exact_c = np.cos(theta.reshape(-1).astype(np.float64)).astype(np.float32)
    assert np.any(c != exact_c)
