"""The Mosaic GPU forward prototype (pallas_kernels/selective_scan/mosaic_forward.py) against the op's
sequential reference: output, final state and the state entering every chunk. On CPU the kernel runs
in the Mosaic GPU interpreter (values) and is lowered for CUDA on an abstract sm_90 (layouts, TMA
rules, shared memory); the GPU test runs it compiled on the H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmamba.ops.selective_scan.reference import selective_scan_reference
from pallas_kernels.selective_scan.kernel_math import softplus_thresholded
from pallas_kernels.selective_scan.mosaic_forward import mosaic_forward
from pallas_kernels.selective_scan.mosaic_forward import softplus_thresholded as mosaic_softplus


def make_inputs(bsz, T, d, n, dtype, *, with_z=True, with_D=True, with_bias=True, raw_delta=True, seed=0):
    """raw_delta: delta before a softplus (any sign); else already a step size (positive, as without softplus)."""
    r = np.random.default_rng(seed)
    act = lambda shift=0.0: jnp.asarray(r.normal(size=(bsz, T, d)) + shift, dtype)
    delta = act(-1.0) if raw_delta else jnp.asarray(np.abs(r.normal(size=(bsz, T, d))) * 0.1, dtype)
    return dict(u=act(), delta=delta, A=-jnp.asarray(np.exp(r.normal(size=(d, n)) * 0.5), jnp.float32),
                B=jnp.asarray(r.normal(size=(bsz, T, n)), dtype), C=jnp.asarray(r.normal(size=(bsz, T, n)), dtype),
                D=jnp.asarray(r.normal(size=(d,)), jnp.float32) if with_D else None,
                z=act() if with_z else None,
                delta_bias=jnp.asarray(r.normal(size=(d,)) * 0.3, jnp.float32) if with_bias else None)


def reference(a, softplus, T):
    return selective_scan_reference(a["u"][:, :T], a["delta"][:, :T], a["A"], a["B"][:, :T, None],
                                    a["C"][:, :T, None], a["D"], None if a["z"] is None else a["z"][:, :T],
                                    a["delta_bias"], None, None, delta_softplus=softplus)


def check(a, *, softplus, chunk, tol, interpret=True):
    out, final, states = jax.jit(lambda a: mosaic_forward(**a, softplus=softplus, chunk=chunk,
                                                          interpret=interpret))(a)
    T = a["u"].shape[1]
    want, want_final = reference(a, softplus, T)
    assert out.dtype == a["u"].dtype and out.shape == a["u"].shape
    w = np.asarray(want, np.float32)
    assert np.abs(np.asarray(out, np.float32) - w).max() <= tol * np.abs(w).max()
    np.testing.assert_allclose(np.asarray(final), np.asarray(want_final), rtol=2e-5, atol=2e-5 * np.abs(want_final).max())
    assert float(jnp.abs(states[:, 0]).max()) == 0.0          # a fresh sequence enters chunk 0
    for c in range(1, T // chunk):                              # entering chunk c = final state after c chunks
        _, f = reference(a, softplus, c * chunk)
        np.testing.assert_allclose(np.asarray(states[:, c]), np.asarray(f), rtol=2e-5, atol=2e-5 * np.abs(f).max())


@pytest.mark.parametrize("shape,dtype,options,softplus,tol", [
    ((2, 64, 256, 16), jnp.bfloat16, {}, True, 1e-2),
    ((1, 48, 128, 8), jnp.float32, dict(with_z=False, with_D=False, with_bias=False, raw_delta=False), False, 2e-5),
    ((2, 32, 128, 4), jnp.float16, dict(with_D=False), True, 2e-3),
], ids=["bf16-z-D-bias", "f32-bare-no-softplus", "f16-z-bias"])
def test_interpreted_values_and_states_match_reference(shape, dtype, options, softplus, tol):
    check(make_inputs(*shape, dtype, **options), softplus=softplus, chunk=16, tol=tol)


def test_softplus_without_log1p_matches_the_triton_kernels():
    """The lowering has no log1p; the substitute is as accurate as the Triton kernels' formula."""
    x = jnp.asarray(np.linspace(-40.0, 40.0, 100001), jnp.float32)
    exact = np.where(np.asarray(x) > 20, np.asarray(x, np.float64), np.log1p(np.exp(np.asarray(x, np.float64))))
    for f in (mosaic_softplus, softplus_thresholded):
        assert np.max(np.abs(np.asarray(f(x), np.float64) - exact) / exact) < 1e-6


@pytest.mark.parametrize("dtype,with_z,with_D", [(jnp.bfloat16, True, True), (jnp.float32, False, False)])
def test_lowers_for_cuda_at_the_benchmark_shape(dtype, with_z, with_D):
    """The real Pallas -> Mosaic GPU lowering (no GPU needed): layout inference, TMA shapes, SMEM budget."""
    S = jax.ShapeDtypeStruct
    bsz, T, d, n = 8, 2048, 1536, 16
    act = S((bsz, T, d), dtype)
    args = dict(u=act, delta=act, A=S((d, n), jnp.float32), B=S((bsz, T, n), dtype), C=S((bsz, T, n), dtype),
                D=S((d,), jnp.float32) if with_D else None, z=act if with_z else None, delta_bias=S((d,), jnp.float32))
    text = jax.jit(lambda a: mosaic_forward(**a, softplus=True, chunk=64)).trace(args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("change,match", [
    (dict(d=130), "not a multiple of 128"), (dict(T=70), "not a multiple of the chunk"), (dict(n=6), "multiple of 4")])
def test_unsupported_shapes_are_refused_by_name(change, match):
    shape = dict(bsz=1, T=64, d=128, n=16)
    shape.update(change)
    a = make_inputs(shape["bsz"], shape["T"], shape["d"], shape["n"], jnp.float32)
    with pytest.raises(ValueError, match=match):
        mosaic_forward(**a, chunk=16, interpret=True)


@pytest.mark.gpu
def test_gpu_values_and_states_match_reference_at_the_benchmark_shape():
    check(make_inputs(8, 2048, 1536, 16, jnp.bfloat16), softplus=True, chunk=64, tol=1e-2, interpret=False)
