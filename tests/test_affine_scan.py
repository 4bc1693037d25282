"""`pallas_kernels.common.affine_scan`: h_t = a_t·h_{t-1} + b_t as one scan inside a Pallas kernel,
forward and reverse, against a serial float64 walk (interpreted on the CPU), and lowered to Triton
for an abstract H200 (the `tt.scan` rule)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.common.affine_scan import affine_scan


def scan_kernel_call(a, b, *, reverse, interpret):
    def kernel(a_ref, b_ref, A_ref, H_ref):
        A, H = affine_scan(a_ref[...], b_ref[...], axis=0, reverse=reverse)
        A_ref[...] = A
        H_ref[...] = H

    shape = jax.ShapeDtypeStruct(a.shape, a.dtype)
    return pl.pallas_call(kernel, out_shape=(shape, shape), interpret=interpret)(a, b)


def serial(a, b, reverse):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    order = range(a.shape[0] - 1, -1, -1) if reverse else range(a.shape[0])
    A, H = np.zeros_like(a), np.zeros_like(b)
    pa, h = np.ones(a.shape[1:]), np.zeros(a.shape[1:])
    for t in order:
        pa, h = pa * a[t], a[t] * h + b[t]
        A[t], H[t] = pa, h
    return A, H


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_matches_a_serial_walk_in_a_kernel(reverse):
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.uniform(0.5, 1.0, size=(64, 32)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(64, 32)), jnp.float32)
    A, H = scan_kernel_call(a, b, reverse=reverse, interpret=True)
    want_A, want_H = serial(a, b, reverse)
    np.testing.assert_allclose(np.asarray(A), want_A, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(H), want_H, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="one shape and dtype"):
        affine_scan(jnp.ones((4, 2)), jnp.ones((4, 3)), axis=0)
    with pytest.raises(ValueError, match="out of range"):
        affine_scan(jnp.ones((4, 2)), jnp.ones((4, 2)), axis=2)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_lowers_to_a_triton_scan_for_h200(reverse):
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    spec = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)
        text = jax.jit(lambda a, b: scan_kernel_call(a, b, reverse=reverse, interpret=False)).trace(
            spec, spec).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
