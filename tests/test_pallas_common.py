"""pallas_kernels.common: size arithmetic, padding, flat grids, dtype aliases, the shared launch, and
that the kernel packages' configuration imports without loading a Pallas backend (checked in a fresh
interpreter: this test process has long imported Pallas)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import dtypes, sizes
from pallas_kernels.common.grid import FlatGrid
from pallas_kernels.common.padding import pad_axis_to

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------ sizes
def test_is_power_of_2_accepts_only_positive_int_powers():
    assert [x for x in range(-4, 70) if sizes.is_power_of_2(x)] == [1, 2, 4, 8, 16, 32, 64]
    for not_an_int in (True, False, 4.0, "4", None):
        assert not sizes.is_power_of_2(not_an_int), not_an_int


def test_power_of_2_bounds_match_brute_force():
    powers = [1 << k for k in range(13)]
    for x in range(1, 2050):
        assert sizes.next_power_of_2(x) == min(p for p in powers if p >= x), x
        assert sizes.largest_power_of_2_at_most(x) == max(p for p in powers if p <= x), x
        assert sizes.largest_power_of_2_dividing(x) == max(p for p in powers if x % p == 0), x
    assert sizes.next_power_of_2(0) == sizes.next_power_of_2(-3) == 1
    assert sizes.next_power_of_2(2 ** 40 + 1) == 2 ** 41
    with pytest.raises(ValueError, match="x >= 1"):
        sizes.largest_power_of_2_at_most(0)


def test_ceil_div_and_round_up():
    for a in range(0, 100):
        for b in (1, 2, 3, 7, 16):
            assert sizes.ceil_div(a, b) == int(np.ceil(a / b)), (a, b)
            r = sizes.round_up(a, b)
            assert r % b == 0 and a <= r < a + b, (a, b)
    assert sizes.round_up(37, 16) == 48 and sizes.round_up(48, 16) == 48


# ---------------------------------------------------------------------------------------- padding
def test_pad_axis_to_appends_the_fill_at_the_end_of_one_axis():
    x = jnp.arange(24, dtype=jnp.float32).reshape(2, 3, 4)
    y = pad_axis_to(x, 1, 5)
    assert y.shape == (2, 5, 4) and y.dtype == x.dtype
    np.testing.assert_array_equal(y[:, :3], x)
    np.testing.assert_array_equal(y[:, 3:], 0.0)
    ones = pad_axis_to(x, -1, 6, value=1.0)          # negative axis, a fill other than zero
    assert ones.shape == (2, 3, 6)
    np.testing.assert_array_equal(ones[..., :4], x)
    np.testing.assert_array_equal(ones[..., 4:], 1.0)


def test_pad_axis_to_keeps_dtype_and_is_a_no_op_at_the_length():
    x = jnp.ones((3, 2), jnp.bfloat16)
    assert pad_axis_to(x, 0, 3) is x                 # nothing traced when no padding is needed
    y = pad_axis_to(x, 0, 4)
    assert y.dtype == jnp.bfloat16 and y.shape == (4, 2)
    with pytest.raises(ValueError, match="shorter"):
        pad_axis_to(x, 0, 2)
    with pytest.raises(ValueError, match="out of range"):   # not wrapped around to axis 0
        pad_axis_to(x, 2, 4)


def test_pad_axis_to_under_jit_pads_static_shapes():
    f = jax.jit(lambda x: pad_axis_to(x, 1, 8))
    out = f(jnp.ones((2, 5, 3), jnp.float32))
    assert out.shape == (2, 8, 3)
    assert float(out.sum()) == 30.0


# ------------------------------------------------------------------------------------------- grid
@pytest.mark.parametrize("axes", [(2, 3, 4), (1, 5, 1), (3,), (2, 1, 3, 2), (4, 1)])
def test_flat_grid_is_row_major_with_the_last_axis_fastest(axes):
    grid = FlatGrid(axes)
    total = int(np.prod(axes))
    assert grid.size == (total,)
    for p in range(total):
        assert grid.coordinates(p) == tuple(int(i) for i in np.unravel_index(p, axes)), p
        assert all(grid.coordinate(p, a) == grid.coordinates(p)[a] for a in range(len(axes)))


def test_flat_grid_coordinates_of_a_traced_program_id():
    grid = FlatGrid((2, 3, 4))
    got = jax.jit(jax.vmap(lambda p: jnp.stack(grid.coordinates(p))))(jnp.arange(24, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.stack(np.unravel_index(np.arange(24), (2, 3, 4)), axis=1))


# ----------------------------------------------------------------------------------------- dtypes
def test_dtype_aliases():
    assert dtypes.F32 is jnp.float32 and dtypes.I32 is jnp.int32
    assert dtypes.SIXTEEN_BIT_FLOATS == (jnp.bfloat16, jnp.float16)
    for d in (jnp.bfloat16, jnp.float16, "bfloat16", np.dtype("float16")):
        assert dtypes.is_sixteen_bit_float(d), d
    for d in (jnp.float32, jnp.int16, "float64", jnp.uint8):
        assert not dtypes.is_sixteen_bit_float(d), d


def test_fused_adamw_compute_dtypes_are_the_sixteen_bit_floats():
    from pallas_kernels.fused_adamw import COMPUTE_DTYPES

    assert COMPUTE_DTYPES == dtypes.SIXTEEN_BIT_FLOATS


# ----------------------------------------------------------------------------------------- launch
def test_run_kernel_names_refs_skips_absent_inputs_and_returns_outputs_by_name():
    from jax.experimental import pallas as pl

    from pallas_kernels.common.launch import run_kernel

    grid = FlatGrid((2, 3))
    x = jnp.arange(6 * 4, dtype=jnp.float32).reshape(2, 3, 4)
    row = pl.BlockSpec((None, None, 4), lambda p: (grid.coordinate(p, 0), grid.coordinate(p, 1), 0))

    def body(refs):
        assert "bias" not in refs                      # an absent operand has no ref at all
        refs["double"][...] = 2.0 * refs["x"][...]
        refs["plus_one"][...] = refs["x"][...] + 1.0

    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    out = run_kernel(body, grid=grid.size, inputs=[("x", x, row), ("bias", None, row)],
                     outputs=[("double", shape, row), ("plus_one", shape, row)], name="common_launch_test",
                     num_warps=1, num_stages=1, interpret=True)
    assert set(out) == {"double", "plus_one"}
    np.testing.assert_array_equal(out["double"], 2.0 * x)
    np.testing.assert_array_equal(out["plus_one"], x + 1.0)


# ------------------------------------------------------------------------------------ lazy imports
def _run_fresh(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with this checkout first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_config_imports_do_not_load_pallas_and_entry_points_load_on_first_use():
    result = _run_fresh("""
        import sys

        import pallas_kernels.common.dtypes, pallas_kernels.common.grid, pallas_kernels.common.lazy
        import pallas_kernels.common.padding, pallas_kernels.common.sizes
        from pallas_kernels.fused_adamw import COMPUTE_DTYPES, AdamWStepScalars, KernelConfig
        from pallas_kernels.mamba3_siso import DEFAULT_CONFIG, Mamba3ScanConfig
        from pallas_kernels.mamba3_siso.config import chunk_length, make_geometry
        from pallas_kernels.selective_scan import DEFAULT_CONFIG, ScanBlockConfig
        import pallas_kernels.fused_adamw as adamw, pallas_kernels.mamba3_siso as m3, pallas_kernels.selective_scan as ss
        KernelConfig().validate(); Mamba3ScanConfig().validate(); ScanBlockConfig().validate()
        assert "jax.experimental.pallas" not in sys.modules, "a config import loaded Pallas"
        for package, name in ((ss, "selective_scan_pallas"), (m3, "chunked_scan"),
                              (adamw, "fused_adamw_leaves")):
            assert name in dir(package) and name in package.__all__, name
        entry = ss.selective_scan_pallas
        assert "jax.experimental.pallas" in sys.modules, "the entry point did not load its kernels"
        from pallas_kernels.selective_scan.scan import selective_scan_pallas
        from pallas_kernels.mamba3_siso.scan import chunked_scan
        from pallas_kernels.fused_adamw.kernel import fused_adamw_leaves
        assert entry is selective_scan_pallas
        assert m3.chunked_scan is chunked_scan
        assert adamw.fused_adamw_leaves is fused_adamw_leaves
        from pallas_kernels.selective_scan import backward, combine, forward, scan   # submodules still import
        from pallas_kernels.mamba3_siso import chunk_backward, core, qk_gradients, queries_keys
        try:
            ss.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("an unknown attribute did not raise AttributeError")
        print("ok")
        """)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
