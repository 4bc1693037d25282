"""The Mosaic GPU forward prototype (pallas_kernels/selective_scan/mosaic_forward.py) against the op's
sequential reference: output, final state and the state entering every chunk. On CPU the kernel runs
in the Mosaic GPU interpreter (values) and is lowered for CUDA on an abstract sm_90 (layouts, TMA
rules, shared memory); the GPU test runs it compiled on the H200."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmamba.ops.selective_scan.reference import selective_scan_reference
from pallas_kernels.selective_scan.kernel_math import softplus_thresholded
from pallas_kernels.selective_scan import mosaic_backward as backward_module
from pallas_kernels.selective_scan import mosaic_forward as mosaic_module
from pallas_kernels.selective_scan.mosaic_backward import mosaic_backward
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


def reference(a, softplus, T, h0=None):
    return selective_scan_reference(a["u"][:, :T], a["delta"][:, :T], a["A"], a["B"][:, :T, None],
                                    a["C"][:, :T, None], a["D"], None if a["z"] is None else a["z"][:, :T],
                                    a["delta_bias"], h0, None, delta_softplus=softplus)


def step_sizes(a, softplus):
    x = a["delta"].astype(jnp.float32) + (0.0 if a["delta_bias"] is None else a["delta_bias"])
    return softplus_thresholded(x) if softplus else x


def check(a, *, softplus, chunk, tol, interpret=True, h0=None, packed_z=False):
    kw = dict(a)
    if packed_z:       # the gate read in place from a wider [x | z] array at channel offset d
        kw["z"] = jnp.concatenate([a["u"], a["z"]], axis=-1)
    d = a["u"].shape[-1]
    out, final, states, sums = jax.jit(lambda kw, h0: mosaic_forward(
        **kw, initial_state=h0, softplus=softplus, chunk=chunk, z_channel_offset=d if packed_z else 0,
        interpret=interpret))(kw, h0)
    T = a["u"].shape[1]
    want, want_final = reference(a, softplus, T, h0)
    want_sums = step_sizes(a, softplus).reshape(a["u"].shape[0], T // chunk, chunk, d).sum(axis=2)
    np.testing.assert_allclose(np.asarray(sums), np.asarray(want_sums), rtol=1e-5, atol=1e-5)
    assert out.dtype == a["u"].dtype and out.shape == a["u"].shape
    w = np.asarray(want, np.float32)
    assert np.abs(np.asarray(out, np.float32) - w).max() <= tol * np.abs(w).max()
    np.testing.assert_allclose(np.asarray(final), np.asarray(want_final), rtol=2e-5, atol=2e-5 * np.abs(want_final).max())
    np.testing.assert_array_equal(np.asarray(states[:, 0]), 0.0 if h0 is None else np.asarray(h0))
    for c in range(1, T // chunk):                              # entering chunk c = final state after c chunks
        _, f = reference(a, softplus, c * chunk, h0)
        np.testing.assert_allclose(np.asarray(states[:, c]), np.asarray(f), rtol=2e-5, atol=2e-5 * np.abs(f).max())


@pytest.mark.parametrize("shape,dtype,options,softplus,tol", [
    ((2, 64, 256, 16), jnp.bfloat16, {}, True, 1e-2),
    ((1, 48, 128, 8), jnp.float32, dict(with_z=False, with_D=False, with_bias=False, raw_delta=False), False, 2e-5),
    ((2, 32, 128, 4), jnp.float16, dict(with_D=False), True, 2e-3),
], ids=["bf16-z-D-bias", "f32-bare-no-softplus", "f16-z-bias"])
def test_interpreted_values_and_states_match_reference(shape, dtype, options, softplus, tol):
    check(make_inputs(*shape, dtype, **options), softplus=softplus, chunk=16, tol=tol)


def test_initial_state_and_a_gate_read_in_place():
    a = make_inputs(2, 32, 128, 16, jnp.bfloat16, seed=3)
    h0 = jnp.asarray(np.random.default_rng(4).normal(size=(2, 128, 16)), jnp.float32)
    check(a, softplus=True, chunk=16, tol=1e-2, h0=h0, packed_z=True)


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


MOSAIC_CONFIGS = [dict(fwd_mosaic=True), dict(bwd_mosaic=True), dict(fwd_mosaic=True, bwd_mosaic=True)]
MOSAIC_IDS = ["forward", "backward", "both"]


@pytest.mark.parametrize("fields", MOSAIC_CONFIGS, ids=MOSAIC_IDS)
def test_mosaic_configs_give_the_triton_scan_values_and_gradients(fields):
    """ScanBlockConfig(fwd_mosaic / bwd_mosaic): the Pallas scan with the Mosaic forward (its chunk states
    feeding the Triton backward), the Mosaic backward (after the Triton forward), or both: values and
    every cotangent (incl. the initial state's) as with the Triton kernels."""
    compare_fwd_mosaic_with_triton((1, 32, 128, 16), jnp.float32, chunk=16, interpret=True, tol=1e-5, fields=fields)


@pytest.mark.gpu
@pytest.mark.parametrize("fields", MOSAIC_CONFIGS, ids=MOSAIC_IDS)
def test_gpu_mosaic_configs_give_the_triton_scan_values_and_gradients(fields):
    compare_fwd_mosaic_with_triton((8, 2048, 1536, 16), jnp.bfloat16, chunk=64, interpret=False, tol=2e-2,
                                   fields=fields)


def compare_fwd_mosaic_with_triton(shape, dtype, *, chunk, interpret, tol, fields):
    import dataclasses

    from pallas_kernels.selective_scan import DEFAULT_CONFIG
    from pallas_kernels.selective_scan.scan import selective_scan_pallas

    bsz, T, d, n = shape
    a = make_inputs(bsz, T, d, n, dtype, seed=5)
    h0 = jnp.asarray(np.random.default_rng(6).normal(size=(bsz, d, n)) * 0.1, jnp.float32)
    base = dataclasses.replace(DEFAULT_CONFIG, chunk=chunk)

    def loss(config, a, h0):
        out, last = selective_scan_pallas(a["u"], a["delta"], a["A"], a["B"][:, :, None], a["C"][:, :, None], a["D"],
                                          a["z"], a["delta_bias"], h0, None, delta_softplus=True, config=config,
                                          interpret=interpret)
        out = out.astype(jnp.float32)
        return jnp.sum(out * out) + jnp.sum(last * last), (out, last)

    grad = lambda cfg: jax.jit(jax.value_and_grad(functools.partial(loss, cfg), argnums=(0, 1), has_aux=True))(a, h0)
    (_, (out_m, last_m)), g_m = grad(dataclasses.replace(base, **fields))
    (_, (out_t, last_t)), g_t = grad(base)
    scaled = lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                                / max(float(np.max(np.abs(np.asarray(y, np.float64)))), 1e-30))
    assert scaled(out_m, out_t) <= tol and scaled(last_m, last_t) <= tol
    for name, gm, gt in zip(("inputs", "initial state"), g_m, g_t):
        for leaf_m, leaf_t in zip(jax.tree.leaves(gm), jax.tree.leaves(gt)):
            assert scaled(leaf_m, leaf_t) <= 10 * tol, name


