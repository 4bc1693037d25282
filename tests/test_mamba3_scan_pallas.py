"""Pallas Mamba-3 SISO scan vs the pure-JAX reference: values, final states and every cotangent (the
four initial states included), dispatch, lowering, determinism, vmap/jit/checkpoint.

CPU: the kernels run in the Pallas interpreter at tiny, deliberately awkward shapes (T not a multiple
of the chunk, several chunks, groups, headdim and d_state not powers of two, S = N/4, S = N/2, S = 0,
with and without Z / D / initial states, float32 and bfloat16), plus a lowering of forward+backward
for an abstract H200, so that an op the Triton lowering does not support fails here without a GPU.
Interpret-mode compiles dominate the run time (~10 s each), so each case is one jitted forward+VJP.
GPU (`-m gpu`, H200): the full matrix including the benchmark shape (B=8, T=2048, H=24, P=64, N=128), determinism, vmap, fallback. Run
them without pytest-xdist's `-n` (or with few workers): the reference's VJP at that shape keeps
every step's state, ~45 GB of GPU memory per process (two at once ran out of memory on the H200).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from unittest import mock

import jax
# The Pallas interpreter imports `pallas.fuser` on first use, which registers a config value in JAX's
# trace context and so invalidates every jit cache entry made before it; import it up front.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
import numpy as np
import pytest

from builders import MAMBA3_ARRAYS as ARRAYS
from builders import mamba3_scan_inputs, mamba3_state_shapes
from helpers import assert_close, rel_err
from jmamba.ops import Mamba3ScanState, Mamba3ScanTuning, dispatch, mamba3_siso_scan
from jmamba.ops.mamba3_siso_scan import pallas as pallas_glue
from jmamba.ops.mamba3_siso_scan.pallas import mamba3_siso_scan_pallas
from jmamba.ops.mamba3_siso_scan.reference import mamba3_siso_scan_reference
from pallas_kernels.mamba3_siso import Mamba3ScanConfig
from pallas_kernels.mamba3_siso.config import chunk_length, make_geometry
from pallas_kernels.mamba3_siso.qk_gradients_transposed import recomputes_theta

STATES = Mamba3ScanState._fields
# The queries' and keys' gradients rotated back in their chunk launches (head_gradients.py; off by default).
ROTATE_IN_CHUNKS = Mamba3ScanConfig(rotate_in_chunk_gradients=True)
# The stored-products defaults off (with one or two gradient launches they are refused).
NOT_STORED = dict(stored_scores=False, stored_ungated=False, keys_with_queries=False)   # any gradient_kernels
# Gradients that sum over (batch, time) or over a whole chunk of terms: compared at twice the tolerance.
SUMMED = ("ADT", "DT", "Angles", "Q_bias", "K_bias", "D", "angle")


def make_inputs(shape, dtype, *, with_z=True, with_D=True, with_states=True, seed=0):
    """(arrays dict, initial state or None) like the mixer's: activations in `dtype`, the rest f32.

    shape = (Bt, T, H, G, N, P, S); Angles per head [Bt, T, H, S] (the op broadcasts shared ones).
    """
    return mamba3_scan_inputs(shape, dtype, with_z=with_z, with_D=with_D, with_states=with_states, seed=seed)


def cotangents(arrays, seed=1):
    """Random cotangents of out (in V's dtype) and of the four final states (float32)."""
    r = np.random.default_rng(seed)
    bsz, T, H, P = arrays["V"].shape
    N, S = arrays["Q"].shape[-1], arrays["Angles"].shape[-1]
    d_out = jnp.asarray(r.normal(size=(bsz, T, H, P)), arrays["V"].dtype)
    d_final = Mamba3ScanState(*(jnp.asarray(r.normal(size=s), jnp.float32)
                                for s in mamba3_state_shapes((bsz, T, H, 1, N, P, S))))
    return d_out, d_final


@functools.partial(jax.jit, static_argnames=("impl", "present", "tuning"))
def _value_and_vjp(impl, present, tuning, arrays, states, d_out, d_final):
    """(out, final states, cotangents of the present arrays, cotangents of the initial states)."""
    def f(vals, states):
        kw = dict(zip(present, vals))
        out, final = impl(*[kw.get(k) for k in ARRAYS], states, None, tuning=tuning)
        return out, Mamba3ScanState(*final)

    (out, final), vjp = jax.vjp(f, arrays, states)
    d_arrays, d_states = vjp((d_out, d_final))
    return out, final, d_arrays, d_states


def run_both(arrays, states, chunk_size, config=None):
    """The Pallas implementation (interpreted on CPU) and the reference on the same call."""
    present = tuple(k for k in ARRAYS if arrays[k] is not None)
    vals = tuple(arrays[k] for k in present)
    d_out, d_final = cotangents(arrays)
    tuning = Mamba3ScanTuning(chunk_size=chunk_size, pallas_config=config)
    got = _value_and_vjp(mamba3_siso_scan_pallas, present, tuning, vals, states, d_out, d_final)
    # the reference ignores `tuning`: one fixed value lets every config at a shape reuse its compile
    want = _value_and_vjp(mamba3_siso_scan_reference, present, Mamba3ScanTuning(), vals, states, d_out, d_final)
    return present, got, want


def check_against_reference(arrays, states, chunk_size, tol, config=None):
    present, (out, final, d_arrays, d_states), (w_out, w_final, w_arrays, w_states) = run_both(
        arrays, states, chunk_size, config)
    assert out.dtype == arrays["V"].dtype and out.shape == arrays["V"].shape
    assert_close("out", out, w_out, tol)
    for name, got, want in zip(STATES, final, w_final):
        assert got.dtype == jnp.float32 and got.shape == want.shape, name
        assert_close(f"final {name}", got, want, tol)
    assert len(d_arrays) == len(present)
    for name, got, want in zip(present, d_arrays, w_arrays):
        assert got.dtype == arrays[name].dtype and got.shape == arrays[name].shape, name
        assert_close(f"d{name}", got, want, tol * (2 if name in SUMMED else 1))
    if states is not None:
        for name, got, want in zip(STATES, d_states, w_states):
            assert got.dtype == jnp.float32, name
            assert_close(f"d initial {name}", got, want, tol * (2 if name in SUMMED else 1))
    return out, final, d_arrays, d_states


# (id, shape (Bt, T, H, G, N, P, S), dtype, options, chunk_size, tol). The kernels' chunk is at least 16.
CASES = [
    # 3 chunks, the last partial; 2 groups of 2 heads; S = N/4 (rope_fraction 0.5); P padded 3 -> 16
    ("f32-groups-states-z", (2, 37, 4, 2, 8, 3, 2), jnp.float32, dict(), 16, 2e-5),
    # S = N/2 (rope_fraction 1.0, no unrotated part); bf16 activations (bf16 tensor-core dots); chunk 32
    ("bf16-fullrope-states-z", (1, 70, 2, 1, 6, 4, 3), jnp.bfloat16, dict(), 32, 2e-2),
    # S = 0 (no rotation at all), no Z (the is_outproj_norm call), no D, fresh sequence
    ("f32-no-angles-bare", (1, 20, 2, 1, 8, 16, 0), jnp.float32,
     dict(with_z=False, with_D=False, with_states=False), 16, 2e-5),
    # N odd (7 = 2·1 + 5), 3 groups of 2 heads, P = 20 (padded to 32), chunk_size 5 (rounded up to 16)
    ("f32-odd-dims-groups", (2, 50, 6, 3, 7, 20, 1), jnp.float32, dict(), 5, 2e-5),
]


@pytest.mark.parametrize("shape,dtype,options,chunk_size,tol", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_values_and_every_cotangent_match_reference(shape, dtype, options, chunk_size, tol):
    arrays, states = make_inputs(shape, dtype, **options)
    check_against_reference(arrays, states, chunk_size, tol)


def test_two_runs_are_bit_identical():
    """Partial sums (group and bias gradients) are reduced in a fixed order: no run-to-run noise."""
    arrays, states = make_inputs(CASES[0][1], jnp.float32)
    _, first, _ = run_both(arrays, states, 16)
    _, second, _ = run_both(arrays, states, 16)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_stored_states_stay_close_to_reference():
    """The optional bf16 storage of chunk-boundary states (as the official kernel) only adds rounding."""
    arrays, states = make_inputs((1, 40, 2, 1, 8, 16, 2), jnp.bfloat16, seed=5)
    check_against_reference(arrays, states, 16, 2e-2, Mamba3ScanConfig(stored_state_dtype="bfloat16"))


def test_16_bit_query_key_gradients_stay_close_to_reference():
    """qk_gradient_dtype="dot_operand" with float16 dots (dq, dk̃ between the launches in f16) only adds
    one rounding: every value and cotangent within the 16-bit tolerance. (The default, "bfloat16_dots",
    runs in every bf16 case of this file.) Which dtype each choice gives for each dot dtype."""
    arrays, states = make_inputs((1, 40, 2, 1, 8, 16, 2), jnp.float16, seed=5)
    check_against_reference(arrays, states, 16, 2e-2, Mamba3ScanConfig(qk_gradient_dtype="dot_operand"))

    def dtype(choice, mm):
        return make_geometry(batch=1, seqlen=40, heads=2, groups=1, headdim=16, d_state=8, num_angles=2,
                             chunk_size=16, has_z=True, matmul_dtype=mm, io_dtype=mm,
                             config=Mamba3ScanConfig(qk_gradient_dtype=choice)).qk_gradient_dtype
    assert dtype("bfloat16_dots", jnp.bfloat16) == jnp.bfloat16
    assert dtype("bfloat16_dots", jnp.float16) == jnp.float32 and dtype("bfloat16_dots", jnp.float32) == jnp.float32
    assert dtype("dot_operand", jnp.float16) == jnp.float16 and dtype("dot_operand", jnp.float32) == jnp.float32
    assert dtype("float32", jnp.bfloat16) == jnp.float32


@pytest.mark.parametrize("with_z,kernels", [(True, 1), (False, 1), (True, 2), (False, 2), (False, 3)])
def test_chunk_gradients_in_one_two_or_three_launches_match_reference(with_z, kernels):
    """config.gradient_kernels (3, the default, is in every other test): the same gradients, each launch
    with its own share of the products and of the two formulas for ⟨dY_i, Q_i S_cᵀ⟩ in dADT."""
    arrays, states = make_inputs((2, 37, 4, 2, 8, 3, 2), jnp.float32, with_z=with_z, seed=6)
    config = Mamba3ScanConfig(gradient_kernels=kernels, **({} if kernels == 3 else NOT_STORED))
    check_against_reference(arrays, states, 16, 2e-5, config)


@pytest.mark.parametrize("with_z,scores,ungated,keys,dtype,tol", [
    (True, False, False, False, jnp.float32, 2e-5), (True, True, False, False, jnp.float32, 2e-5),
    (True, False, True, False, jnp.float32, 2e-5), (True, True, True, True, jnp.bfloat16, 2e-2),
    (False, True, True, True, jnp.float32, 2e-5)],
    ids=["nothing-stored-z-f32", "scores-z-f32", "ungated-z-f32", "keys-too-bf16", "keys-no-z-f32"])
def test_stored_scores_and_ungated_output_match_reference(with_z, scores, ungated, keys, dtype, tol):
    """config.stored_scores / stored_ungated / stored_for_keys: the values (and keys) launches read the
    forward's masked scores and ungated Y instead of forming them (without Z there is no Y to keep; the
    keys launch then forms Q·S_cᵀ again): the same values and cotangents. Both stored, the default, is
    in every other test; nothing stored is the formed-again path."""
    arrays, states = make_inputs((2, 37, 4, 2, 8, 3, 2), dtype, with_z=with_z, seed=13)
    config = Mamba3ScanConfig(stored_scores=scores, stored_ungated=ungated, stored_for_keys=keys)
    check_against_reference(arrays, states, 16, tol, config)


def _small_geometry_and_stored(with_z, dtype, config):
    """(geometry, the forward's stored products by name) of the (2, 37, 4, 2, 8, 3, 2) cases below: which
    launch forms what is decided from these."""
    geo = make_geometry(batch=2, seqlen=37, heads=4, groups=2, headdim=3, d_state=8, num_angles=2, chunk_size=16,
                        has_z=with_z, matmul_dtype=dtype, io_dtype=dtype, config=config)
    return geo, {"scores": 0} | ({"ungated": 0} if with_z else {})


@pytest.mark.parametrize("with_z,keys,adt,dtype,tol", [
    (True, False, False, jnp.float32, 2e-5), (True, False, False, jnp.bfloat16, 2e-2),
    (True, True, True, jnp.float32, 2e-5), (False, False, True, jnp.float32, 2e-5)],
    ids=["keys-launch-z-f32", "keys-launch-z-bf16", "f32-scores-z-f32", "no-z-f32"])
def test_adt_in_the_values_or_keys_launch_matches_reference(with_z, keys, adt, dtype, tol):
    """config.adt_in_values (the default, in every other test with Z: dADT formed by the values launch
    from the stored scores and Y, the keys launch only dK̃) off, i.e. dADT in the keys launch; on with
    stored_for_keys (float32 scores); on without Z (no Y stored: the keys launch keeps it). Every value
    and cotangent, dADT included."""
    from pallas_kernels.mamba3_siso.chunk_backward import forms_adt_with_values
    arrays, states = make_inputs((2, 37, 4, 2, 8, 3, 2), dtype, with_z=with_z, seed=17)
    config = Mamba3ScanConfig(adt_in_values=adt, stored_for_keys=keys)
    check_against_reference(arrays, states, 16, tol, config)
    assert forms_adt_with_values(*_small_geometry_and_stored(with_z, dtype, config)) == (with_z and adt)


@pytest.mark.parametrize("with_z,dtype,tol,rho", [(True, jnp.float32, 2e-5, True), (True, jnp.bfloat16, 2e-2, True),
                                                  (True, jnp.float32, 2e-5, False), (False, jnp.bfloat16, 2e-2, True)],
                         ids=["z-f32", "z-bf16", "z-f32-state-dot-in-values", "no-z-bf16"])
def test_keys_and_queries_in_one_launch_match_reference(with_z, dtype, tol, rho):
    """config.keys_with_queries: dK̃ and dQ from one launch (dADT with the values when Z, with the keys
    without), with the chunk's e^{cs_end}⟨S_c, dS⟩ formed by that launch for the values launch
    (state_dot_with_keys, only with Z) or by the values launch itself: every value and cotangent."""
    from pallas_kernels.mamba3_siso.chunk_backward import state_dot_with_keys
    arrays, states = make_inputs((2, 37, 4, 2, 8, 3, 2), dtype, with_z=with_z, seed=19)
    config = Mamba3ScanConfig(keys_with_queries=True, state_dot_with_keys=rho)
    check_against_reference(arrays, states, 16, tol, config)
    assert state_dot_with_keys(*_small_geometry_and_stored(with_z, dtype, config)) == (with_z and rho)


# Shapes whose every kernel-layout piece is at least 16 wide (S = 16 -> even | odd 16 each), so that
# rotate_in_chunk_gradients (off by default) forms the queries' and keys' gradients and rotates them
# back in their chunk launches (head_gradients.py); with 8-wide pieces the query/key gradient kernel runs.
HEAD_GRADIENT_CASES = [
    # per-head angles, 2 groups of 2 heads, 3 chunks (the last partial), P padded 3 -> 16
    ("f32-per-head-groups", (2, 37, 4, 2, 64, 3, 16), jnp.float32, False, None, 16, 2e-5),
    # angles shared by the heads (the model's case), N = 48 (rest 16 + 16 zeros), chunk 32
    ("bf16-shared", (1, 70, 2, 1, 48, 16, 16), jnp.bfloat16, True, None, 32, 2e-2),
    # the reverse angle sums by triangular dot, 4 warps
    ("f32-shared-matmul-sums", (2, 37, 4, 1, 64, 16, 16), jnp.float32, True,
     dict(angle_sums="matmul", num_warps_head_grad=8), 16, 2e-5),
    # both sides in one launch
    ("f32-per-head-one-launch", (2, 37, 4, 2, 64, 3, 16), jnp.float32, False, dict(head_gradient_launches=1), 16, 2e-5),
    # S = 0: no rotation, only the rest piece
    ("f32-no-angles", (1, 40, 2, 1, 16, 16, 0), jnp.float32, False, None, 16, 2e-5),
]


@pytest.mark.parametrize("shape,dtype,shared,options,chunk_size,tol", [c[1:] for c in HEAD_GRADIENT_CASES],
                         ids=[c[0] for c in HEAD_GRADIENT_CASES])
def test_rotation_in_the_chunk_gradient_launch_matches_reference(shape, dtype, shared, options, chunk_size, tol):
    """config.rotate_in_chunk_gradients: every value and cotangent."""
    arrays, states = make_inputs(shape, dtype, seed=21)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    check_against_reference(arrays, states, chunk_size, tol, dataclasses.replace(ROTATE_IN_CHUNKS, **(options or {})))


@pytest.mark.parametrize("shape,shared,config", [
    ((2, 37, 4, 2, 8, 3, 2), False, Mamba3ScanConfig(fast_rotation=True, fast_rotation_backward=True)),
    ((2, 37, 4, 1, 64, 16, 16), True, dataclasses.replace(ROTATE_IN_CHUNKS, fast_rotation=True,
                                                          fast_rotation_backward=True)),
    ((2, 37, 4, 2, 8, 3, 2), True, Mamba3ScanConfig(fast_rotation=True, fast_rotation_backward=False)),
    ((2, 37, 4, 1, 64, 16, 16), False, dataclasses.replace(ROTATE_IN_CHUNKS, fast_rotation=False,
                                                           fast_rotation_backward=True))],
    ids=["query-key-gradient-kernel", "rotation-in-chunk-gradients", "forward-only", "backward-only"])
def test_fast_rotation_matches_reference(shape, shared, config):
    """config.fast_rotation (cos / sin from θ − π; the hardware's approximations on the GPU) at each
    place the kernels rotate, in both passes or in one (fast_rotation_backward): every value and
    cotangent, angles per head and shared."""
    arrays, states = make_inputs(shape, jnp.float32, seed=24)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    check_against_reference(arrays, states, 16, 2e-5, config)


@pytest.mark.parametrize("shape,config", [
    ((2, 37, 4, 2, 8, 3, 2), Mamba3ScanConfig(fast_math=True)),                  # keys+queries, values, walks
    ((2, 37, 4, 1, 64, 16, 16), dataclasses.replace(ROTATE_IN_CHUNKS, fast_math=True)),   # head launches
    ((2, 37, 4, 2, 8, 3, 2), Mamba3ScanConfig(fast_math=True, state_passes="split", **NOT_STORED))],
    ids=["default-launches", "rotation-in-chunk-gradients", "split-passes-nothing-stored"])
def test_fast_math_matches_reference(shape, config):
    """config.fast_math (σ(Z) as 1 / (1 + 2^(−Z·log2 e)) and the decays e^x as 2^(x·log2 e); ex2 / rcp
    on the GPU) in every kernel that gates or decays: every value and cotangent, the four states'
    included."""
    arrays, states = make_inputs(shape, jnp.float32, seed=27)
    check_against_reference(arrays, states, 16, 2e-5, config)


ANGLE_PASS = Mamba3ScanConfig(qk_gradients_transposed=True, angle_gradient_pass=True)


@pytest.mark.parametrize("shape,shared,chunk_size,config", [
    ((2, 37, 4, 2, 8, 3, 2), False, 16, Mamba3ScanConfig(qk_gradients_transposed=True, angle_gradient_pass=False)),
    ((2, 50, 4, 1, 16, 8, 4), True, 32, Mamba3ScanConfig(qk_gradients_transposed=True, qk_grad_blocks=2)),
    ((1, 20, 2, 1, 8, 16, 0), False, 16, Mamba3ScanConfig(qk_gradients_transposed=True, gradient_kernels=3,
                                                          **NOT_STORED)),
    ((2, 37, 4, 2, 8, 3, 2), True, 16, Mamba3ScanConfig(transposed_gradient_dots=True)),
    ((2, 37, 4, 2, 8, 3, 2), False, 16, Mamba3ScanConfig(qk_gradients_transposed=True, stored_theta=True,
                                                         position_major_d_angles=True, angle_gradient_pass=False)),
    ((2, 50, 4, 1, 16, 8, 4), False, 32, Mamba3ScanConfig(qk_gradients_transposed=True, qk_grad_blocks=2,
                                                          stored_theta=True)),
    ((2, 37, 4, 2, 8, 3, 2), True, 16, Mamba3ScanConfig(position_major_d_angles=True)),
    ((2, 37, 4, 2, 8, 3, 2), False, 16, ANGLE_PASS)],
    ids=["per-head-angles-groups", "shared-angles-two-blocks-stored-theta", "no-angles-separate-launches",
         "shared-angles-transposed-dots", "per-head-angles-theta-and-d-angles-position-major",
         "per-head-angles-two-blocks-theta-position-major", "shared-angles-d-angles-position-major",
         "per-head-angles-angle-gradient-pass"])
def test_position_major_query_key_gradients_match_reference(shape, shared, chunk_size, config):
    """config.qk_gradients_transposed (the query/key gradient kernel on [width, rows] tiles, dq and dk̃
    written position-major, θ recomputed): every value and cotangent, angles per head and shared, a
    chunk cut into two row blocks (θ then stored by the forward), no angles with dq and dk̃ from
    separate launches, dq and dk̃ formed by transposed dots (transposed_gradient_dots), θ stored
    position-major by the forward (stored_theta; whole chunks and two row blocks per chunk), the
    angles' gradient written position-major (position_major_d_angles), and finished by its own kernel
    with the chunk-entry angles formed inside the core (angle_gradient_pass)."""
    arrays, states = make_inputs(shape, jnp.float32, seed=29)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    if config is ANGLE_PASS:     # the path is on at this shape (not a silent fallback)
        bsz, T, H, G, N, P, S = shape
        assert make_geometry(batch=bsz, seqlen=T, heads=H, groups=G, headdim=P, d_state=N, num_angles=S,
                             chunk_size=chunk_size, has_z=True, matmul_dtype=jnp.float32, io_dtype=jnp.float32,
                             config=config).angle_pass
    check_against_reference(arrays, states, chunk_size, 2e-5, config)


@pytest.mark.parametrize("num_angles,shared,config,position_major,angle_pass", [
    (32, False, Mamba3ScanConfig(), True, True),                        # per-head angles: the pass
    (32, True, Mamba3ScanConfig(), True, False),                        # shared angles (the model's)
    (32, False, Mamba3ScanConfig(qk_grad_blocks=2), False, False),     # 32-row programs: row-major
    (32, False, Mamba3ScanConfig(rotate_in_chunk_gradients=True), False, False),
    (32, False, Mamba3ScanConfig(angle_gradient_pass=False), False, False),
    (32, False, Mamba3ScanConfig(qk_gradients_transposed=False), False, False),
    (32, False, Mamba3ScanConfig(bias_gradients_by_xla=True), False, False),
    (0, False, Mamba3ScanConfig(), False, False)],
    ids=["per-head", "shared", "two-blocks", "rotate-in-chunks", "pass-off", "row-major-asked", "bias-by-xla",
         "no-angles"])
def test_automatic_query_key_gradient_layout(num_angles, shared, config, position_major, angle_pass):
    """qk_gradients_transposed=None: the position-major kernel for shared angles, and for per-head angles
    where the angle gradient pass runs (whole chunks per program, no rotation in the chunk launches);
    the row-major kernel otherwise."""
    geo = make_geometry(batch=8, seqlen=2048, heads=24, groups=1, headdim=64, d_state=128, num_angles=num_angles,
                        chunk_size=64, has_z=True, matmul_dtype=jnp.bfloat16, io_dtype=jnp.bfloat16, config=config,
                        shared_angles=shared)
    assert (geo.qk_grad_position_major, geo.angle_pass) == (position_major, angle_pass)


@pytest.mark.parametrize("config,kernels_gating", [
    (Mamba3ScanConfig(fast_math=True), 4),        # chunk outputs, adjoint walk, keys+queries, values
    (Mamba3ScanConfig(), 0)], ids=["fast-gate", "default"])
def test_fast_math_lowers_to_the_hardware_reciprocal(config, kernels_gating):
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    gating = [l for l in text.splitlines() if "__gpu$xla.gpu.triton" in l and "rcp.approx.ftz.f32" in l]
    assert len(gating) == kernels_gating


@pytest.mark.parametrize("N,S,with_z,option,fused", [
    (64, 16, True, {}, True), (16, 0, True, {}, True),
    (64, 16, False, {}, False),                                       # no Z: dADT with the keys launch
    (8, 2, True, {}, False),                                          # 8-wide pieces: no dot that narrow
    (64, 16, True, {"rotate_in_chunk_gradients": False}, False),      # the default
    (64, 16, True, {"adt_in_values": False}, False)])
def test_rotation_in_the_chunk_gradient_launch_runs_only_where_it_applies(N, S, with_z, option, fused):
    from pallas_kernels.mamba3_siso.head_gradients import fuses_rotation
    geo = make_geometry(batch=2, seqlen=37, heads=4, groups=2, headdim=3, d_state=N, num_angles=S, chunk_size=16,
                        has_z=with_z, matmul_dtype=jnp.float32, io_dtype=jnp.float32,
                        config=dataclasses.replace(ROTATE_IN_CHUNKS, **option))
    stored = {"scores": 0} | ({"ungated": 0} if with_z else {})
    assert fuses_rotation(geo, stored) == fused


@pytest.mark.parametrize("shape,dtype,options,config,chunk_size,tol", [
    ((2, 37, 4, 2, 8, 3, 2), jnp.float32, {}, {}, 16, 2e-5),                        # 3 chunks, a padded one
    ((2, 37, 4, 2, 8, 3, 2), jnp.float32, dict(with_z=False, with_states=False), {}, 16, 2e-5),
    ((1, 70, 2, 1, 6, 20, 3), jnp.bfloat16, {}, dict(walk_block_p=16), 16, 2e-2),  # 2 row blocks per head
    ((2, 16, 2, 1, 8, 3, 2), jnp.float32, {}, {}, 16, 2e-5),                        # one chunk
    ((1, 50, 2, 2, 8, 3, 2), jnp.float16, {}, dict(num_warps_walk=8), 16, 2e-2),
    ((1, 50, 2, 2, 8, 3, 2), jnp.float32, {}, dict(num_warps_adjoint_walk=8), 16, 2e-5),
], ids=["f32-z", "f32-no-z-no-states", "bf16-two-row-blocks", "f32-one-chunk", "f16", "f32-adjoint-walk-warps"])
def test_walking_state_passes_match_reference(shape, dtype, options, config, chunk_size, tol):
    """config.state_passes="walk" (the default: each chunk's contribution formed inside the walk over the
    chunks, in both passes) at several row blocks and warps: every value and cotangent, the four
    states' included."""
    arrays, states = make_inputs(shape, dtype, seed=26, **options)
    check_against_reference(arrays, states, chunk_size, tol, Mamba3ScanConfig(state_passes="walk", **config))


@pytest.mark.parametrize("shape,dtype,config,tol", [
    ((2, 37, 4, 2, 8, 3, 2), jnp.float32, {}, 2e-5),
    ((1, 70, 2, 1, 6, 20, 3), jnp.bfloat16, dict(state_block_p=16, num_warps_state=8), 2e-2),
], ids=["f32", "bf16"])
def test_split_state_passes_match_reference(shape, dtype, config, tol):
    """config.state_passes="split" (a parallel contribution launch, then a combine, per pass)."""
    arrays, states = make_inputs(shape, dtype, seed=28)
    check_against_reference(arrays, states, 16, tol, Mamba3ScanConfig(state_passes="split", **config))


@pytest.mark.parametrize("shape,dtype,options,config,chunk_size,tol", [
    ((2, 37, 4, 2, 8, 3, 2), jnp.float32, {}, {}, 16, 2e-5),
    ((2, 37, 4, 2, 8, 3, 2), jnp.float32, dict(with_z=False), {}, 16, 2e-5),       # dADT with the keys launch
    ((1, 70, 2, 1, 6, 4, 3), jnp.bfloat16, {}, {}, 32, 2e-2),
    ((2, 37, 4, 2, 64, 3, 16), jnp.float32, {}, dict(rotate_in_chunk_gradients=True), 16, 2e-5),
    ((2, 37, 4, 2, 8, 3, 2), jnp.float32, {}, dict(gradient_kernels=1, **NOT_STORED), 16, 2e-5),
], ids=["f32-z", "f32-no-z", "bf16", "f32-rotate-in-chunks", "f32-one-gradient-launch"])
def test_skip_term_as_a_per_position_weight_matches_reference(shape, dtype, options, config, chunk_size, tol):
    """config.skip_in_scores=False: skip = D + γ⟨q̄, k̄⟩ as a float32 weight of V per position, its γ·d skip
    terms in the query/key gradient kernel (the default, γ⟨q̄, k̄⟩ as the scores' diagonal with weight
    γ/s, is what every other test here runs): every value and cotangent."""
    arrays, states = make_inputs(shape, dtype, seed=24, **options)
    check_against_reference(arrays, states, chunk_size, tol, Mamba3ScanConfig(skip_in_scores=False, **config))


def _walk_operand_counts(with_states, final_used=True):
    """{walk launch name: (operands, results)} in the jaxpr of the op's forward + backward (final_used
    False: the loss uses only the output, so the final states' cotangents are symbolic zeros)."""
    arrays, states = make_inputs((2, 40, 4, 1, 16, 8, 4), jnp.float32, with_states=with_states, seed=34)
    present = tuple(k for k in ARRAYS if arrays[k] is not None)
    d_out, d_final = cotangents(arrays)

    def f(vals, states):
        kw = dict(zip(present, vals))
        out, final = mamba3_siso_scan_pallas(*[kw.get(k) for k in ARRAYS], states, None,
                                             tuning=Mamba3ScanTuning(chunk_size=16))
        return (out, Mamba3ScanState(*final)) if final_used else out

    jaxpr = jax.make_jaxpr(lambda v, s: jax.vjp(f, v, s)[1]((d_out, d_final) if final_used else d_out))(
        tuple(arrays[k] for k in present), states)
    counts = {}

    def walk(j):
        for e in j.eqns:
            name = str(e.params.get("name", ""))
            if e.primitive.name == "pallas_call" and name.endswith("_walk"):
                counts[name] = (len(e.invars), len(e.outvars))
            for v in e.params.values():
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns") and e.primitive.name != "pallas_call":
                    walk(sub)
    walk(jaxpr.jaxpr)
    return counts


def test_no_initial_state_is_neither_read_nor_differentiated():
    """Without an initial state the forward walk starts from zeros with no state operand, and the adjoint
    walk writes no ∂L/∂S_0 (one operand and one result fewer than with a state; values and cotangents of
    both cases are checked against the reference by the tests above)."""
    given, absent = _walk_operand_counts(True), _walk_operand_counts(False)
    assert set(given) == set(absent) == {"mamba3_siso_fwd_state_walk", "mamba3_siso_bwd_adjoint_walk"}
    fwd, bwd = "mamba3_siso_fwd_state_walk", "mamba3_siso_bwd_adjoint_walk"
    assert absent[fwd] == (given[fwd][0] - 1, given[fwd][1])
    assert absent[bwd] == (given[bwd][0], given[bwd][1] - 1)


def test_unused_final_state_gives_the_adjoint_walk_no_boundary():
    """A loss that ignores the final states (their cotangents symbolic zeros, the train step's case): the
    adjoint walk starts from zeros with no boundary operand. Values: test_final_state_unused_matches_reference."""
    used, unused = _walk_operand_counts(False), _walk_operand_counts(False, final_used=False)
    bwd = "mamba3_siso_bwd_adjoint_walk"
    assert unused[bwd] == (used[bwd][0] - 1, used[bwd][1])


@pytest.mark.parametrize("shape,with_states,chunk_size", [
    ((2, 37, 4, 2, 8, 3, 2), True, 16), ((1, 40, 2, 1, 16, 8, 4), False, 16), ((2, 30, 2, 1, 8, 4, 0), False, 16)],
    ids=["per-head-angles-states", "no-states", "no-angles"])
def test_final_state_unused_matches_reference(shape, with_states, chunk_size):
    """The output's value and every cotangent when the loss uses only the output (symbolic zero
    cotangents of the final states through both cores), against the reference."""
    arrays, states = make_inputs(shape, jnp.float32, with_states=with_states, seed=35)
    present = tuple(k for k in ARRAYS if arrays[k] is not None)
    d_out, _ = cotangents(arrays)

    def grads(impl, tuning):
        def f(vals, states):
            kw = dict(zip(present, vals))
            return impl(*[kw.get(k) for k in ARRAYS], states, None, tuning=tuning)[0]
        out, vjp = jax.vjp(f, tuple(arrays[k] for k in present), states)
        return out, vjp(d_out)

    out, (d_arrays, d_states) = jax.jit(lambda: grads(mamba3_siso_scan_pallas, Mamba3ScanTuning(chunk_size=chunk_size)))()
    w_out, (w_arrays, w_states) = jax.jit(lambda: grads(mamba3_siso_scan_reference, Mamba3ScanTuning()))()
    assert_close("out", out, w_out, 2e-5)
    for name, got, want in zip(present, d_arrays, w_arrays):
        assert_close(f"d{name}", got, want, 2e-5 * (2 if name in SUMMED else 1))
    if with_states:
        for name, got, want in zip(STATES, d_states, w_states):
            assert_close(f"d initial {name}", got, want, 4e-5)


def _fresh_against_explicit_zeros(shape, dtype, chunk_size):
    """The op's output and input cotangents on a fresh sequence with an output-only loss, two ways: no
    initial state and the final states unused (no boundary operands: the walks start from zeros), and
    zero initial states given with a zero-weighted use of the final states (the zeros read from HBM)."""
    arrays, _ = make_inputs(shape, dtype, with_states=False, seed=36)
    present = tuple(k for k in ARRAYS if arrays[k] is not None)
    vals = tuple(arrays[k] for k in present)
    d_out, _ = cotangents(arrays)
    bsz, T, H, G, N, P, S = shape
    zeros = Mamba3ScanState(*(jnp.zeros(s, jnp.float32) for s in mamba3_state_shapes((bsz, T, H, 1, N, P, S))))
    tuning = Mamba3ScanTuning(chunk_size=chunk_size)

    def run(states, weight):
        def f(vals):
            kw = dict(zip(present, vals))
            out, final = mamba3_siso_scan_pallas(*[kw.get(k) for k in ARRAYS], states, None, tuning=tuning)
            return out if weight is None else (out, sum(jnp.sum(x) for x in final) * weight)
        if weight is None:
            out, vjp = jax.vjp(f, vals)
            return out, vjp(d_out)
        (out, _), vjp = jax.vjp(f, vals)
        return out, vjp((d_out, jnp.float32(1.0)))

    fresh = jax.jit(lambda v: run(None, None))(vals)
    explicit = jax.jit(lambda v: run(zeros, 0.0))(vals)
    return fresh, explicit


def _assert_bit_identical(first, second):
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("shape", [(2, 37, 4, 2, 8, 3, 2), (1, 40, 2, 1, 16, 8, 0)], ids=["per-head-angles", "no-angles"])
def test_fresh_sequence_equals_explicit_zero_states(shape):
    """No boundary operands gives bit for bit what reading zero states gives (0·decay + U = U exactly)."""
    _assert_bit_identical(*_fresh_against_explicit_zeros(shape, jnp.float32, 16))


# (Bt, T, H, G, N, P, S) where the kernel layout of d_state is a pure permutation (S a power of two >= 8,
# N a power of two): Q, K, the biases and their gradients cross the kernels in the op's order there
OP_ORDER_CASES = [("per-head-angles-groups-f32", (2, 40, 4, 2, 32, 16, 8), jnp.float32, False, 2e-5, {}),
                  ("shared-angles-fullrope-bf16", (1, 40, 2, 1, 16, 16, 8), jnp.bfloat16, True, 2e-2, {}),
                  # two programs per group: float32 partial dQ, dK in the op's order, summed by XLA
                  ("head-splits-bf16", (2, 40, 4, 1, 32, 16, 8), jnp.bfloat16, False, 2e-2, {"qk_head_splits": 2})]


@pytest.mark.parametrize("shape,dtype,shared,tol,options", [c[1:] for c in OP_ORDER_CASES], ids=[c[0] for c in OP_ORDER_CASES])
def test_op_order_matches_reference_and_the_kernel_layout_bit_for_bit(shape, dtype, shared, tol, options):
    """config.qk_op_order (strided column loads and stores of the even and odd dims) against the reference
    (every value and cotangent, the four states included) and bit for bit against the same kernels fed
    the permuted kernel layout by XLA (qk_op_order=False)."""
    bsz, T, H, G, N, P, S = shape
    geo = lambda cfg: make_geometry(batch=bsz, seqlen=T, heads=H, groups=G, headdim=P, d_state=N, num_angles=S,
                                    chunk_size=16, has_z=True, matmul_dtype=dtype, io_dtype=dtype, config=cfg,
                                    shared_angles=shared)
    assert geo(Mamba3ScanConfig(**options)).qk_op_order_fits
    assert not geo(Mamba3ScanConfig(qk_op_order=False, **options)).qk_op_order_fits
    arrays, states = make_inputs(shape, dtype, seed=40)
    if shared:
        arrays["Angles"] = arrays["Angles"][:, :, :1]
    on = check_against_reference(arrays, states, 16, tol, config=Mamba3ScanConfig(**options))
    off = check_against_reference(arrays, states, 16, tol, config=Mamba3ScanConfig(qk_op_order=False, **options))
    _assert_bit_identical(on, off)


@pytest.mark.parametrize("shape,shared", [((2, 40, 4, 2, 32, 16, 8), False), ((2, 37, 4, 2, 8, 3, 2), True)],
                         ids=["op-order-per-head-angles", "kernel-layout-shared-angles"])
def test_position_major_qk_copies_from_the_forward_match_reference_bit_for_bit(shape, shared):
    """config.qk_columns_from_forward (the forward query/key kernel writes Q, K position-major for the
    gradient kernel, no XLA transposes): every value and cotangent against the reference, and bit for
    bit against XLA's transposes (the default)."""
    arrays, states = make_inputs(shape, jnp.float32, seed=42)
    if shared:
        arrays["Angles"] = arrays["Angles"][:, :, :1]
    copies = check_against_reference(arrays, states, 16, 2e-5, config=Mamba3ScanConfig(qk_columns_from_forward=True))
    _assert_bit_identical(copies, check_against_reference(arrays, states, 16, 2e-5))


def _entry_angles_both_ways(T, L, interpret):
    """θ_entry and θ_final from XLA's prefix (chunk_entry_angles) and from entry_angle_prefix, on the same
    wrapped chunk sums, with their largest angular difference."""
    from pallas_kernels.mamba3_siso.chunk_math import angle_rate
    from pallas_kernels.mamba3_siso.entry_angles import chunk_entry_angles, entry_angle_prefix, wrapped_chunk_sums

    geo = make_geometry(batch=2, seqlen=T, heads=3, groups=1, headdim=16, d_state=32, num_angles=8, chunk_size=L,
                        has_z=True, matmul_dtype=jnp.float32, io_dtype=jnp.float32, config=Mamba3ScanConfig(),
                        interpret=interpret)
    r = np.random.default_rng(T)
    angles = jnp.asarray(2 * r.normal(size=(2, T, 3, 8)), jnp.float32)
    dt = jnp.asarray(np.abs(r.normal(size=(2, T, 3))), jnp.float32)
    angle0 = jnp.asarray(r.uniform(0, 2 * np.pi, size=(2, 3, 8)), jnp.float32)
    want = chunk_entry_angles(geo, angle_rate(angles), dt, angle0)
    got = entry_angle_prefix(geo, wrapped_chunk_sums(geo, angle_rate(angles), dt), angle0)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == jnp.float32
        assert float(jnp.min(g)) >= 0.0 and float(jnp.max(g)) < 2 * np.pi
        # angular difference (a value near 0 on one side may wrap to near 2π on the other)
        assert float(jnp.max(jnp.abs(jnp.mod(g - w + np.pi, 2 * np.pi) - np.pi))) < 1e-5 * (T // L)


@pytest.mark.parametrize("T,L", [(48, 16), (80, 16), (128, 16)], ids=["3-chunks", "5-chunks", "8-chunks"])
def test_entry_angle_prefix_kernel_matches_the_xla_prefix(T, L):
    """entry_angles.entry_angle_prefix (one program per (row, head); nc not a power of two: zero chunks
    padded by XLA, since an overhanging block is not masked on the GPU) against chunk_entry_angles'
    triangular matmul on the same chunk sums, within float32 rounding."""
    _entry_angles_both_ways(T, L, interpret=True)


def test_entry_angle_prefix_kernel_through_the_op_matches_reference():
    """config.entry_prefix_kernel (with the position-major Q, K copies) through the op: every value and
    cotangent against the reference, per-head angles (the angle gradient pass's core)."""
    arrays, states = make_inputs((2, 40, 4, 2, 32, 16, 8), jnp.float32, seed=44)
    check_against_reference(arrays, states, 16, 2e-5,
                            config=Mamba3ScanConfig(entry_prefix_kernel=True, qk_columns_from_forward=True))


@pytest.mark.parametrize("N,S,config,fits", [
    (128, 32, Mamba3ScanConfig(), True),                        # the model's d_state and rope
    (16, 8, Mamba3ScanConfig(), True),                          # no unrotated dims
    (8, 2, Mamba3ScanConfig(), False),                          # the pieces padded 2 -> 8
    (48, 8, Mamba3ScanConfig(), False),                         # the rest padded 32 -> 48 -> N = 64
    (128, 32, Mamba3ScanConfig(qk_gradients_transposed=False), False),   # the row-major gradient kernel
    (128, 32, ROTATE_IN_CHUNKS, False),                         # the chunk launches rotate back
    (128, 32, Mamba3ScanConfig(qk_op_order=False), False)])
def test_op_order_runs_only_where_it_applies(N, S, config, fits):
    geo = make_geometry(batch=1, seqlen=64, heads=2, groups=1, headdim=16, d_state=N, num_angles=S, chunk_size=64,
                        has_z=True, matmul_dtype=jnp.bfloat16, io_dtype=jnp.bfloat16, config=config, shared_angles=True)
    assert geo.qk_op_order_fits == fits


def test_op_order_leaves_no_permutation_to_xla():
    """With the op's order in the kernels, the lowered forward+backward lacks XLA's permutations of Q, K and
    the biases into the kernel layout (4 concatenates of strided slices) and of dQ, dK and the bias
    gradients out of it (their transposes: slices, pads and adds); the launches are the same."""
    shape = (2, 64, 4, 1, 32, 32, 8)
    on = _lower_for_h200(shape, jnp.bfloat16)
    off = _lower_for_h200(shape, jnp.bfloat16, config=Mamba3ScanConfig(qk_op_order=False))
    assert on.count("__gpu$xla.gpu.triton") == off.count("__gpu$xla.gpu.triton")
    count = lambda text, op: text.count(f"stablehlo.{op}")
    assert count(on, "concatenate") <= count(off, "concatenate") - 4
    for op in ("pad", "slice"):    # 4 arrays in and 4 out, each with an even and an odd piece
        assert count(on, op) <= count(off, op) - 8, op


def test_stored_products_are_kept_only_for_a_backward():
    """The chunk-output kernel writes the scores and ungated output only when asked for the backward
    (core._core_fwd asks, the plain forward does not), in the dot operand dtype and float32, one [L]
    row of scores per position."""
    from pallas_kernels.mamba3_siso import chunk_forward
    geo = make_geometry(batch=1, seqlen=32, heads=2, groups=1, headdim=16, d_state=16, num_angles=2, chunk_size=16,
                        has_z=True, matmul_dtype=jnp.bfloat16, io_dtype=jnp.bfloat16,
                        config=Mamba3ScanConfig(stored_scores=True, stored_ungated=True))
    assert chunk_forward.stores(geo, False) == ()
    assert chunk_forward.stores(geo, True) == ("scores", "ungated")
    ops = {n: jnp.zeros((1, 32, 2, 16), jnp.bfloat16) for n in ("q", "k", "v", "z")}
    ops.update(adt=jnp.zeros((1, 32, 2)), skip=jnp.zeros((1, 32, 2)))
    entering = jnp.zeros((1, 2, 2, 16, 16), jnp.bfloat16)
    out, kept = jax.eval_shape(lambda o, e: chunk_forward.chunk_outputs(geo, o, e, for_backward=True), ops, entering)
    assert kept["scores"].shape == (1, 32, 2, 16) and kept["scores"].dtype == jnp.bfloat16
    assert kept["ungated"].shape == (1, 32, 2, 16) and kept["ungated"].dtype == jnp.float32
    _, none = jax.eval_shape(lambda o, e: chunk_forward.chunk_outputs(geo, o, e), ops, entering)
    assert none == {}


def test_angle_sums_by_matmul_match_reference():
    """Mamba3ScanConfig(angle_sums="matmul") through the op: every value and cotangent (S=16: Sp wide
    enough for the triangular dots)."""
    arrays, states = make_inputs((1, 21, 2, 1, 40, 8, 16), jnp.float32, seed=11)
    check_against_reference(arrays, states, 16, 2e-5, Mamba3ScanConfig(angle_sums="matmul"))


def test_query_key_gradient_blocks_match_reference():
    """Mamba3ScanConfig(qk_grad_blocks=2) through the op (8-row programs of the query/key gradient
    kernel; T=21 leaves the last chunk padded): every value and cotangent."""
    arrays, states = make_inputs((1, 21, 2, 1, 40, 8, 10), jnp.float32, seed=12)
    check_against_reference(arrays, states, 16, 2e-5, Mamba3ScanConfig(qk_grad_blocks=2))


@pytest.mark.parametrize("shape,skip_in_scores", [
    ((1, 21, 4, 2, 40, 8, 10), True), ((2, 21, 4, 2, 40, 8, 10), False), ((1, 21, 2, 1, 24, 8, 0), True)],
    ids=["groups-odd-T", "skip-term-weight", "no-angles"])
def test_bias_gradients_by_xla_match_reference(shape, skip_in_scores):
    """Mamba3ScanConfig(bias_gradients_by_xla=True): the query/key gradient kernel without the bias column
    sums, XLA forming dQ_bias, dK_bias from dq, dk̃ and θ (qk_gradients.bias_gradients), through the op:
    every value and cotangent; skip_in_scores=False adds the skip term's c·ȳ, c·x̄ to them."""
    arrays, states = make_inputs(shape, jnp.float32, seed=13)
    check_against_reference(arrays, states, 16, 2e-5,
                            Mamba3ScanConfig(bias_gradients_by_xla=True, skip_in_scores=skip_in_scores))


@pytest.mark.parametrize("N,S,G,H,splits,shared,sums,blocks,chunk,position_major", [
    (7, 1, 3, 6, 4, True, "scan", 1, 16, True), (7, 1, 3, 6, 1, False, "scan", 1, 16, False),
    (12, 6, 1, 2, 4, True, "scan", 1, 16, True), (8, 0, 2, 4, 4, True, "scan", 1, 16, True),
    (40, 10, 1, 3, 4, False, "scan", 1, 16, False), (7, 1, 1, 6, 4, True, "scan", 1, 16, False),
    (7, 1, 1, 6, 4, False, "scan", 1, 16, True), (40, 10, 1, 3, 4, True, "matmul", 1, 16, False),
    (36, 16, 2, 4, 2, False, "matmul", 1, 16, True), (40, 10, 1, 3, 4, True, "scan", 2, 16, False),
    (7, 1, 1, 6, 4, False, "scan", 4, 32, True), (36, 16, 2, 4, 2, True, "matmul", 2, 32, True)],
    ids=["rest-padded-groups", "one-slice-per-group", "full-rope", "no-angles", "three-heads",
         "three-slices-of-two-heads", "three-slices-per-head-rates", "angle-sums-by-matmul",
         "angle-sums-by-matmul-per-head", "gradient-blocks-of-8-rows", "gradient-blocks-per-head-rates",
         "gradient-blocks-angle-sums-by-matmul"])
def test_query_key_kernels_match_their_pure_jax_reference(N, S, G, H, splits, shared, sums, blocks, chunk,
                                                          position_major):
    """The per-head q, k̃ kernel (and the θ it writes) against queries_keys.head_queries_keys at the
    angles of queries_keys.position_angles(π·tanh(angles)·DT), and the query/key gradient kernel against
    JAX's VJP of the two (every cotangent: Q, K, both biases, scale, the raw angles, shared by the heads or
    per head, DT, angles entering the chunks), whole chunks per program or blocks of their rows
    (qk_grad_blocks: the later blocks' angle-gradient totals added outside the kernel); the gradient
    kernel row-major or position-major (qk_gradients_transposed: dq, dk̃ given [Bt, H, Np, Tp], θ
    recomputed from the entering angles when a block is a whole chunk; without the angle gradient pass,
    whose kernel and core have their own tests)."""
    from pallas_kernels.mamba3_siso import qk_gradients, queries_keys

    bsz, T = 2, 2 * chunk
    geo = make_geometry(batch=bsz, seqlen=T, heads=H, groups=G, headdim=16, d_state=N, num_angles=S,
                        chunk_size=chunk, has_z=False, matmul_dtype=jnp.float32, io_dtype=jnp.float32, interpret=True,
                        config=Mamba3ScanConfig(qk_head_splits=splits, angle_sums=sums, qk_grad_blocks=blocks,
                                                qk_gradients_transposed=position_major, angle_gradient_pass=False))
    assert geo.angle_sums_by_matmul == (sums == "matmul")
    assert geo.qk_grad_rows == chunk // blocks
    assert geo.qk_splits == {2: min(splits, 2), 3: 3, 6: 3}[H // G]    # the largest divisor <= splits
    r = np.random.default_rng(9)
    Np, Sp = geo.padded_state, geo.angle_width
    lay = lambda x: queries_keys.to_kernel_layout(geo, jnp.asarray(x, jnp.float32))
    Q, K = lay(r.normal(size=(bsz, T, G, N))), lay(r.normal(size=(bsz, T, G, N)))
    Q_bias, K_bias = lay(r.normal(size=(H, N))), lay(r.normal(size=(H, N)))
    scale = jnp.asarray(r.uniform(0.01, 0.5, (bsz, T, H)), jnp.float32)
    pad = [(0, 0)] * 3 + [(0, Sp - S)]
    angles = None if S == 0 else jnp.pad(jnp.asarray(r.uniform(-3.0, 3.0, (bsz, T, 1 if shared else H, S)),
                                                     jnp.float32), pad)
    dt = None if S == 0 else jnp.asarray(r.uniform(0.01, 0.3, (bsz, T, H)), jnp.float32)
    entry = None if S == 0 else jnp.pad(jnp.asarray(r.uniform(0, 2 * np.pi, (bsz, 2, H, S)), jnp.float32), pad)
    args = (Q, K, Q_bias, K_bias, scale, angles, dt, entry)

    def increments(angles, dt):           # written here from the spec: π·tanh(raw angles)·DT
        return np.pi * jnp.tanh(angles) * dt[..., None]

    def reference(Q, K, Q_bias, K_bias, scale, angles, dt, entry):
        theta = None if angles is None else queries_keys.position_angles(geo, increments(angles, dt), entry)
        q, k = queries_keys.head_queries_keys(geo, Q, K, Q_bias, K_bias, scale, theta)
        return q, k, queries_keys.head_diagonal(geo, Q, K, Q_bias, K_bias)

    want, vjp = jax.vjp(reference, *args)
    q, k, theta, diagonal, _, _ = queries_keys.head_queries_keys_kernel(geo, *args)
    for name, g, w in zip(("q", "k", "diagonal"), (q, k, diagonal), want):
        assert_close(name, g, w, 4e-6)
    # ⟨q̄_h, k̄_h⟩ from the op's own layout (N columns, no kernel layout): the padding adds nothing
    back = lambda x: np.asarray(queries_keys.from_kernel_layout(geo, x), np.float64)
    heads = lambda x, b: np.repeat(back(x), H // G, axis=2) + back(b)
    assert_close("diagonal vs numpy", diagonal, np.sum(heads(Q, Q_bias) * heads(K, K_bias), axis=-1), 4e-6)
    if angles is None:
        assert theta is None
    else:
        assert_close("theta", theta, queries_keys.position_angles(geo, increments(angles, dt), entry), 4e-6)
    dq, dk = (jnp.asarray(r.normal(size=(bsz, T, H, Np)), jnp.float32) for _ in range(2))
    d_diagonal = jnp.asarray(r.normal(size=(bsz, T, H)), jnp.float32)
    names = ("dQ", "dK", "dQ_bias", "dK_bias", "d_scale", "d_angles", "d_dt", "d_entry")
    recompute = position_major and blocks == 1 and angles is not None
    assert recompute == (angles is not None and recomputes_theta(geo))
    kernel_dq, kernel_dk = (jnp.transpose(x, (0, 2, 3, 1)) if position_major else x for x in (dq, dk))
    for cot in ((dq, dk, None), (dq, dk, d_diagonal)):     # without and with the skip term's ⟨q̄, k̄⟩
        got = qk_gradients.query_key_gradients(geo, Q, K, Q_bias, K_bias, scale, angles, dt,
                                               None if recompute else theta, kernel_dq, kernel_dk, cot[2],
                                               theta_entry=entry if recompute else None)
        ref = vjp((cot[0], cot[1], jnp.zeros_like(d_diagonal) if cot[2] is None else cot[2]))
        for name, g, w in zip(names, got, ref):
            if w is None:
                assert g is None, name
            else:
                assert_close(name, g, w, 4e-6)


@pytest.mark.parametrize("bsz,nc,L,H,S", [(2, 3, 16, 3, 5), (1, 1, 32, 2, 8)], ids=["three-chunks-odd-S", "one-chunk"])
def test_angle_gradient_kernel_and_later_sums_match_their_references(bsz, nc, L, H, S):
    """entry_angles.angle_gradients (config.angle_gradient_pass's kernel) against its pure-JAX reference,
    and later_chunk_sums against JAX's VJP of chunk_entry_angles (the transpose it stands for), with the
    in-chunk part of d inc zero so that only the later chunks' sums reach the angles and DT."""
    from pallas_kernels.mamba3_siso import entry_angles
    from pallas_kernels.mamba3_siso.chunk_math import angle_rate

    geo = make_geometry(batch=bsz, seqlen=nc * L, heads=H, groups=1, headdim=16, d_state=2 * S, num_angles=S,
                        chunk_size=L, has_z=False, matmul_dtype=jnp.float32, io_dtype=jnp.float32, interpret=True)
    assert geo.chunk == L and geo.n_chunks == nc
    Sp = geo.angle_width
    r = np.random.default_rng(5)
    f = lambda *shape, lo=-2.0, hi=2.0: jnp.asarray(r.uniform(lo, hi, shape), jnp.float32)
    pad = lambda x: jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Sp - S)])
    angles, dt = pad(f(bsz, nc * L, H, S)), f(bsz, nc * L, H, lo=0.01, hi=0.5)
    d_inc, later = pad(f(bsz, H, nc * L, S)).swapaxes(2, 3), pad(f(bsz, nc, H, S))      # d_inc [Bt, H, Sp, Tp]
    got = entry_angles.angle_gradients(geo, d_inc, later, angles, dt)
    want = entry_angles.angle_gradients_reference(geo, d_inc, later, angles, dt)
    for name, g, w in zip(("d angles", "d DT"), got, want):
        assert_close(name, g, w, 2e-6)
    # later_chunk_sums is the transpose of chunk_entry_angles: with d inc = 0, the pass gives exactly
    # JAX's VJP of chunk_entry_angles ∘ π·tanh at the same cotangents
    angle0 = pad(f(bsz, H, S, lo=0.0, hi=6.0))
    d_entry, d_final = pad(f(bsz, nc, H, S)), pad(f(bsz, H, S))
    _, vjp = jax.vjp(lambda a, t, a0: entry_angles.chunk_entry_angles(geo, angle_rate(a), t, a0), angles, dt, angle0)
    want_angles, want_dt, want_angle0 = vjp((d_entry, d_final))
    later, d_angle0 = entry_angles.later_chunk_sums(d_entry, d_final)
    got_angles, got_dt = entry_angles.angle_gradients(geo, jnp.zeros_like(d_inc), later, angles, dt)
    for name, g, w in (("d angles", got_angles, want_angles), ("d DT", got_dt, want_dt),
                       ("d angle0", d_angle0, want_angle0)):
        assert_close(name, g, w, 2e-6)


@pytest.mark.parametrize("shape", [(1, 20, 2, 1, 8, 16, 2), (1, 20, 2, 1, 16, 16, 8)], ids=["kernel-layout", "op-order"])
def test_vmap_jit_and_checkpoint_gradients_match_reference(shape):
    """vmap prepends a grid axis to every pallas_call (the 1-D grids keep that within Triton's three);
    jax.checkpoint re-runs the forward kernels inside the backward. Also with Q, K in the op's d_state
    order (strided column loads and stores, config.qk_op_order)."""
    arrays, states = make_inputs(shape, jnp.float32, seed=3)
    signs = jnp.array([1.0, -0.5])

    def loss(impl, v, h0, adt):
        def one(sign):
            out, final = impl(arrays["Q"], arrays["K"], v * sign, adt, arrays["DT"], arrays["Trap"], arrays["Q_bias"],
                              arrays["K_bias"], arrays["Angles"], arrays["D"], arrays["z"],
                              states._replace(ssm=h0 * sign), None, tuning=Mamba3ScanTuning(chunk_size=16))
            return jnp.sum(out * jnp.sin(out)) + jnp.sum(final[1] ** 2) + jnp.sum(jnp.cos(final[0]))
        return jnp.sum(jax.vmap(one)(signs))

    pallas_loss = jax.checkpoint(functools.partial(loss, mamba3_siso_scan_pallas))
    got_val, got = jax.jit(jax.value_and_grad(pallas_loss, argnums=(0, 1, 2)))(arrays["V"], states.ssm, arrays["ADT"])
    reference_loss = functools.partial(loss, mamba3_siso_scan_reference)
    want_val, want = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1, 2)))(arrays["V"], states.ssm, arrays["ADT"])
    assert_close("value", got_val, want_val, 2e-5)
    for name, a, b in zip(("V", "initial ssm", "ADT"), got, want):
        assert_close(f"d{name}", a, b, 4e-5)


