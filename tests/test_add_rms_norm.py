"""`jmamba.ops.add_rms_norm`: the Pallas kernels (`pallas_kernels.rms_norm`) against the plain-JAX
composition (the residual add, then `rms_norm` with its own custom VJP), and that composition against
float64 numpy; y, h and every cotangent (x, the residual, the weight) under cotangents of both
outputs, float32 / bf16 / f16, odd row counts and widths (padding), no residual; interpreted on the
CPU, lowered for an abstract H200, and on the GPU itself."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close
from jmamba.ops import RMSNormTuning, add_rms_norm
from pallas_kernels.rms_norm import NormBlockConfig

EPS = 1e-5


def make(shape, dtype, *, residual=True, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=shape), dtype)
    res = jnp.asarray(3.0 * rng.normal(size=shape), jnp.float32) if residual else None
    w = jnp.asarray(1.0 + 0.3 * rng.normal(size=shape[-1:]), jnp.float32)
    dy = jnp.asarray(rng.normal(size=shape), dtype)
    dh = jnp.asarray(rng.normal(size=shape), jnp.float32)
    return x, res, w, dy, dh


def run(impl, x, res, w, dy, dh, out_dtype, config=None):
    """(y, h, cotangents of (x, residual, weight)) of one call with the cotangents (dy, dh)."""
    tuning = RMSNormTuning(config) if config else None

    def f(x, res, w):
        return add_rms_norm(x, res, w, eps=EPS, out_dtype=out_dtype, implementation=impl, tuning=tuning)

    (y, h), vjp = jax.vjp(f, x, res, w)
    return y, h, vjp((dy.astype(out_dtype), dh if res is not None else jnp.zeros_like(h)))


CASES = [
    # shape, x dtype, out dtype, residual, config, tolerance
    ((2, 16, 768), jnp.bfloat16, jnp.bfloat16, True, None, 1e-2),                        # the model's width
    ((3, 7, 48), jnp.float32, jnp.float32, True, NormBlockConfig(block_rows=4), 2e-6),   # rows padded
    ((1, 5, 33), jnp.float16, jnp.float16, True, NormBlockConfig(block_rows=2, max_width=16), 3e-3),  # D padded
    ((4, 40), jnp.bfloat16, jnp.float32, True, NormBlockConfig(block_rows=16, max_width=16), 1e-2),  # 3 pieces
    ((2, 9, 24), jnp.float32, jnp.bfloat16, False, NormBlockConfig(block_rows=4), 1e-2),  # no residual
]


@pytest.mark.parametrize("shape,dtype,out_dtype,residual,config,tol", CASES,
                         ids=["model-width", "rows-padded", "cols-padded", "pieces", "no-residual"])
def test_pallas_matches_the_composition(shape, dtype, out_dtype, residual, config, tol):
    x, res, w, dy, dh = make(shape, dtype, residual=residual)
    got = run("pallas", x, res, w, dy, dh, out_dtype, config)
    want = run("xla", x, res, w, dy, dh, out_dtype)
    y, h, (gx, gres, gw) = got
    assert y.dtype == jnp.dtype(out_dtype) and y.shape == shape
    assert gx.dtype == x.dtype and gw.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(h), np.asarray(want[1]))       # the add is the same op
    assert_close("y", y, want[0], tol)
    assert_close("dx", gx, want[2][0], tol)
    assert_close("dweight", gw, want[2][2], 2e-5 if dtype == jnp.float32 else tol)
    if residual:
        assert gres.dtype == jnp.float32
        assert_close("dresidual", gres, want[2][1], 2e-6 if dtype == jnp.float32 else 5e-3)
    else:
        assert gres is None and h is x


def numpy_add_rms_norm(x, res, w, dy, dh):
    """(y, h, dx, dres, dw) in float64: the formulas of docs/numerics.md, differentiated by hand."""
    x, w, dy, dh = (np.asarray(a, np.float64) for a in (x, w, dy, dh))
    h = x + np.asarray(res, np.float64)
    r = 1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + EPS)
    xhat = h * r
    g = dy * w
    dn = r * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return xhat * w, h, dh + dn, dh + dn, (dy * xhat).reshape(-1, w.shape[0]).sum(0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_both_implementations_match_float64_numpy(impl):
    x, res, w, dy, dh = make((3, 5, 40), jnp.float32, seed=4)
    y, h, (gx, gres, gw) = run(impl, x, res, w, dy, dh, jnp.float32,
                               NormBlockConfig(block_rows=4, max_width=16) if impl == "pallas" else None)
    for name, got, want in zip(("y", "h", "dx", "dresidual", "dweight"), (y, h, gx, gres, gw),
                               numpy_add_rms_norm(x, res, w, dy, dh)):
        assert_close(name, got, want, 2e-6)


def test_pallas_reruns_are_bit_identical():
    x, res, w, dy, dh = make((2, 12, 48), jnp.bfloat16, seed=2)
    cfg = NormBlockConfig(block_rows=4, max_width=16)
    a = run("pallas", x, res, w, dy, dh, jnp.bfloat16, cfg)
    b = run("pallas", x, res, w, dy, dh, jnp.bfloat16, cfg)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_bad_arguments_are_named_before_anything_runs():
    x, res, w, _, _ = make((2, 3, 8), jnp.float32)
    with pytest.raises(TypeError, match="x must be a floating array"):
        add_rms_norm(jnp.zeros((2, 3, 8), jnp.int32), res, w, eps=EPS)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        add_rms_norm(x, res[:, :2], w, eps=EPS)
    with pytest.raises(ValueError, match=r"weight must have shape \[D\] = \(8,\)"):
        add_rms_norm(x, res, w[:4], eps=EPS)
    with pytest.raises(ValueError, match="eps must be a Python float >= 0"):
        add_rms_norm(x, res, w, eps=-1.0)
    with pytest.raises(TypeError, match="out_dtype must be a float dtype"):
        add_rms_norm(x, res, w, eps=EPS, out_dtype=jnp.int32)
    with pytest.raises(TypeError, match="tuning for add_rms_norm must be a RMSNormTuning"):
        add_rms_norm(x, res, w, eps=EPS, tuning=object())
    with pytest.raises(TypeError, match="pallas_config must be a NormBlockConfig"):
        RMSNormTuning(pallas_config={"block_rows": 8})
    with pytest.raises(ValueError, match="NormBlockConfig.block_rows must be a positive power of two"):
        RMSNormTuning(NormBlockConfig(block_rows=3))
    with pytest.raises(NotImplementedError, match="residual stream in float32"):
        add_rms_norm(x, res.astype(jnp.bfloat16), w, eps=EPS, implementation="pallas")


def test_the_automatic_choice_on_cpu_is_the_composition():
    x, res, w, _, _ = make((2, 3, 8), jnp.float32)
    text = jax.jit(lambda *a: add_rms_norm(*a, eps=EPS)).lower(x, res, w).as_text()
    assert "triton" not in text and "pallas" not in text


def _lowered(shape, residual, monkeypatch, out_dtype=jnp.bfloat16):
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from jmamba.ops.norms import pallas as glue
    monkeypatch.setattr(glue, "interpret_mode", lambda: False)     # compile, as on the GPU
    s = jax.ShapeDtypeStruct

    def f(x, res, w, dy, dh):
        def g(x, res, w):
            return add_rms_norm(x, res, w, eps=EPS, out_dtype=out_dtype, implementation="pallas")
        (y, h), vjp = jax.vjp(g, x, res, w)
        return y, h, vjp((dy, dh))

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    args = (s(shape, jnp.bfloat16), s(shape, jnp.float32) if residual else None, s(shape[-1:], jnp.float32),
            s(shape, jnp.bfloat16), s(shape, jnp.float32 if residual else jnp.bfloat16))
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("residual", [True, False])
def test_kernels_lower_to_triton_for_h200(residual, monkeypatch):
    text = _lowered((8, 2048, 768), residual, monkeypatch)
    calls = [l for l in text.splitlines() if "__gpu$xla.gpu.triton" in l]
    assert len(calls) == 2
    assert "add_rms_norm_forward" in text and "add_rms_norm_backward" in text


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,out_dtype,residual,config,tol", CASES + [
    ((8, 2048, 768), jnp.bfloat16, jnp.bfloat16, True, None, 1e-2),          # the benchmark shape
    ((8, 2048, 768), jnp.bfloat16, jnp.float32, True, None, 1e-2),           # the final norm
    ((3, 999, 768), jnp.float32, jnp.float32, True, NormBlockConfig(block_rows=16, num_warps=8), 2e-6),
], ids=["model-width", "rows-padded", "cols-padded", "pieces", "no-residual", "benchmark", "final", "odd-f32"])
def test_gpu_pallas_matches_the_composition(shape, dtype, out_dtype, residual, config, tol):
    test_pallas_matches_the_composition(shape, dtype, out_dtype, residual, config, tol)


@pytest.mark.parametrize("arch", ["mamba1", "mamba3"])
def test_backbone_with_the_kernels_matches_the_composition(arch):
    """The backbone's fused stack (each norm adds the previous block's output) gives the same output
    and parameter gradients with the interpreted kernels as with the XLA composition, and the same
    as with remat="layer" (which keeps the unfused blocks)."""
    from flax import nnx

    from builders import tiny_backbone
    from jmamba.ops import dispatch

    model = tiny_backbone(arch)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 16, model.config.backbone_input_dim)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(2, 16, model.config.d_model)), jnp.float32)

    def grads(impl, remat=None):
        with dispatch.prefer("add_rms_norm", impl):
            loss, g = nnx.value_and_grad(lambda m: jnp.sum(m(x, remat=remat)[0] * c))(model)
        return [loss] + jax.tree.leaves(nnx.state(g))

    want = grads("xla")
    for got in (grads("pallas"), grads("xla", remat="layer")):
        for a, b in zip(got, want):
            assert_close("backbone", a, b, 2e-6)