def test_fwd_mosaic_config_is_used_only_where_it_applies():
    from pallas_kernels.selective_scan import ScanBlockConfig
    from pallas_kernels.selective_scan.scan import make_problem, mosaic_applies

    a = make_inputs(1, 64, 128, 16, jnp.float32)
    B2 = jnp.stack([a["B"], a["B"]], axis=2)                     # two groups
    cfg = ScanBlockConfig(chunk=16, fwd_mosaic=True)
    make = lambda B, u=a["u"], reset=None: make_problem(u, a["A"], B, a["D"], a["z"], a["delta_bias"], reset,
                                                        delta_softplus=True, config=cfg)
    assert mosaic_applies(make(a["B"][:, :, None]), None)
    assert not mosaic_applies(make(B2), None)                                        # groups
    assert not mosaic_applies(make(a["B"][:, :, None]), jnp.ones((1, 64)))           # a reset mask
    assert not mosaic_applies(make(a["B"][:, :60, None], u=a["u"][:, :60]), None)   # T not whole chunks
    assert not mosaic_applies(make_problem(a["u"], a["A"], a["B"][:, :, None], None, None, None, None,
                                           delta_softplus=True, config=ScanBlockConfig(chunk=16)), None)   # off


def test_mosaic_through_the_fused_mamba1_mixer_core_with_packed_xz():
    """The train step's path: the mixer core op with the packed [x | z] in_proj output (the gate read in
    place at channel offset E) and fwd_mosaic + bwd_mosaic set through jmamba.ops.tuning: values and
    gradients as with the Triton kernels (CPU: both interpreted)."""
    import dataclasses

    from jmamba import ops
    from pallas_kernels.selective_scan import DEFAULT_CONFIG

    r = np.random.default_rng(7)
    bsz, T, E, n, rank, K = 1, 32, 128, 16, 8, 4
    f = lambda *s, scale=1.0: jnp.asarray(scale * r.normal(size=s), jnp.float32)
    xz = f(bsz, T, 2 * E)
    params = dict(conv_kernel=f(K, E, scale=0.5), conv_bias=f(E, scale=0.2), x_proj_kernel=f(E, rank + 2 * n, scale=E ** -0.5),
                  dt_proj_kernel=f(rank, E, scale=rank ** -0.5), dt_bias=f(E, scale=0.3) - 1.0,
                  A=-jnp.exp(f(E, n, scale=0.5)), D=f(E))

    def loss(config, xz, params):
        with ops.tuning("selective_scan", pallas_config=config):
            y = ops.mamba1_mixer_core(xz, None, params["conv_kernel"], params["conv_bias"], params["x_proj_kernel"],
                                      params["dt_proj_kernel"], params["dt_bias"], params["A"], params["D"],
                                      xz_packed=True, implementation="pallas")
        return jnp.sum(y * y), y

    base = dataclasses.replace(DEFAULT_CONFIG, chunk=16)
    run = lambda cfg: jax.value_and_grad(functools.partial(loss, cfg), argnums=(0, 1), has_aux=True)(xz, params)
    calls = []
    real_f, real_b = mosaic_module.mosaic_forward, backward_module.mosaic_backward
    with mock.patch.object(mosaic_module, "mosaic_forward", lambda *a, **k: calls.append(("f", k)) or real_f(*a, **k)), \
            mock.patch.object(backward_module, "mosaic_backward", lambda *a, **k: calls.append(("b", k)) or real_b(*a, **k)):
        (_, y_m), g_m = run(dataclasses.replace(base, fwd_mosaic=True, bwd_mosaic=True))
        kinds = [c[0] for c in calls]
        assert "f" in kinds and "b" in kinds                  # both Mosaic kernels ran, the gate read in place
        assert all(k["z_channel_offset"] == E for _, k in calls)
        calls.clear()
        (_, y_t), g_t = run(base)
        assert not calls
    np.testing.assert_allclose(np.asarray(y_m), np.asarray(y_t), rtol=1e-5, atol=1e-5 * np.abs(y_t).max())
    for leaf_m, leaf_t in zip(jax.tree.leaves(g_m), jax.tree.leaves(g_t)):
        np.testing.assert_allclose(np.asarray(leaf_m), np.asarray(leaf_t), rtol=1e-4,
                                   atol=1e-5 * max(np.abs(leaf_t).max(), 1.0))