def test_explicit_pallas_through_the_op_with_shared_angles():
    """The op broadcasts [Bt, T, S] angles over heads; their cotangent is summed back over heads."""
    arrays, states = make_inputs((1, 9, 2, 1, 8, 16, 2), jnp.float32, seed=4)
    shared = arrays["Angles"][:, :, 0]
    kw = dict(arrays, Angles=shared)

    def loss(impl, kw):
        out, final = mamba3_siso_scan(**kw, initial_state=states, return_final_state=True,
                                      tuning=Mamba3ScanTuning(chunk_size=16), implementation=impl)
        return jnp.sum(out * out) + jnp.sum(final.k)

    got = jax.jit(jax.value_and_grad(functools.partial(loss, "pallas")))(kw)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, "reference")))(kw)
    assert_close("value", got[0], want[0], 2e-5)
    for k in ARRAYS:
        assert_close(f"d{k}", got[1][k], want[1][k], 4e-5)


# ------------------------------------------------------------------------------- abstract H200 lowering
@functools.lru_cache(maxsize=None)
def _input_specs(shape, dtype, with_z):
    """(present names, their ShapeDtypeStructs, the states'): what the lowering needs of make_inputs.
    Drawing the arrays at the benchmark shape takes seconds, so each shape is drawn once per process."""
    arrays, states = make_inputs(shape, dtype, with_z=with_z)
    present = tuple(k for k in ARRAYS if arrays[k] is not None)
    return (present, tuple(jax.ShapeDtypeStruct(arrays[k].shape, arrays[k].dtype) for k in present),
            tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in states))


