"""`jmamba.ops.sum_of_squares` (the global gradient norm's square): the per-array XLA sums and the
one-launch Pallas kernel (`pallas_kernels.sum_of_squares`, interpreted on the CPU) against float64 numpy:
odd sizes (masked last pieces), arrays smaller than a piece, empty arrays and an empty list, mixed
float16 / bfloat16 / float32 arrays, several launches (`max_leaves_per_call`), wide value ranges; NaN
and inf propagate; reruns are bit-identical; bad arguments are named; the kernel lowers to one Triton
call per launch for an abstract H200 and declines under a mesh; and on the GPU itself against the
XLA sums for a 130M-parameter model's gradient shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmamba.ops import SumOfSquaresTuning, dispatch, sum_of_squares
from pallas_kernels.sum_of_squares import SumOfSquaresConfig

SMALL = SumOfSquaresConfig(block_size=16, max_leaves_per_call=3)


def leaves_of(shapes, seed, dtypes=(jnp.float32,)):
    rng = np.random.default_rng(seed)
    out = []
    for k, shape in enumerate(shapes):
        scale = 10.0 ** rng.integers(-3, 4)
        out.append(jnp.asarray(rng.normal(size=shape) * scale, dtypes[k % len(dtypes)]))
    return out


def want_of(leaves):
    return sum(float(np.sum(np.asarray(x.astype(jnp.float32), np.float64) ** 2)) for x in leaves)


SHAPES = [(37,), (3, 5), (0,), (16,), (2, 33, 4), (1,), (17, 16), (0, 4), (5,)]


@pytest.mark.parametrize("impl,config", [("reference", None), ("xla", None), ("pallas", SMALL),
                                         ("pallas", SumOfSquaresConfig(block_size=64, max_leaves_per_call=1)),
                                         ("pallas", None)],
                         ids=["reference", "xla", "pallas-16x3", "pallas-64x1", "pallas-default"])
def test_matches_float64(impl, config):
    leaves = leaves_of(SHAPES, 0, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16))
    got = jax.jit(lambda xs: sum_of_squares(xs, implementation=impl, tuning=SumOfSquaresTuning(config)))(leaves)
    assert got.dtype == jnp.float32 and got.shape == ()
    np.testing.assert_allclose(float(got), want_of(leaves), rtol=2e-6)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_no_elements_give_zero(impl):
    tuning = SumOfSquaresTuning(SMALL)
    assert float(sum_of_squares([], implementation=impl, tuning=tuning)) == 0.0
    assert float(sum_of_squares([jnp.zeros((0, 3))], implementation=impl, tuning=tuning)) == 0.0


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_nan_and_inf_propagate(impl):
    tuning = SumOfSquaresTuning(SMALL)
    for bad, check in ((np.nan, np.isnan), (np.inf, np.isposinf), (-np.inf, np.isposinf), (3e19, np.isposinf)):
        leaves = leaves_of(SHAPES, 1)
        leaves[4] = leaves[4].at[1, 30, 2].set(bad)        # in the last, masked piece of that array
        got = float(sum_of_squares(leaves, implementation=impl, tuning=tuning))
        assert check(got), f"{bad}: got {got}"


def test_pallas_reruns_are_bit_identical_and_order_is_fixed():
    leaves = leaves_of(SHAPES * 3, 2)
    f = jax.jit(lambda xs: sum_of_squares(xs, implementation="pallas", tuning=SumOfSquaresTuning(SMALL)))
    a, b = f(leaves), f(leaves)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_kernel_reads_each_array_exactly_once():
    """Every element counts once: an array of ones of each size gives its size (a gap or an overlap
    between the programs' pieces would show)."""
    sizes = [1, 15, 16, 17, 31, 32, 33, 100]
    leaves = [jnp.ones((n,), jnp.float32) for n in sizes]
    got = sum_of_squares(leaves, implementation="pallas", tuning=SumOfSquaresTuning(SMALL))
    assert float(got) == float(sum(sizes))


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="leaves must be a list or tuple"):
        sum_of_squares(jnp.ones(3))
    with pytest.raises(TypeError, match=r"leaves\[1\] must be a float16, bfloat16 or float32 array"):
        sum_of_squares([jnp.ones(3), jnp.ones(3, jnp.int32)])
    with pytest.raises(TypeError, match="pallas_config must be a SumOfSquaresConfig"):
        SumOfSquaresTuning(pallas_config={"block_size": 16})
    with pytest.raises(ValueError, match="SumOfSquaresConfig.block_size must be a positive power of two"):
        SumOfSquaresTuning(SumOfSquaresConfig(block_size=100))
    with pytest.raises(ValueError, match="SumOfSquaresConfig.max_leaves_per_call must be an int >= 1"):
        SumOfSquaresConfig(max_leaves_per_call=0).validate()