def backward_cases():
    return [((1, 16, 128, 16), jnp.float32, {}, True, 2e-5),
            ((2, 16, 256, 8), jnp.bfloat16, dict(with_D=False), True, 2e-2),
            ((1, 24, 128, 16), jnp.float32, dict(with_z=False, with_D=False, with_bias=False, raw_delta=False), False,
             2e-5)]


@pytest.mark.parametrize("shape,dtype,options,softplus,tol", backward_cases(), ids=["f32", "bf16-no-D", "f32-bare"])
def test_interpreted_backward_matches_the_reference_vjp(shape, dtype, options, softplus, tol):
    """Every cotangent of mosaic_backward (incl. the initial state's) against JAX's VJP of the reference."""
    check_backward(shape, dtype, options, softplus, tol, interpret=True)


def check_backward(shape, dtype, options, softplus, tol, *, interpret):
    bsz, T, d, n = shape
    a = make_inputs(bsz, T, d, n, dtype, seed=2, **options)
    r = np.random.default_rng(3)
    h0 = jnp.asarray(r.normal(size=(bsz, d, n)) * 0.1, jnp.float32)
    d_out = jnp.asarray(r.normal(size=(bsz, T, d)), dtype)
    d_fin = jnp.asarray(r.normal(size=(bsz, d, n)), jnp.float32)
    primals = (a["u"], a["delta"], a["A"], a["B"], a["C"], a["D"], a["z"], a["delta_bias"], h0)

    def ref(u, delta, A, B, C, D, z, bias, h0):
        f32 = lambda x: None if x is None else x.astype(jnp.float32)
        return selective_scan_reference(f32(u), f32(delta), A, f32(B)[:, :, None], f32(C)[:, :, None], D, f32(z), bias,
                                        h0, None, delta_softplus=softplus)

    _, vjp = jax.vjp(ref, *primals)
    want = vjp((d_out.astype(jnp.float32), d_fin))
    got = jax.jit(lambda *p: mosaic_backward(*p, d_out, d_fin, softplus=softplus, interpret=interpret))(*primals)
    names = ("du", "d_delta", "dA", "dB", "dC", "dD", "dz", "d_delta_bias", "d_initial_state")
    for name, g, w, p in zip(names, got, want, primals[:8] + (h0,)):
        if p is None:
            assert g is None, name
            continue
        assert g.shape == p.shape, name
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.abs(g - w).max() <= tol * max(np.abs(w).max(), 1e-30), name


@pytest.mark.parametrize("dtype,with_z,with_D", [(jnp.bfloat16, True, True)])
def test_backward_lowers_for_cuda_at_the_benchmark_shape(dtype, with_z, with_D):
    S = jax.ShapeDtypeStruct
    bsz, T, d, n = 8, 2048, 1536, 16
    act = S((bsz, T, d), dtype)
    args = (act, act, S((d, n), jnp.float32), S((bsz, T, n), dtype), S((bsz, T, n), dtype),
            S((d,), jnp.float32) if with_D else None, act if with_z else None, S((d,), jnp.float32), None, act,
            S((bsz, d, n), jnp.float32))
    text = jax.jit(lambda *a: mosaic_backward(*a, softplus=True)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
def test_gpu_backward_matches_the_reference_vjp_at_the_benchmark_shape():
    check_backward((8, 2048, 1536, 16), jnp.bfloat16, {}, True, 3e-2, interpret=False)