def _lower_for_h200(shape, dtype, *, with_z=True, config=None, fresh=False):
    """Traces forward+backward and lowers it for an abstract H200: runs the Pallas->Triton lowering
    (the glue is told it is not on the CPU, so the kernels are lowered, not interpreted). fresh: no
    initial state and a loss of the output alone (the walks start from zeros, no state operands)."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    present, specs, state_specs = _input_specs(shape, dtype, with_z)
    if fresh:
        state_specs = None

    def loss(vals, states):
        kw = dict(zip(present, vals))
        out, final = mamba3_siso_scan_pallas(*[kw.get(k) for k in ARRAYS], states, None,
                                             tuning=Mamba3ScanTuning(chunk_size=64, pallas_config=config))
        return jnp.sum(out.astype(jnp.float32)) + (0.0 if fresh else sum(jnp.sum(x) for x in final))

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh), \
            mock.patch.object(pallas_glue, "interpret_mode", return_value=False):
        warnings.simplefilter("ignore", DeprecationWarning)   # "Pallas Triton backend is deprecated"
        argnums = (0,) if fresh else (0, 1)
        lowered = jax.jit(jax.grad(loss, argnums=argnums)).trace(list(specs), state_specs).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


@pytest.mark.parametrize("shape,dtype,with_z,config,launches", [
    ((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, True, None, 8),              # the benchmark shape
    # the queries' and keys' gradients rotated back in their chunk launches (head_gradients.py)
    ((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, True, ROTATE_IN_CHUNKS, 7),
    ((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, True,
     dataclasses.replace(ROTATE_IN_CHUNKS, head_gradient_launches=1), 6),
    ((2, 70, 6, 3, 7, 20, 1), jnp.float32, False, None, 8),      # padding everywhere, groups, no Z
    ((1, 64, 2, 1, 16, 64, 8), jnp.float16, True, None, 8),      # rope_fraction 1.0, f16 dots, 8-wide pieces
    ((2, 64, 4, 1, 16, 32, 8), jnp.bfloat16, True, Mamba3ScanConfig(keys_with_queries=False), 9),
    ((2, 64, 4, 2, 64, 20, 16), jnp.float32, True,
     dataclasses.replace(ROTATE_IN_CHUNKS, angle_sums="matmul", num_warps_head_grad=8), 7),
], ids=["perf-shape-bf16", "perf-shape-bf16-head-launches", "perf-shape-bf16-one-head-launch", "odd-shape-f32", "fullrope-f16",
        "keys-apart-bf16", "f32-head-grad-matmul"])
def test_kernels_lower_to_triton_for_h200(shape, dtype, with_z, config, launches):
    text = _lower_for_h200(shape, dtype, with_z=with_z, config=config)
    # forward: queries/keys, the state walk, chunk outputs; backward: the adjoint walk, then the values
    # launch and the queries' and keys' head gradient launches (7; one launch for both: 6), or the
    # keys+queries and values launches and the query/key gradient kernel (7; keys_with_queries=False:
    # keys and queries apart, 8); state_passes="split" adds two; per-head angles (these shapes') add
    # the angle gradient pass (entry_angles.angle_gradients) unless the chunk launches rotate back
    assert text.count("__gpu$xla.gpu.triton") == launches


@pytest.mark.parametrize("config,launches", [
    (Mamba3ScanConfig(qk_gradients_transposed=True, angle_gradient_pass=True), 8),
    (Mamba3ScanConfig(qk_gradients_transposed=True, stored_theta=True, position_major_d_angles=True,
                      angle_gradient_pass=False), 7)],
    ids=["angle-gradient-pass", "theta-and-d-angles-position-major"])
def test_position_major_angle_options_lower_for_h200(config, launches):
    """Per-head angles on the position-major query/key gradient kernel: with angle_gradient_pass one more
    launch (entry_angles.angle_gradients); θ and the angle gradient position-major change no count."""
    shape = (2, 64, 4, 1, 16, 32, 8)
    geo = make_geometry(batch=2, seqlen=64, heads=4, groups=1, headdim=32, d_state=16, num_angles=8, chunk_size=64,
                        has_z=True, matmul_dtype=jnp.bfloat16, io_dtype=jnp.bfloat16, config=config)
    assert geo.angle_pass == config.angle_gradient_pass and geo.theta_position_major
    text = _lower_for_h200(shape, jnp.bfloat16, config=config)
    assert text.count("__gpu$xla.gpu.triton") == launches


@pytest.mark.parametrize("config,launches", [(None, 8), (Mamba3ScanConfig(state_passes="split"), 10)],
                         ids=["walks", "split-passes"])
def test_fresh_sequence_lowers_for_h200(config, launches):
    """No initial state and the final state unused: the walks (or the combines) start from zeros with no
    boundary operand and the adjoint writes no ∂L/∂S_0; they still lower, with the same launches."""
    text = _lower_for_h200((2, 128, 4, 1, 32, 64, 8), jnp.bfloat16, config=config, fresh=True)
    assert text.count("__gpu$xla.gpu.triton") == launches


def test_angle_sums_by_matmul_lower_for_h200():
    """Mamba3ScanConfig(angle_sums="matmul"): the triangular dots in both query/key kernels lower."""
    config = Mamba3ScanConfig(angle_sums="matmul", rotate_in_chunk_gradients=False)
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    assert text.count("__gpu$xla.gpu.triton") == 8   # keys+queries in one launch, the angle pass (defaults)


def test_query_key_gradient_blocks_lower_for_h200():
    """qk_grad_blocks=4 (16-row programs) and 16 warps for the query/key gradient kernel, reading float32
    dq, dk̃ (qk_gradient_dtype="float32"; the default bf16 ones lower in the tests above)."""
    config = Mamba3ScanConfig(qk_grad_blocks=4, num_warps_qk_grad=16, qk_gradient_dtype="float32",
                              rotate_in_chunk_gradients=False)
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    # keys+queries in one launch (the default); no angle pass: 16-row programs keep the row-major kernel
    assert text.count("__gpu$xla.gpu.triton") == 7


def test_keys_with_queries_lowers_for_h200():
    """keys_with_queries (with state_dot_with_keys: a one-element block per program) and the values launch
    at its own warps (num_warps_values), the keys+queries launch at num_warps_grad."""
    import re
    config = Mamba3ScanConfig(keys_with_queries=True, rotate_in_chunk_gradients=False, num_warps_values=8)
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    warps = {name: re.findall(r"num_warps = (\d+)", line)
             for line in text.splitlines() if "__gpu$xla.gpu.triton" in line
             for name in ("gradients_values", "gradients_keys_queries") if name + "\\00" in line}
    assert warps == {"gradients_values": ["8"], "gradients_keys_queries": ["4"]}, warps
    assert text.count("__gpu$xla.gpu.triton") == 8


def test_skip_term_as_a_per_position_weight_lowers_for_h200():
    config = Mamba3ScanConfig(skip_in_scores=False)
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    assert text.count("__gpu$xla.gpu.triton") == 8   # keys+queries in one launch, the angle pass (defaults)


def test_split_state_passes_lower_for_h200():
    """state_passes="split": each pass is a contribution launch and a combine (the default walk is one)."""
    config = Mamba3ScanConfig(state_passes="split")
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    assert text.count("__gpu$xla.gpu.triton") == 10


def test_adt_in_the_keys_launch_lowers_for_h200():
    """adt_in_values=False (the default, dADT with the values, is lowered by the tests above)."""
    config = Mamba3ScanConfig(adt_in_values=False)
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    assert text.count("__gpu$xla.gpu.triton") == 8   # keys+queries in one launch, the angle pass (defaults)


def test_stored_for_keys_lowers_for_h200():
    """(The default, scores and ungated Y stored for the values launch, is lowered by the tests above.)"""
    config = Mamba3ScanConfig(stored_for_keys=True, rotate_in_chunk_gradients=False)
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    assert text.count("__gpu$xla.gpu.triton") == 8   # keys+queries in one launch, the angle pass (defaults)


@pytest.mark.parametrize("config,kernels_rotating", [
    (Mamba3ScanConfig(fast_rotation=True, fast_rotation_backward=True), 2),     # q/k forward, q/k gradients
    (dataclasses.replace(ROTATE_IN_CHUNKS, fast_rotation_backward=True), 3),   # q/k forward, two head launches
    (Mamba3ScanConfig(fast_rotation=True, fast_rotation_backward=False), 1),    # q/k forward only
    (dataclasses.replace(ROTATE_IN_CHUNKS, fast_rotation=False, fast_rotation_backward=True), 2),   # head launches
    (Mamba3ScanConfig(), 1),                                                    # the default: q/k forward only
    (Mamba3ScanConfig(fast_rotation=False), 0)],
    ids=["fast", "fast-rotation-in-chunk-gradients", "forward-only", "backward-only", "default", "libdevice"])
def test_fast_rotation_lowers_to_the_hardware_instructions(config, kernels_rotating):
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    assert text.count("cos.approx.ftz.f32") == text.count("sin.approx.ftz.f32") == kernels_rotating


@pytest.mark.parametrize("kernels", [1, 2])
def test_one_or_two_gradient_launches_lower_for_h200(kernels):
    config = Mamba3ScanConfig(gradient_kernels=kernels, stored_state_dtype="float32", num_warps_grad=8, **NOT_STORED)
    text = _lower_for_h200((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, config=config)
    assert text.count("__gpu$xla.gpu.triton") == 6 + kernels   # with the angle gradient pass


def test_abstract_lowering_rejects_what_triton_cannot_lower():
    """Control for the test above: a block of 3 (not a power of two) fails the Triton lowering."""
    from jax.experimental import pallas as pl
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    f = lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with pytest.raises(ValueError, match="power of 2"), jax.sharding.use_abstract_mesh(mesh):
        jax.jit(f).trace(jax.ShapeDtypeStruct((3,), jnp.float32)).lower(lowering_platforms=("cuda",))


# ------------------------------------------------------------------------------------------ dispatch
def _call(**change):
    f32 = jnp.float32
    base = dict(Q=jnp.ones((1, 8, 1, 128), f32), V=jnp.ones((1, 8, 2, 64), f32), Angles=jnp.ones((1, 8, 2, 32), f32),
                initial_state=None, reset=None, tuning=Mamba3ScanTuning(chunk_size=64))
    base.update(change)
    return base


@pytest.mark.parametrize("platform,change,reason", [
    ("tpu", {}, "platform 'tpu'"),
    ("gpu", {"reset": jnp.zeros((1, 8), bool)}, "reset"),
    ("gpu", {"Q": jnp.ones((1, 8, 1, 512), jnp.float32)}, "d_state N=512"),
    ("gpu", {"V": jnp.ones((1, 8, 2, 256), jnp.float32)}, "headdim P=256"),
    ("gpu", {"V": jnp.ones((1, 0, 2, 64), jnp.float32)}, "empty"),
    ("gpu", {"Angles": "float64"}, "float64"),
])
def test_supported_explains_what_it_cannot_handle(platform, change, reason):
    with jax.enable_x64(True):   # so that a float64 array can exist
        if change.get("Angles") == "float64":
            change = {"Angles": jnp.ones((1, 8, 2, 32), jnp.float64)}
        if platform == "gpu":   # the same call without the change is supported
            assert pallas_glue.supported(platform=platform, **_call()) is None
        msg = pallas_glue.supported(platform=platform, **_call(**change))
        assert msg is not None and reason in msg
        with pytest.raises(NotImplementedError, match=reason):
            dispatch.choose("mamba3_siso_scan", "pallas", platform=platform, **_call(**change))


def test_automatic_choice_prefers_pallas_on_gpu_and_falls_back_with_one_warning():
    assert dispatch.choose("mamba3_siso_scan", None, platform="gpu", **_call()).fn.__name__ == "mamba3_siso_scan_pallas"
    assert dispatch.choose("mamba3_siso_scan", None, platform="cpu", **_call()).fn.__name__ == "mamba3_siso_scan_xla"
    resets = _call(reset=jnp.zeros((1, 8), bool))
    dispatch._WARNED.clear()
    with pytest.warns(UserWarning, match="instead of 'pallas'.*reset"):
        impl = dispatch.choose("mamba3_siso_scan", None, platform="gpu", **resets)
    assert impl.fn.__name__ == "mamba3_siso_scan_xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same reason warns only once
        dispatch.choose("mamba3_siso_scan", None, platform="gpu", **resets)


def test_kernel_refuses_a_reset_mask_and_a_bad_config():
    arrays, _ = make_inputs((1, 4, 2, 1, 8, 16, 2), jnp.float32)
    args = [arrays[k] for k in ARRAYS]
    with pytest.raises(NotImplementedError, match="reset"):
        mamba3_siso_scan_pallas(*args, None, jnp.zeros((1, 4), bool), tuning=Mamba3ScanTuning(chunk_size=16))
    with pytest.raises(TypeError, match="config"):
        mamba3_siso_scan_pallas(*args, None, None,
                                tuning=Mamba3ScanTuning(chunk_size=16, pallas_config={"state_block_p": 16}))


@pytest.mark.parametrize("field,value", [("state_block_p", 12), ("num_warps_grad", 0), ("min_width", 24),
                                         ("gradient_kernels", 4), ("num_warps_qk", 3),
                                         ("qk_head_splits", 0), ("gradient_kernels", 2.0), ("min_width", 8),
                                         ("min_chunk", 8), ("num_warps_grad", 64),
                                         ("num_stages", 0), ("max_chunk", 96), ("stored_state_dtype", "float16"),
                                         ("stored_scores", 1), ("stored_ungated", "yes"),
                                         ("stored_for_keys", 1), ("num_warps_qk_grad", 64), ("qk_grad_blocks", 3),
                                         ("qk_gradient_dtype", "bfloat16"), ("adt_in_values", 1),
                                         ("keys_with_queries", 1), ("rotate_in_chunk_gradients", 1),
                                         ("num_warps_head_grad", 3), ("head_gradient_launches", 3),
                                         ("skip_in_scores", "no"), ("fast_rotation", 1),
                                         ("fast_rotation_backward", 0), ("fast_rotation_backward", "False"),
                                         ("fast_math", 1),
                                         ("state_passes", "fused"), ("walk_block_p", 8), ("walk_block_p", 24),
                                         ("num_warps_walk", 64), ("num_warps_values", 3), ("num_warps_values", 64),
                                         ("num_warps_adjoint_walk", 6), ("num_warps_adjoint_walk", 64),
                                         ("state_dot_with_keys", 1)])
def test_bad_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        Mamba3ScanConfig(**{field: value}).validate()


def test_adjoint_walk_warps_apart_from_the_forward_walk():
    """num_warps_adjoint_walk sets the adjoint walk's warps only; None leaves both walks at num_warps_walk."""
    from pallas_kernels.mamba3_siso.state_passes import walk_warps
    apart = Mamba3ScanConfig(num_warps_walk=4, num_warps_adjoint_walk=8)
    assert (walk_warps(apart, adjoint=False), walk_warps(apart, adjoint=True)) == (4, 8)
    same = Mamba3ScanConfig(num_warps_walk=2)
    assert (walk_warps(same, adjoint=False), walk_warps(same, adjoint=True)) == (2, 2)