def test_pallas_declines_under_a_mesh_and_the_automatic_choice_follows():
    from jax.sharding import AbstractMesh, AxisType

    from jmamba.ops.reductions.squares import automatic_implementation

    mesh = AbstractMesh((2,), ("data",), (AxisType.Explicit,))
    leaves = [jax.ShapeDtypeStruct((3,), jnp.float32)]
    with jax.sharding.use_abstract_mesh(mesh):
        with pytest.raises(NotImplementedError, match="a mesh .* is active"):
            dispatch.choose("sum_of_squares", "pallas", platform="cuda", leaves=leaves)
        assert automatic_implementation(leaves, "cuda") == "xla"
    dispatch.choose("sum_of_squares", "pallas", platform="cuda", leaves=leaves)     # no mesh: runs
    assert automatic_implementation(leaves, "cuda") == "pallas"
    assert automatic_implementation(leaves, "cpu") == "xla"


def test_automatic_on_the_cpu_is_the_per_array_sums_bit_for_bit():
    leaves = leaves_of(SHAPES, 4, dtypes=(jnp.float32, jnp.bfloat16))
    got = jax.jit(lambda xs: sum_of_squares(xs))(leaves)
    want = jax.jit(lambda xs: sum_of_squares(xs, implementation="xla"))(leaves)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()


def test_kernel_lowers_to_triton_for_h200(monkeypatch):
    from helpers import lowered_for_h200
    from jmamba.ops.reductions import squares as glue

    # a Mamba-1 130M layer's gradient shapes, twice over, plus the embedding: 21 arrays, 2 launches
    layer = [(768,), (3072, 768), (1536, 4), (1536,), (80, 1536), (1536, 48), (1536,), (1536, 16), (1536,),
             (768, 1536)]
    shapes = [(50280, 768)] + layer * 2
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    text = lowered_for_h200(lambda *xs: sum_of_squares(list(xs), implementation="pallas",
                                                       tuning=SumOfSquaresTuning(SumOfSquaresConfig(max_leaves_per_call=16))),
                            *specs, glue_modules=(glue,))
    calls = [l for l in text.splitlines() if "__gpu$xla.gpu.triton" in l]
    assert len(calls) == 2 and "sum_of_squares" in text


@pytest.mark.gpu
def test_gpu_kernel_matches_the_xla_sums():
    layer = [(768,), (3072, 768), (1536, 4), (1536,), (80, 1536), (1536, 48), (1536,), (1536, 16), (1536,),
             (768, 1536)]
    leaves = leaves_of([(50280, 768)] + layer * 24 + [(768,)], 3)
    got = jax.jit(lambda xs: sum_of_squares(xs, implementation="pallas"))(leaves)
    want = jax.jit(lambda xs: sum_of_squares(xs, implementation="xla"))(leaves)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    np.testing.assert_allclose(float(got), want_of(leaves), rtol=1e-5)
    again = jax.jit(lambda xs: sum_of_squares(xs, implementation="pallas"))(leaves)
    assert np.asarray(got).tobytes() == np.asarray(again).tobytes()
