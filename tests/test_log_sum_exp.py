"""`jmamba.ops.log_sum_exp`: the two-pass reference, the variadic XLA reduction and the one-pass Pallas kernel
(`pallas_kernels.log_sum_exp`, interpreted on the CPU) against float64 numpy: rows whose max comes
first, last or in the middle, wide value ranges, widths that are not a multiple of the piece (masked
tail), row counts that are not a multiple of the block (padding), bf16 input, the edge rows (−inf,
NaN, +inf); lowering for an abstract H200; and the kernel on the GPU itself."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmamba.ops import LogSumExpTuning, log_sum_exp
from pallas_kernels.log_sum_exp import LogSumExpConfig

SMALL = LogSumExpConfig(block_rows=2, width=16)


def rows(length, seed):
    rng = np.random.default_rng(length + seed)
    x = rng.normal(size=(6, length)) * np.array([1, 10, 100, 1e3, 1, 1])[:, None]
    x[4] = np.sort(x[4])            # increasing: a new max at every piece
    x[5] = -np.sort(-x[5])          # decreasing: the max first
    return x


def want_of(x):
    x = np.asarray(x, np.float64)
    return np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1)) + x.max(-1)


@pytest.mark.parametrize("impl,config", [("reference", None), ("xla", None), ("pallas", SMALL),
                                         ("pallas", LogSumExpConfig(width=64))],
                         ids=["reference", "xla", "pallas-16", "pallas-64"])
@pytest.mark.parametrize("length", [1, 2, 37, 4099])
def test_matches_float64(impl, config, length):
    x = rows(length, 0)
    got = jax.jit(lambda a: log_sum_exp(a, implementation=impl, tuning=LogSumExpTuning(config)))(
        jnp.asarray(x, jnp.float32))
    assert got.dtype == jnp.float32 and got.shape == (6,)
    np.testing.assert_allclose(np.asarray(got), want_of(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_bf16_batched_input(impl):
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 50)) * 4, jnp.bfloat16)
    got = log_sum_exp(x, implementation=impl, tuning=LogSumExpTuning(SMALL if impl == "pallas" else None))
    assert got.shape == (3, 5)
    np.testing.assert_allclose(np.asarray(got), want_of(np.asarray(x.astype(jnp.float32))), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_edge_rows(impl):
    """−inf entries add nothing (an all −inf row gives −inf, never NaN from −inf − −inf); a NaN or
    +inf in the row gives a non-finite result."""
    inf = np.inf
    x = np.zeros((4, 20), np.float32)
    x[0] = -inf
    x[1, 1:] = -inf
    x[1, 0], x[1, 19] = 0.0, np.log(3.0)
    x[2, 5] = np.nan
    x[3, 7] = inf
    got = np.asarray(log_sum_exp(jnp.asarray(x), implementation=impl,
                                 tuning=LogSumExpTuning(SMALL if impl == "pallas" else None)))
    assert got[0] == -inf
    np.testing.assert_allclose(got[1], np.log(4.0), rtol=1e-6)
    assert np.isnan(got[2]) and not np.isfinite(got[3])


def test_pallas_reruns_are_bit_identical():
    x = jnp.asarray(rows(300, 3), jnp.float32)
    a, b = (log_sum_exp(x, implementation="pallas", tuning=LogSumExpTuning(SMALL)) for _ in range(2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="x must be a floating array"):
        log_sum_exp(jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"x must have shape \[..., V\] with V >= 1"):
        log_sum_exp(jnp.zeros((2, 0), jnp.float32))
    with pytest.raises(TypeError, match="pallas_config must be a LogSumExpConfig"):
        LogSumExpTuning(pallas_config={"width": 16})
    with pytest.raises(ValueError, match="LogSumExpConfig.width must be a positive power of two"):
        LogSumExpTuning(LogSumExpConfig(width=100))
    with pytest.raises(ValueError, match="LogSumExpConfig.num_stages must be an int >= 1"):
        LogSumExpConfig(num_stages=0).validate()


def test_kernel_lowers_to_triton_for_h200(monkeypatch):
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from jmamba.ops.reductions import pallas as glue
    monkeypatch.setattr(glue, "interpret_mode", lambda: False)     # compile, as on the GPU
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)
        text = jax.jit(lambda x: log_sum_exp(x, implementation="pallas")).trace(
            jax.ShapeDtypeStruct((8, 2048, 50280), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [l for l in text.splitlines() if "__gpu$xla.gpu.triton" in l]
    assert len(calls) == 1 and "log_sum_exp" in text


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((8, 2048, 50280), jnp.bfloat16), ((3, 77, 1001), jnp.float32)],
                         ids=["benchmark", "odd-f32"])
def test_gpu_kernel_matches_the_xla_reduction(shape, dtype):
    x = (3 * jax.random.normal(jax.random.key(0), shape, jnp.float32)).astype(dtype)
    got = jax.jit(lambda a: log_sum_exp(a, implementation="pallas"))(x)
    want = jax.jit(lambda a: log_sum_exp(a, implementation="xla"))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
    again = jax.jit(lambda a: log_sum_exp(a, implementation="pallas"))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))