@pytest.mark.parametrize("field", ["stored_scores", "stored_ungated"])
def test_stored_products_need_the_values_launch_apart(field):
    with pytest.raises(ValueError, match=f"{field}=True needs gradient_kernels=3"):
        Mamba3ScanConfig(**dict(NOT_STORED, **{field: True}), gradient_kernels=2).validate()


def test_stored_for_keys_needs_stored_scores_and_nothing_stored_takes_any_launch_count():
    with pytest.raises(ValueError, match="stored_for_keys=True needs stored_scores=True"):
        Mamba3ScanConfig(stored_scores=False, stored_for_keys=True).validate()
    Mamba3ScanConfig(gradient_kernels=1, **NOT_STORED).validate()


def test_chunk_size_is_rounded_to_a_power_of_two_the_dots_accept():
    cfg = Mamba3ScanConfig()
    assert [chunk_length(c, 2048, cfg) for c in (1, 5, 16, 48, 64, 100, 1000)] == [16, 16, 16, 32, 64, 64, 128]
    assert chunk_length(64, 20, cfg) == 32        # no longer than the sequence needs
    geo = make_geometry(batch=1, seqlen=50, heads=6, groups=3, headdim=20, d_state=7, num_angles=1, chunk_size=5,
                        has_z=False, matmul_dtype=jnp.float32, io_dtype=jnp.float32)
    assert (geo.chunk, geo.padded_seqlen, geo.padded_headdim) == (16, 64, 32)
    # d_state 7 with one rotated pair: even | odd pieces of 8 columns, then 5 unrotated dims and zeros
    assert geo.pieces == (("even", 0, 8), ("odd", 8, 8), ("rest16", 16, 16)) and geo.padded_state == 32
    # rest columns not a power of two: cut into pieces covering every column
    geo = make_geometry(batch=1, seqlen=64, heads=2, groups=1, headdim=64, d_state=136, num_angles=20, chunk_size=64,
                        has_z=False, matmul_dtype=jnp.float32, io_dtype=jnp.float32)
    assert geo.padded_state == 256 and geo.pieces == (("even", 0, 32), ("odd", 32, 32), ("rest64", 64, 128),
                                                      ("rest192", 192, 64))


