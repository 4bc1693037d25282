"""`jmamba.ops.finite_rows` (the non-finite guard's check of the carried state): the per-array XLA row
checks and the one-launch Pallas kernel (`pallas_kernels.finite_rows`, interpreted on the CPU) against
numpy: every single bad element (NaN, ±inf) at every position of small odd-sized arrays flags exactly
its row (masked last pieces, rows shorter than a piece, rows of several pieces), empty arrays and an
empty list, mixed float16 / bfloat16 / float32 arrays, several launches (`max_leaves_per_call`); huge
finite values stay finite; bad arguments are named; the guard reads it; the kernel lowers to one Triton
call per launch for an abstract H200 and declines under a mesh; and on the GPU itself against the XLA
checks for a Mamba-3 130M model's carried state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmamba.ops import FiniteRowsTuning, dispatch, finite_rows
from pallas_kernels.finite_rows import FiniteRowsConfig

SMALL = FiniteRowsConfig(block_size=16, max_leaves_per_call=3)
B = 3
# per-row sizes 1, 15, 16, 17, 40 (3 pieces of 16, the last masked), 0 (empty), 5x7
SHAPES = [(B, 1), (B, 15), (B, 16), (B, 17), (B, 2, 4, 5), (B, 0), (B, 5, 7)]
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
CONFIGS = [("reference", None), ("xla", None), ("pallas", SMALL),
           ("pallas", FiniteRowsConfig(block_size=64, max_leaves_per_call=1)), ("pallas", None)]
IDS = ["reference", "xla", "pallas-16x3", "pallas-64x1", "pallas-default"]


def leaves_of(shapes, seed):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=s) * 100.0, DTYPES[k % len(DTYPES)]) for k, s in enumerate(shapes)]


def check(leaves, impl, config):
    return jax.jit(lambda xs: finite_rows(xs, B, implementation=impl, tuning=FiniteRowsTuning(config)))(leaves)


@pytest.mark.parametrize("impl,config", CONFIGS, ids=IDS)
def test_all_finite_rows_are_true_even_for_huge_values(impl, config):
    leaves = leaves_of(SHAPES, 0)
    leaves[0] = leaves[0].at[1, 0].set(3e38)                 # finite: its square overflows, x·0 does not
    leaves[2] = leaves[2].at[2, 15].set(-65504.0)            # float16's largest
    got = check(leaves, impl, config)
    assert got.dtype == jnp.bool_ and got.shape == (B,)
    assert np.asarray(got).tolist() == [True] * B


@pytest.mark.parametrize("impl,config", CONFIGS[1:4], ids=IDS[1:4])
def test_every_bad_element_flags_exactly_its_row(impl, config):
    """One bad value at a time, at every position of every array: only its row is False (a piece read
    from the wrong row, a gap between pieces or a masked element read would show)."""
    base = leaves_of(SHAPES, 1)
    f = jax.jit(lambda xs: finite_rows(xs, B, implementation=impl, tuning=FiniteRowsTuning(config)))
    bads = [np.nan, np.inf, -np.inf]
    n = 0
    for k, x in enumerate(base):
        per_row = int(np.prod(x.shape[1:]))
        for b in range(B):
            for i in range(per_row):
                bad = bads[n % 3]
                n += 1
                leaves = list(base)
                leaves[k] = x.reshape(B, -1).at[b, i].set(bad).reshape(x.shape)
                want = [r != b for r in range(B)]
                assert np.asarray(f(leaves)).tolist() == want, (k, b, i, bad)
    assert n > 300


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_no_elements_leave_every_row_true(impl):
    tuning = FiniteRowsTuning(SMALL)
    assert np.asarray(finite_rows([], B, implementation=impl, tuning=tuning)).tolist() == [True] * B
    got = finite_rows([jnp.zeros((B, 0)), jnp.zeros((B, 0, 4))], B, implementation=impl, tuning=tuning)
    assert np.asarray(got).tolist() == [True] * B


def test_several_bad_rows_and_arrays_agree_with_numpy():
    rng = np.random.default_rng(5)
    shapes = [(B, 9), (B, 33), (B, 2, 3), (B, 100), (B, 16)] * 2
    for trial in range(6):
        leaves = leaves_of(shapes, 10 + trial)
        for _ in range(trial):
            k = int(rng.integers(len(leaves)))
            flat = leaves[k].reshape(B, -1)
            leaves[k] = flat.at[int(rng.integers(B)), int(rng.integers(flat.shape[1]))].set(np.nan).reshape(leaves[k].shape)
        want = np.all([np.isfinite(np.asarray(x, np.float32).reshape(B, -1)).all(axis=1) for x in leaves], axis=0)
        for impl, config in (("xla", None), ("pallas", SMALL)):
            assert np.asarray(check(leaves, impl, config)).tolist() == want.tolist(), (trial, impl)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="leaves must be a list or tuple"):
        finite_rows(jnp.ones((B, 3)), B)
    with pytest.raises(TypeError, match=r"leaves\[1\] must be a float16, bfloat16 or float32 array"):
        finite_rows([jnp.ones((B, 3)), jnp.ones((B, 3), jnp.int32)], B)
    with pytest.raises(ValueError, match=r"leaves\[0\] must have leading axis batch_size = 3"):
        finite_rows([jnp.ones((4, 3))], B)
    with pytest.raises(ValueError, match=r"leaves\[0\] must have leading axis"):
        finite_rows([jnp.ones(())], B)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            finite_rows([jnp.ones((B, 3))], bad)
    with pytest.raises(TypeError, match="pallas_config must be a FiniteRowsConfig"):
        FiniteRowsTuning(pallas_config={"block_size": 16})
    with pytest.raises(ValueError, match="FiniteRowsConfig.block_size must be a positive power of two"):
        FiniteRowsTuning(FiniteRowsConfig(block_size=100))
    with pytest.raises(ValueError, match="FiniteRowsConfig.max_leaves_per_call must be an int >= 1"):
        FiniteRowsConfig(max_leaves_per_call=0).validate()


def test_pallas_declines_under_a_mesh_and_is_opt_in():
    from jax.sharding import AbstractMesh, AxisType

    from jmamba.ops.reductions.finite import automatic_implementation

    mesh = AbstractMesh((2,), ("data",), (AxisType.Explicit,))
    leaves = [jax.ShapeDtypeStruct((B, 3), jnp.float32)]
    with jax.sharding.use_abstract_mesh(mesh):
        with pytest.raises(NotImplementedError, match="a mesh .* is active"):
            dispatch.choose("finite_rows", "pallas", platform="cuda", leaves=leaves)
        assert automatic_implementation(leaves, "cuda") == "xla"
    dispatch.choose("finite_rows", "pallas", platform="cuda", leaves=leaves)     # no mesh: runs
    # opt-in: no faster in the train step on an H100 (session 36), so never the automatic choice
    assert automatic_implementation(leaves, "cuda") == "xla"
    assert automatic_implementation(leaves, "cpu") == "xla"


def test_the_guard_restarts_exactly_the_bad_rows_through_the_kernel():
    from jmamba.training.guard import restart_nonfinite_rows

    state = {"a": jnp.ones((B, 4, 5)), "b": (jnp.full((B, 33), 2.0), jnp.ones((B, 2)))}
    state["b"] = (state["b"][0].at[2, 32].set(-np.inf), state["b"][1])
    with dispatch.prefer("finite_rows", "pallas"):
        clean, n = jax.jit(restart_nonfinite_rows)(state)
    assert int(n) == 1
    np.testing.assert_array_equal(np.asarray(clean["a"][2]), 0.0)
    np.testing.assert_array_equal(np.asarray(clean["b"][0][2]), 0.0)
    np.testing.assert_array_equal(np.asarray(clean["b"][0][:2]), 2.0)
    np.testing.assert_array_equal(np.asarray(clean["a"][:2]), 1.0)


def test_kernel_lowers_to_triton_for_h200():
    from helpers import lowered_for_h200
    from jmamba.ops.reductions import finite as glue

    # a Mamba-3 130M layer's carried state (angle, ssm, k, v) for 6 layers: 24 arrays, 2 launches
    layer = [(8, 24, 32), (8, 24, 64, 128), (8, 24, 128), (8, 24, 64)]
    specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in layer * 6]
    text = lowered_for_h200(lambda *xs: finite_rows(list(xs), 8, implementation="pallas",
                                                    tuning=FiniteRowsTuning(FiniteRowsConfig(max_leaves_per_call=16))),
                            *specs, glue_modules=(glue,))
    calls = [l for l in text.splitlines() if "__gpu$xla.gpu.triton" in l]
    assert len(calls) == 2 and "finite_rows" in text


@pytest.mark.gpu
def test_gpu_kernel_matches_the_xla_checks():
    layer = [(8, 24, 32), (8, 24, 64, 128), (8, 24, 128), (8, 24, 64)]
    leaves = leaves_of(layer * 24, 3)
    f = lambda impl: jax.jit(lambda xs: finite_rows(xs, 8, implementation=impl))
    assert np.asarray(f("pallas")(leaves)).tolist() == [True] * 8
    leaves[5] = leaves[5].at[3, 23, 63, 127].set(np.nan)
    leaves[90] = leaves[90].at[6, 0, 0].set(np.inf)
    leaves[0] = leaves[0].at[7].set(-np.inf)
    got, want = f("pallas")(leaves), f("xla")(leaves)
    assert np.asarray(got).tolist() == np.asarray(want).tolist() == [True, True, True, False, True, True, False, False]