# ------------------------------------------------------------------------------------------------ GPU
GPU_CASES = [
    ("perf-shape-bf16", (8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, dict(), 64, 2.5e-2),
    ("bf16-groups-odd-T", (3, 1000, 8, 2, 128, 64, 32), jnp.bfloat16, dict(), 64, 2.5e-2),
    ("f32-odd-everything", (2, 333, 6, 3, 40, 20, 10), jnp.float32, dict(), 64, 1e-4),
    ("f16-bare-chunk128", (2, 300, 4, 1, 64, 32, 16), jnp.float16,
     dict(with_z=False, with_D=False, with_states=False), 128, 1e-2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,options,chunk_size,tol", [c[1:] for c in GPU_CASES],
                         ids=[c[0] for c in GPU_CASES])
def test_gpu_values_and_cotangents_match_reference(shape, dtype, options, chunk_size, tol):
    arrays, states = make_inputs(shape, dtype, **options)
    check_against_reference(arrays, states, chunk_size, tol)


@pytest.mark.gpu
def test_gpu_angles_shared_by_the_heads_match_reference():
    """The model's case: one row of angle rates per position for all heads (Angles [Bt, T, 1, S] after
    the op's normalization), whose gradient the query/key kernel sums over each slice's heads."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=5)
    check_against_reference(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("with_z,kernels", [(True, 2), (False, 2), (True, 1)])
def test_gpu_other_kernel_variants_match_reference(with_z, kernels):
    """The non-default launch variants a sweep may pick: one or three gradient launches, float32 stored
    states, other warp counts."""
    config = Mamba3ScanConfig(gradient_kernels=kernels, stored_state_dtype="float32", num_warps_grad=8,
                              num_warps_chunk=8, num_warps_qk=4, **NOT_STORED)
    arrays, states = make_inputs((3, 1000, 8, 2, 128, 64, 32), jnp.bfloat16, with_z=with_z, seed=8)
    check_against_reference(arrays, states, 64, 2.5e-2, config)


@pytest.mark.gpu
@pytest.mark.parametrize("scores,ungated,keys", [(True, True, False), (True, False, False), (True, True, True)])
def test_gpu_stored_scores_and_ungated_output_match_reference(scores, ungated, keys):
    """The default (scores and ungated Y stored) and the other stored-products variants at the benchmark
    shape, shared angles as in the model."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=14)
    check_against_reference(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2,
                            Mamba3ScanConfig(stored_scores=scores, stored_ungated=ungated, stored_for_keys=keys))


@pytest.mark.gpu
@pytest.mark.parametrize("shared,config", [
    (True, Mamba3ScanConfig(fast_rotation=True, fast_rotation_backward=True)),
    (False, Mamba3ScanConfig(fast_rotation=True, fast_rotation_backward=True)),
    (True, dataclasses.replace(ROTATE_IN_CHUNKS, fast_rotation=True, fast_rotation_backward=True)),
    (True, Mamba3ScanConfig(fast_rotation=True, fast_rotation_backward=False)),
    (False, Mamba3ScanConfig(fast_rotation=True, fast_rotation_backward=False))],
    ids=["shared-angles", "per-head-angles", "rotation-in-chunk-gradients", "forward-only-shared",
         "forward-only-per-head"])
def test_gpu_fast_rotation_matches_reference(shared, config):
    """config.fast_rotation (hardware cos.approx / sin.approx) at the benchmark shape."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=25)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    check_against_reference(arrays, states, 64, 2.5e-2, config)


def check_no_less_accurate(arrays, states, chunk_size, tol, config, slack=1.25):
    """Every value and cotangent of `config` against the reference, each within `tol` (twice that for the
    summed gradients, as check_against_reference) or, where the default config itself misses that bound
    at this shape (bf16 rounding of the angle gradient at the benchmark shape), within `slack` times the
    default's own error: a change of the float32 rounding inside the kernels may not lose accuracy."""
    present, got, want = run_both(arrays, states, chunk_size, config)
    _, default, _ = run_both(arrays, states, chunk_size, None)
    names = [("out", False)] + [(f"final {n}", False) for n in STATES] + [(f"d{n}", n in SUMMED) for n in present]
    if states is not None:
        names += [(f"d initial {n}", n in SUMMED) for n in STATES]
    flat = lambda result: [result[0], *result[1], *result[2]] + (list(result[3]) if states is not None else [])
    assert len(flat(got)) == len(names)
    for (name, summed), g, d, w in zip(names, flat(got), flat(default), flat(want)):
        bound = tol * (2 if summed else 1)
        limit = max(bound, slack * rel_err(d, w))
        err = rel_err(g, w)
        assert err <= limit, f"{name}: relative error {err:.3e} > {limit:.1e} (default config: {rel_err(d, w):.3e})"


@pytest.mark.gpu
def test_gpu_fast_math_matches_reference():
    """config.fast_math (hardware ex2 / rcp for σ(Z) and the decays) at the benchmark shape, shared angles.
    On an H100 (2026-12-07) its dAngles missed the 5e-2 bound (5.36e-2): checked here against the
    default config's own error at the same inputs."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=28)
    check_no_less_accurate(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2,
                           Mamba3ScanConfig(fast_math=True))


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False], ids=["shared-angles", "per-head-angles"])
def test_gpu_position_major_query_key_gradients_match_reference(shared):
    """config.qk_gradients_transposed at the benchmark shape, angles shared by the heads (the model's
    case) and per head (without the angle gradient pass, which has its own test below)."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=30)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    check_no_less_accurate(arrays, states, 64, 2.5e-2,
                           Mamba3ScanConfig(qk_gradients_transposed=True, angle_gradient_pass=False))


@pytest.mark.gpu
def test_gpu_position_major_theta_and_d_angles_match_reference():
    """config.stored_theta and position_major_d_angles (θ stored position-major by the forward, the angle
    gradient written position-major) at the benchmark shape with per-head angles (the op benchmark's)."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=32)
    check_no_less_accurate(arrays, states, 64, 2.5e-2, Mamba3ScanConfig(
        qk_gradients_transposed=True, stored_theta=True, position_major_d_angles=True, angle_gradient_pass=False))


@pytest.mark.gpu
def test_gpu_angle_gradient_pass_matches_reference():
    """config.angle_gradient_pass (the chunk-entry angles inside the core, the angle gradients finished
    by their own kernel) at the benchmark shape with per-head angles (the op benchmark's)."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=33)
    config = Mamba3ScanConfig(qk_gradients_transposed=True, angle_gradient_pass=True)
    assert make_geometry(batch=8, seqlen=2048, heads=24, groups=1, headdim=64, d_state=128, num_angles=32,
                         chunk_size=64, has_z=True, matmul_dtype=jnp.bfloat16, io_dtype=jnp.bfloat16,
                         config=config).angle_pass
    check_no_less_accurate(arrays, states, 64, 2.5e-2, config)


@pytest.mark.gpu
def test_gpu_transposed_gradient_dots_match_reference():
    """config.transposed_gradient_dots (dq, dk̃ position-major straight from swapped dots) at the benchmark
    shape, shared angles (where the position-major query/key gradients run by default)."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=31)
    check_no_less_accurate(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2,
                           Mamba3ScanConfig(transposed_gradient_dots=True))


@pytest.mark.gpu
def test_gpu_angle_sums_by_matmul_match_reference():
    """The triangular-dot angle sums (a sweep candidate, off by default) at the benchmark shape."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=12)
    check_against_reference(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2,
                            Mamba3ScanConfig(angle_sums="matmul"))


@pytest.mark.gpu
@pytest.mark.parametrize("blocks,warps,shared", [(2, 8, True), (4, 16, False)])
def test_gpu_query_key_gradient_blocks_match_reference(blocks, warps, shared):
    """The query/key gradient kernel on blocks of a chunk's rows (sweep candidates) at the benchmark
    shape, angles shared by the heads (the model's case) or per head."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=15)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    check_against_reference(arrays, states, 64, 2.5e-2,
                            Mamba3ScanConfig(qk_grad_blocks=blocks, num_warps_qk_grad=warps,
                                             rotate_in_chunk_gradients=False))


@pytest.mark.gpu
def test_gpu_float32_query_key_gradients_match_reference():
    """qk_gradient_dtype="float32" (the default keeps dq, dk̃ in bf16 for bf16 dots) at the benchmark
    shape, shared angles as in the model."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=16)
    check_against_reference(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2,
                            Mamba3ScanConfig(qk_gradient_dtype="float32"))


@pytest.mark.gpu
def test_gpu_adt_in_the_keys_launch_matches_reference():
    """adt_in_values=False (dADT in the keys launch, the previous default) at the benchmark shape, shared
    angles as in the model."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=18)
    check_against_reference(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2,
                            Mamba3ScanConfig(adt_in_values=False))


@pytest.mark.gpu
def test_gpu_keys_and_queries_in_one_launch_match_reference():
    """keys_with_queries (a sweep candidate) at the benchmark shape, shared angles as in the model."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=20)
    check_against_reference(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2,
                            Mamba3ScanConfig(keys_with_queries=True, rotate_in_chunk_gradients=False))


@pytest.mark.gpu
def test_gpu_bias_gradients_by_xla_match_reference():
    """bias_gradients_by_xla (a sweep candidate) at the benchmark shape, shared angles as in the model."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=21)
    check_against_reference(dict(arrays, Angles=arrays["Angles"][:, :, :1]), states, 64, 2.5e-2,
                            Mamba3ScanConfig(bias_gradients_by_xla=True))


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False])
def test_gpu_separate_query_key_gradient_kernel_matches_reference(shared):
    """rotate_in_chunk_gradients=False (keys and queries launches, then the query/key gradient kernel:
    the previous default) at the benchmark shape."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=22)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    check_against_reference(arrays, states, 64, 2.5e-2, Mamba3ScanConfig(rotate_in_chunk_gradients=False))


@pytest.mark.gpu
@pytest.mark.parametrize("launches,warps,shared", [(2, 4, True), (2, 4, False), (1, 8, True)])
def test_gpu_rotation_in_the_chunk_gradient_launches_matches_reference(launches, warps, shared):
    """rotate_in_chunk_gradients (off by default: slower on the H200, session 22) in two launches or one,
    at the benchmark shape."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=23)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    check_against_reference(arrays, states, 64, 2.5e-2, dataclasses.replace(
        ROTATE_IN_CHUNKS, head_gradient_launches=launches, num_warps_head_grad=warps))


@pytest.mark.gpu
def test_gpu_split_state_passes_match_reference():
    """state_passes="split" (the contribution launches and combines) at the benchmark shape."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=29)
    check_against_reference(arrays, states, 64, 2.5e-2, Mamba3ScanConfig(state_passes="split"))


@pytest.mark.gpu
@pytest.mark.parametrize("shared", [True, False])
def test_gpu_skip_term_as_a_per_position_weight_matches_reference(shared):
    """skip_in_scores=False (the float32 per-position weight; the default is the scores' diagonal) at the
    benchmark shape."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=25)
    if shared:
        arrays = dict(arrays, Angles=arrays["Angles"][:, :, :1])
    check_against_reference(arrays, states, 64, 2.5e-2, Mamba3ScanConfig(skip_in_scores=False))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,block_p", [((8, 2048, 24, 1, 128, 64, 32), 32), ((32, 512, 24, 1, 128, 64, 32), 64),
                                           ((2, 200, 4, 2, 32, 48, 8), 16)])
def test_gpu_walking_state_passes_match_reference(shape, block_p):
    """state_passes="walk" (the default, 64 rows) at the two op shapes of the benchmark and a small odd
    one, at several row blocks."""
    arrays, states = make_inputs(shape, jnp.bfloat16, seed=27)
    check_against_reference(arrays, states, 64, 2.5e-2, Mamba3ScanConfig(state_passes="walk", walk_block_p=block_p))


@pytest.mark.gpu
def test_gpu_two_runs_are_bit_identical_at_the_perf_shape():
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16)
    present = tuple(k for k in ARRAYS if arrays[k] is not None)
    vals = tuple(arrays[k] for k in present)
    d_out, d_final = cotangents(arrays)
    tuning = Mamba3ScanTuning(chunk_size=64)
    first = _value_and_vjp(mamba3_siso_scan_pallas, present, tuning, vals, states, d_out, d_final)
    second = _value_and_vjp(mamba3_siso_scan_pallas, present, tuning, vals, states, d_out, d_final)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_gpu_fresh_sequence_equals_explicit_zero_states_at_the_perf_shape():
    """The walks without boundary operands (no initial state, the final state unused: the op benchmark's
    and the train step's case) against zero states read from HBM, bit for bit, per-head angles."""
    _assert_bit_identical(*_fresh_against_explicit_zeros((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, 64))


@pytest.mark.gpu
def test_gpu_op_order_equals_the_kernel_layout_at_the_perf_shape():
    """Q, K in the op's d_state order (strided column loads / stores, the default there) against the
    same kernels fed the permuted kernel layout, bit for bit (forward and every cotangent), shared angles."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=41)
    arrays["Angles"] = arrays["Angles"][:, :, :1]
    present = tuple(k for k in ARRAYS if arrays[k] is not None)
    vals = tuple(arrays[k] for k in present)
    d_out, d_final = cotangents(arrays)
    run = lambda cfg: _value_and_vjp(mamba3_siso_scan_pallas, present, Mamba3ScanTuning(chunk_size=64, pallas_config=cfg),
                                     vals, states, d_out, d_final)
    _assert_bit_identical(run(None), run(Mamba3ScanConfig(qk_op_order=False)))


@pytest.mark.gpu
def test_gpu_position_major_qk_copies_from_the_forward_at_the_perf_shape():
    """config.qk_columns_from_forward against XLA's transposes of Q, K, bit for bit, per-head angles."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16, seed=43)
    present = tuple(k for k in ARRAYS if arrays[k] is not None)
    vals = tuple(arrays[k] for k in present)
    d_out, d_final = cotangents(arrays)
    run = lambda cfg: _value_and_vjp(mamba3_siso_scan_pallas, present, Mamba3ScanTuning(chunk_size=64, pallas_config=cfg),
                                     vals, states, d_out, d_final)
    _assert_bit_identical(run(Mamba3ScanConfig(qk_columns_from_forward=True)), run(None))


@pytest.mark.gpu
@pytest.mark.parametrize("T,L", [(192, 64), (2048, 64)], ids=["3-chunks", "32-chunks"])
def test_gpu_entry_angle_prefix_kernel_matches_the_xla_prefix(T, L):
    _entry_angles_both_ways(T, L, interpret=False)


@pytest.mark.gpu
def test_gpu_new_launch_options_match_reference_at_the_perf_shape():
    """entry_prefix_kernel and qk_columns_from_forward together at the benchmark shape, per-head angles:
    every value and cotangent against the reference (the tolerances of the default's GPU test)."""
    arrays, states = make_inputs((8, 2048, 24, 1, 128, 64, 32), jnp.bfloat16)
    check_against_reference(arrays, states, 64, 2.5e-2,
                            config=Mamba3ScanConfig(entry_prefix_kernel=True, qk_columns_from_forward=True))


@pytest.mark.gpu
def test_gpu_vmap_jit_and_checkpoint():
    test_vmap_jit_and_checkpoint_gradients_match_reference((1, 20, 2, 1, 8, 16, 2))
    test_vmap_jit_and_checkpoint_gradients_match_reference((1, 20, 2, 1, 16, 16, 8))


@pytest.mark.gpu
def test_gpu_automatic_choice_is_pallas():
    arrays, _ = make_inputs((2, 64, 4, 1, 128, 64, 32), jnp.bfloat16)
    impl = dispatch.choose("mamba3_siso_scan", None, Q=arrays["Q"], V=arrays["V"], Angles=arrays["Angles"],
                           initial_state=None, reset=None, tuning=Mamba3ScanTuning(chunk_size=64))
    assert impl.fn.__name__ == "mamba3_siso_scan_pallas"
