"""Pallas selective scan vs the pure-JAX reference: values and every cotangent, dispatch, lowering.

CPU: the same kernels run in the Pallas interpreter at tiny, deliberately awkward shapes (T not a
multiple of the chunk, n not a power of two, channel blocks of 1, groups, resets, every optional
argument on and off, f32 and bf16), plus a lowering of the kernels for an abstract H200 so that an op
the Triton lowering does not support fails here, without a GPU. Interpret-mode compiles dominate the
run time (~6 s each), so each case is one jitted forward+VJP.
GPU (`-m gpu`, H200): the full matrix including the benchmark shape (B=8, T=2048, d=1536, n=16), determinism, jit/vmap/checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
# The Pallas interpreter imports `pallas.fuser` on first use, which registers a config value in JAX's
# trace context and so invalidates every jit cache entry made before it; import it up front.
import jax.experimental.pallas.fuser  # noqa: F401
import jax.numpy as jnp
import numpy as np
import pytest

from builders import mamba1_implementation_args, mamba1_scan_inputs
from helpers import assert_close
from jmamba.ops import SelectiveScanState, dispatch, selective_scan
from jmamba.ops.selective_scan import pallas as pallas_glue
from jmamba.ops.selective_scan.reference import selective_scan_reference
from pallas_kernels.selective_scan import ScanBlockConfig, selective_scan_pallas

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
ON_GPU = jax.default_backend() == "gpu"
# Small unrolls keep interpret-mode compiles short; chunk 8 with sub-chunks of 4 gives several chunks
# and several sub-chunks per chunk at T ~ 40.
TINY = ScanBlockConfig(block_d=4, chunk=8, fwd_unroll=4, bwd_sub_chunk=4)
# The backward with its own channel blocks, a forward unroll shorter than the backward sub-chunk,
# B/C rows loaded up front, and no layout hint.
TINY_SPLIT = ScanBlockConfig(block_d=4, chunk=8, fwd_unroll=2, bwd_sub_chunk=4, bwd_block_d=2, prefetch_bc=True,
                             hide_channel_alignment=False)


def make_inputs(shape, dtype, *, with_D=True, with_z=True, with_bias=True, with_h0=True, with_reset=False,
                seed=0):
    """Random arguments of the implementation contract keyed by NAMES (B, C grouped [Bt, T, g, n];
    initial_state a [Bt, d, n] array or None); parameters and state float32. With resets: one at t = 0
    (same as a zero initial state for that row) and one in the middle of a chunk, besides random ones."""
    kw, reset = mamba1_scan_inputs(shape, dtype, with_D=with_D, with_z=with_z, with_bias=with_bias, with_h0=with_h0,
                                   reset_prob=0.08 if with_reset else 0.0,
                                   forced_resets=[(0, 0), (shape[0] - 1, shape[1] // 2)] if with_reset else ())
    return dict(zip(NAMES, mamba1_implementation_args(kw))), reset


def cotangents(args, seed=1):
    r = np.random.default_rng(seed)
    bsz, T, d = args["u"].shape
    n = args["A"].shape[1]
    return (jnp.asarray(r.normal(size=(bsz, T, d)), args["u"].dtype),
            jnp.asarray(r.normal(size=(bsz, d, n)), jnp.float32))


@functools.partial(jax.jit, static_argnames=("impl", "softplus", "present"))
def _value_and_vjp(impl, softplus, present, arrays, reset, d_out, d_last):
    """(out, final_state, cotangents of the present arrays) of one implementation, jitted."""
    def f(*vals):
        kw = dict(zip(present, vals))
        full = [kw.get(k) for k in NAMES]
        return impl(*full, reset, delta_softplus=softplus)

    (out, last), vjp = jax.vjp(f, *arrays)
    return out, last, vjp((d_out, d_last))


@functools.lru_cache(maxsize=None)
def _pallas(config):
    """One callable per config, so the jit cache of `_value_and_vjp` (static `impl`) is reused."""
    return functools.partial(selective_scan_pallas, config=config, interpret=not ON_GPU)


def run_both(args, reset, config, softplus=True):
    present = tuple(k for k in NAMES if args[k] is not None)
    arrays = tuple(args[k] for k in present)
    d_out, d_last = cotangents(args)
    got = _value_and_vjp(_pallas(config), softplus, present, arrays, reset, d_out, d_last)
    want = _value_and_vjp(selective_scan_reference, softplus, present, arrays, reset, d_out, d_last)
    return present, got, want


def check_against_reference(args, reset, config, tol, softplus=True):
    present, (out, last, cts), (w_out, w_last, w_cts) = run_both(args, reset, config, softplus)
    assert out.dtype == args["u"].dtype and out.shape == args["u"].shape
    assert last.dtype == jnp.float32 and last.shape == w_last.shape
    assert_close("out", out, w_out, tol)
    assert_close("final_state", last, w_last, tol)
    for name, got, want in zip(present, cts, w_cts):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        # dA and d delta_bias sum over every (b, t): compare at the scale of the sum.
        assert_close(f"d{name}", got, want, tol * (2 if name in ("A", "delta_bias", "D") else 1))
    return present, cts


# The instruction-count options (kernel_math.KernelMath, config.py) are the defaults, so TINY has them;
# in the interpreter the softplus series runs as on the GPU, but ex2 / rcp / fma are plain jnp ops (and
# XLA folds the fast σ back into its own sigmoid). TINY_FAST adds the float32 B/C rows.
TINY_FAST = dataclasses.replace(TINY, fast_math=True, fused_multiply_add=True, f32_state_rows=True,
                                bwd_hide_channel_alignment=False, bwd_prefetch_rows=True)

# the pre-2026-12-04 default: libdevice softplus / sigmoid, the layout hint in the backward, no prefetch
TINY_EXACT = dataclasses.replace(TINY, fast_math=False, fused_multiply_add=False, bwd_hide_channel_alignment=None,
                                 bwd_prefetch_rows=False)

TINY_STRIDE = dataclasses.replace(TINY, bwd_sub_chunk=2, bwd_adjoint_stride=2)

# dB / dC summed over the channels by one warp-shuffle reduce-scatter (channel_sums.py): 32 channels
# on one warp with the backward's layout hint, d_state 16
SHUFFLE_SUMS = ScanBlockConfig(bwd_hide_channel_alignment=True, bwd_channel_sums="shuffle")
TINY_SHUFFLE = ScanBlockConfig(block_d=32, chunk=8, fwd_unroll=4, bwd_sub_chunk=2, bwd_hide_channel_alignment=True,
                               bwd_channel_sums="shuffle")

# (id, shape (Bt, T, d, n, g), dtype, options, softplus, config, tol)
CASES = [
    ("f32-all-reset-groups", (2, 37, 8, 4, 2), jnp.float32,
     dict(with_reset=True), True, TINY, 3e-5),
    ("bf16-all-reset-n5-split-config", (1, 70, 12, 5, 1), jnp.bfloat16,
     dict(with_reset=True), True, TINY_SPLIT, 1e-2),
    ("f32-bare", (2, 19, 4, 3, 1), jnp.float32,
     dict(with_D=False, with_z=False, with_bias=False, with_h0=False), True, TINY, 3e-5),
    ("f32-no-softplus-D-only", (3, 21, 8, 8, 1), jnp.float32,
     dict(with_z=False, with_bias=False), False, TINY, 3e-5),
    ("f32-odd-groups-blocks-of-1", (1, 9, 6, 3, 2), jnp.float32,
     dict(with_reset=True), True, TINY, 3e-5),
    ("f32-all-reset-groups-fast-math", (2, 37, 8, 4, 2), jnp.float32,
     dict(with_reset=True), True, TINY_FAST, 3e-5),
    ("bf16-all-reset-n5-fast-math", (1, 70, 12, 5, 1), jnp.bfloat16,
     dict(with_reset=True), True, TINY_FAST, 1e-2),
    ("f32-all-reset-groups-exact-math", (2, 37, 8, 4, 2), jnp.float32,
     dict(with_reset=True), True, TINY_EXACT, 3e-5),
    # an adjoint stored every 2 sub-chunks of 2 steps: two blocks per chunk of 8, resets inside blocks
    ("f32-all-reset-groups-adjoint-stride-2", (2, 37, 8, 4, 2), jnp.float32,
     dict(with_reset=True), True, TINY_STRIDE, 3e-5),
    ("bf16-all-reset-n5-split-adjoint-stride-2", (1, 70, 12, 5, 1), jnp.bfloat16,
     dict(with_reset=True), True, dataclasses.replace(TINY_SPLIT, bwd_sub_chunk=2, bwd_adjoint_stride=2), 1e-2),
    # stride 4 with two stored blocks per chunk of 16 and resets inside and between them
    ("f32-reset-adjoint-stride-4", (2, 45, 4, 3, 1), jnp.float32,
     dict(with_reset=True), True, dataclasses.replace(TINY, chunk=16, bwd_sub_chunk=2, bwd_adjoint_stride=4), 3e-5),
    # two groups of 32 channels, an odd T with padding, resets: dB / dC from the reduce-scatter
    ("f32-reset-groups-shuffle-channel-sums", (2, 21, 64, 16, 2), jnp.float32,
     dict(with_reset=True), True, TINY_SHUFFLE, 3e-5),
    ("bf16-shuffle-channel-sums", (1, 19, 32, 16, 1), jnp.bfloat16, dict(), True, TINY_SHUFFLE, 1e-2),
]


@pytest.mark.parametrize("shape,dtype,options,softplus,config,tol", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_values_and_every_cotangent_match_reference(shape, dtype, options, softplus, config, tol):
    args, reset = make_inputs(shape, dtype, **options)
    check_against_reference(args, reset, config, tol, softplus)


def test_two_runs_are_bit_identical():
    """Partial sums (dA, dB, dC, dD, d delta_bias) are reduced in a fixed order: no run-to-run noise."""
    args, reset = make_inputs((2, 37, 8, 4, 2), jnp.float32, with_reset=True)
    _, first, _ = run_both(args, reset, TINY)
    _, second, _ = run_both(args, reset, TINY)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_under_vmap_matches_a_loop_over_the_mapped_axis():
    """vmap prepends a grid axis to every pallas_call (the kernels use a 1-D grid so this still lowers)."""
    args, _ = make_inputs((2, 13, 4, 2, 1), jnp.float32)
    stacked = {k: args[k] for k in ("u", "delta", "z")}
    shared = {k: args[k] for k in NAMES if k not in stacked}
    f = _pallas(TINY)

    def loss(stacked, A):
        def one(u, delta, z):
            y, h = f(u, delta, A, shared["B"], shared["C"], shared["D"], z, shared["delta_bias"],
                     shared["initial_state"], None, delta_softplus=True)
            return jnp.sum(y * jnp.sin(y)) + jnp.sum(h * h)
        return jnp.sum(jax.vmap(one)(stacked["u"][None].repeat(2, 0) * jnp.array([1.0, -0.5])[:, None, None, None],
                                     stacked["delta"][None].repeat(2, 0), stacked["z"][None].repeat(2, 0)))

    def loss_loop(stacked, A):
        total = 0.0
        for scale in (1.0, -0.5):
            y, h = selective_scan_reference(stacked["u"] * scale, stacked["delta"], A, shared["B"], shared["C"],
                                            shared["D"], stacked["z"], shared["delta_bias"],
                                            shared["initial_state"], None, delta_softplus=True)
            total = total + jnp.sum(y * jnp.sin(y)) + jnp.sum(h * h)
        return total

    got_val, got_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(stacked, shared["A"])
    want_val, want_grad = jax.jit(jax.value_and_grad(loss_loop, argnums=(0, 1)))(stacked, shared["A"])
    assert_close("value", got_val, want_val, 3e-5)
    for name, got, want in zip(("u", "delta", "z", "A"), [*(got_grad[0][k] for k in ("u", "delta", "z")), got_grad[1]],
                               [*(want_grad[0][k] for k in ("u", "delta", "z")), want_grad[1]]):
        assert_close(f"d{name}", got, want, 3e-5)


def test_under_jit_and_checkpoint_gradients_match_reference():
    args, reset = make_inputs((1, 11, 4, 2, 1), jnp.float32, with_reset=True)
    f = _pallas(TINY)

    def loss(impl, u, A, h0):
        y, h = impl(u, args["delta"], A, args["B"], args["C"], args["D"], args["z"], args["delta_bias"], h0, reset,
                    delta_softplus=True)
        return jnp.sum(jnp.tanh(y)) + jnp.sum(h)

    got = jax.jit(jax.grad(lambda *a: jax.checkpoint(functools.partial(loss, f))(*a), argnums=(0, 1, 2)))(
        args["u"], args["A"], args["initial_state"])
    want = jax.jit(jax.grad(functools.partial(loss, selective_scan_reference), argnums=(0, 1, 2)))(
        args["u"], args["A"], args["initial_state"])
    for name, a, b in zip(("u", "A", "initial_state"), got, want):
        assert_close(f"d{name}", a, b, 3e-5)


@pytest.mark.parametrize("sub", [2, 4])
def test_reusing_the_forward_walks_decays_is_bit_identical(sub):
    """`bwd_reuse_decay` only avoids recomputing ā in the reverse walk: same values, bit for bit."""
    args, reset = make_inputs((2, 21, 8, 5, 2), jnp.bfloat16, with_reset=True)
    base = ScanBlockConfig(block_d=4, chunk=8, fwd_unroll=2, bwd_sub_chunk=sub, bwd_reuse_decay=False)
    present = tuple(k for k in NAMES if args[k] is not None)
    arrays = tuple(args[k] for k in present)
    d_out, d_last = cotangents(args)
    off = _value_and_vjp(_pallas(base), True, present, arrays, reset, d_out, d_last)
    on = _value_and_vjp(_pallas(dataclasses.replace(base, bwd_reuse_decay=True)), True, present, arrays, reset,
                        d_out, d_last)
    for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(on)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("sub,dtype,with_reset", [(2, jnp.bfloat16, True), (4, jnp.float32, False), (1, jnp.float16, True)])
def test_prefetching_the_backwards_rows_is_bit_identical(sub, dtype, with_reset):
    """`bwd_prefetch_rows` only loads the next sub-chunk's rows earlier: same values, bit for bit
    (time padding, several chunks and sub-chunks, resets or none)."""
    args, reset = make_inputs((2, 37, 8, 5, 2), dtype, with_reset=with_reset)
    base = ScanBlockConfig(block_d=4, chunk=16, fwd_unroll=2, bwd_sub_chunk=sub)
    present = tuple(k for k in NAMES if args[k] is not None)
    arrays = tuple(args[k] for k in present)
    d_out, d_last = cotangents(args)
    off = _value_and_vjp(_pallas(base), True, present, arrays, reset, d_out, d_last)
    on = _value_and_vjp(_pallas(dataclasses.replace(base, bwd_prefetch_rows=True)), True, present, arrays, reset,
                        d_out, d_last)
    for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(on)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("shape,dtype,with_reset", [
    ((2, 37, 8, 5, 1), jnp.float32, True),       # time padding, resets
    ((2, 64, 16, 4, 2), jnp.bfloat16, False),     # groups
], ids=["f32-padding-resets", "bf16-groups"])
def test_the_parallel_forward_matches_the_serial_one(shape, dtype, with_reset):
    """`fwd_parallel` (a parallel prefix over time per state index) gives the serial kernel's outputs up
    to rounding (the scan's tree order), and the same final state (both come from the same summaries)."""
    args, reset = make_inputs(shape, dtype, with_reset=with_reset)
    base = ScanBlockConfig(block_d=4, chunk=16, fwd_unroll=2, bwd_sub_chunk=2)
    kw = {k: args[k] for k in NAMES}
    y_s, h_s = _pallas(base)(**kw, reset=reset, delta_softplus=True)
    y_p, h_p = _pallas(dataclasses.replace(base, fwd_parallel=True))(**kw, reset=reset, delta_softplus=True)
    assert_close("out", y_p, y_s, 2e-6 if dtype == jnp.float32 else 1e-2)
    np.testing.assert_array_equal(np.asarray(h_p), np.asarray(h_s))


@pytest.mark.parametrize("offset", [8, 6], ids=["block-aligned-in-place", "unaligned-sliced"])
def test_a_gate_read_from_a_wider_array_gives_the_same_values_and_cotangents(offset):
    """selective_scan_forward / _backward with z inside a wider array (`z_channel_offset`): the
    block-aligned offset is read in place, another is sliced out; both equal the plain call bit for bit,
    and dz comes back [Bt, T, d]."""
    from pallas_kernels.selective_scan import selective_scan_backward, selective_scan_forward
    args, reset = make_inputs((2, 21, 8, 3, 1), jnp.float32, with_reset=True)
    cfg = ScanBlockConfig(block_d=4, chunk=8, fwd_unroll=2, bwd_sub_chunk=2)
    z = args["z"]
    wide = jnp.concatenate([jnp.full(z.shape[:2] + (offset,), 7.0), z, jnp.full(z.shape[:2] + (3,), -7.0)], -1)
    pos = [args[k] for k in ("u", "delta", "A", "B", "C", "D")]
    rest = [args["delta_bias"], args["initial_state"], reset]
    d_out, d_last = cotangents(args)
    kw = dict(delta_softplus=True, config=cfg, interpret=True)
    plain = selective_scan_forward(*pos, z, *rest, **kw)
    in_wide = selective_scan_forward(*pos, wide, *rest, z_channel_offset=offset, **kw)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(in_wide)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    g_plain = selective_scan_backward(*pos, z, *rest, plain[2], d_out, d_last, **kw)
    g_wide = selective_scan_backward(*pos, wide, *rest, in_wide[2], d_out, d_last, z_channel_offset=offset, **kw)
    assert g_wide[6].shape == z.shape
    for a, b in zip(g_plain, g_wide):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------- abstract H200 lowering
@functools.lru_cache(maxsize=None)
def _input_specs(shape, dtype, with_reset):
    """(present names, their ShapeDtypeStructs, the reset mask or None) of make_inputs: drawing the
    arrays at the benchmark shape takes seconds, so each shape is drawn once per process."""
    args, reset = make_inputs(shape, dtype, with_reset=with_reset)
    present = tuple(k for k in NAMES if args[k] is not None)
    return present, tuple(jax.ShapeDtypeStruct(args[k].shape, args[k].dtype) for k in present), reset


def _lower_for_h200(shape, dtype, config, *, with_reset):
    """Traces forward+backward and lowers it for an abstract H200: runs the Pallas->Triton lowering."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    present, specs, reset = _input_specs(shape, dtype, with_reset)

    def loss(*vals):
        y, h = selective_scan_pallas(*vals, reset, delta_softplus=True, config=config)
        return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h)

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)   # "Pallas Triton backend is deprecated"
        lowered = jax.jit(jax.grad(loss, argnums=tuple(range(len(present))))).trace(*specs).lower(
            lowering_platforms=("cuda",))
    return lowered.as_text()


@pytest.mark.parametrize("shape,dtype,config,with_reset", [
    ((8, 2048, 1536, 16, 1), jnp.bfloat16, None, False),                 # the benchmark shape, default config
    ((2, 70, 12, 5, 2), jnp.float32, TINY, True),                           # padding, groups, resets
    ((8, 2048, 1536, 16, 1), jnp.bfloat16, ScanBlockConfig(bwd_reuse_decay=False), False),
    ((8, 2048, 1536, 16, 1), jnp.bfloat16, ScanBlockConfig(fwd_parallel=True), True),
    ((8, 2048, 1536, 16, 1), jnp.bfloat16, ScanBlockConfig(bwd_prefetch_rows=True), True),
    ((8, 2048, 1536, 16, 1), jnp.bfloat16, ScanBlockConfig(fast_math=True, fused_multiply_add=True, f32_state_rows=True,
                                                           bwd_hide_channel_alignment=False), True),
    ((8, 2048, 1536, 16, 1), jnp.bfloat16, ScanBlockConfig(bwd_adjoint_stride=2), True),
    ((8, 2048, 1536, 16, 1), jnp.bfloat16, SHUFFLE_SUMS, True),
], ids=["perf-shape-default", "odd-shape-reset", "perf-shape-no-reuse-decay", "perf-shape-parallel-forward",
        "perf-shape-prefetch-rows", "perf-shape-fast-math", "perf-shape-adjoint-stride-2", "perf-shape-shuffle-sums"])
def test_kernels_lower_to_triton_for_h200(shape, dtype, config, with_reset):
    text = _lower_for_h200(shape, dtype, config, with_reset=with_reset)
    # forward: summaries, combine, outputs; backward: adjoint summaries, adjoint combine, gradients
    assert text.count("__gpu$xla.gpu.triton") == 6


def test_abstract_lowering_rejects_an_op_triton_cannot_lower():
    """The lowering check above is real: an unsupported primitive (rev) inside a kernel fails it."""
    from jax.experimental import pallas as pl
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.rev(x_ref[...], (0,))

    f = lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    with pytest.raises(NotImplementedError, match="rev"), jax.sharding.use_abstract_mesh(mesh):
        jax.jit(f).trace(jax.ShapeDtypeStruct((16,), jnp.float32)).lower(lowering_platforms=("cuda",))


# ------------------------------------------------------------------------------------------ dispatch
def test_explicit_pallas_through_the_op_runs_on_cpu_in_interpret_mode():
    args, _ = make_inputs((1, 6, 4, 2, 1), jnp.float32)
    args = dict(args, initial_state=SelectiveScanState(args["initial_state"]))
    got = jax.jit(lambda a: selective_scan(**a, delta_softplus=True, return_final_state=True,
                                           implementation="pallas"))(args)
    want = selective_scan(**args, delta_softplus=True, return_final_state=True, implementation="reference")
    assert_close("out", got[0], want[0], 3e-5)
    assert_close("final_state", got[1].ssm, want[1].ssm, 3e-5)


@pytest.mark.parametrize("platform,change,reason", [
    ("tpu", {}, "platform 'tpu'"),
    ("gpu", {"A": (4, 128)}, "d_state n=128"),
    ("gpu", {"u": (1, 6, 4, "float64")}, "float64"),
    ("gpu", {"u": (1, 0, 4)}, "empty"),
])
def test_supported_explains_what_it_cannot_handle(platform, change, reason):
    with jax.enable_x64(True):   # so that a float64 array can exist
        shapes = dict(u=(1, 6, 4), A=(4, 2), B=(1, 6, 1, 2))
        baseline = {k: jnp.ones(v, jnp.float32) for k, v in shapes.items()}
        call = dict(baseline)
        for k, v in change.items():
            call[k] = jnp.ones(v[:-1], v[-1]) if isinstance(v[-1], str) else jnp.ones(v, jnp.float32)
        if platform == "gpu":   # the same call without the change is supported
            assert pallas_glue.supported(platform=platform, **baseline) is None
        msg = pallas_glue.supported(platform=platform, **call)
        assert msg is not None and reason in msg
        with pytest.raises(NotImplementedError, match=reason):
            dispatch.choose("selective_scan", "pallas", platform=platform, **call)


def test_automatic_choice_falls_back_to_xla_with_one_warning_and_prefers_pallas_on_gpu():
    call = dict(u=jnp.ones((1, 6, 4), jnp.float32), A=jnp.ones((4, 80), jnp.float32), B=jnp.ones((1, 6, 1, 80)),
                initial_state=None, reset=None)
    dispatch._WARNED.clear()
    with pytest.warns(UserWarning, match="instead of 'pallas'.*d_state n=80"):
        impl = dispatch.choose("selective_scan", None, platform="gpu", **call)
    assert impl.fn.__name__ == "selective_scan_xla"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same reason warns only once
        dispatch.choose("selective_scan", None, platform="gpu", **call)
    ok = dict(call, A=jnp.ones((4, 16), jnp.float32), B=jnp.ones((1, 6, 1, 16)))
    assert dispatch.choose("selective_scan", None, platform="gpu", **ok).fn.__name__ == "selective_scan_pallas"
    assert dispatch.choose("selective_scan", None, platform="cpu", **ok).fn.__name__ == "selective_scan_xla"


@pytest.mark.parametrize("field,value", [("block_d", 3), ("fwd_unroll", 0), ("bwd_sub_chunk", 6), ("chunk", 12),
                                         ("num_warps", 3), ("num_stages", 0), ("bwd_block_d", 24),
                                         ("bwd_num_warps", 0), ("prefetch_bc", 1), ("bwd_adjoint_stride", 3), ("bwd_adjoint_stride", None),
                                         ("fast_math", 1), ("bwd_hide_channel_alignment", 0),
                                         ("bwd_channel_sums", "fast")])
def test_bad_block_config_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ScanBlockConfig(**{field: value}).validate()


def test_shuffle_channel_sums_are_the_column_sums_of_both_tiles():
    """The reduce-scatter's arithmetic (the interpreter's form of the shuffle: the same permutation of the
    lanes), against numpy's sums: element l is Σ_c x_b[l, c] for l < 16, Σ_c x_c[l - 16, c] above."""
    from pallas_kernels.selective_scan import channel_sums
    r = np.random.default_rng(3)
    x_b, x_c = (r.normal(size=(16, 32)).astype(np.float32) for _ in range(2))
    got = np.asarray(channel_sums.dB_dC_sums(jnp.asarray(x_b), jnp.asarray(x_c), gpu=False))
    want = np.concatenate([x_b.astype(np.float64).sum(1), x_c.astype(np.float64).sum(1)])
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("n,change,words", [
    (16, dict(), "hint=False"),                                                # the backward hint is off by default
    (16, dict(bwd_hide_channel_alignment=True, block_d=16), "block_d=16"),
    (16, dict(bwd_hide_channel_alignment=True, bwd_num_warps=2, bwd_block_d=32), "num_warps=2"),
    (8, dict(bwd_hide_channel_alignment=True), "d_state"),
])
def test_shuffle_channel_sums_refuse_a_layout_they_cannot_rely_on(n, change, words):
    args, _ = make_inputs((1, 8, 64, n, 1), jnp.float32)
    cfg = ScanBlockConfig(chunk=8, fwd_unroll=4, bwd_sub_chunk=2, bwd_channel_sums="shuffle", **change)
    with pytest.raises(ValueError, match=words):
        jax.grad(lambda u: selective_scan_pallas(u, *[args[k] for k in NAMES[1:]], None, delta_softplus=True,
                                                 config=cfg, interpret=True)[0].sum())(args["u"])


def test_chunk_must_hold_whole_stored_adjoint_blocks():
    with pytest.raises(ValueError, match="bwd_adjoint_stride"):
        ScanBlockConfig(chunk=8, bwd_sub_chunk=4, bwd_adjoint_stride=4).validate()


def test_adjoint_stride_stores_fewer_sub_chunk_adjoints():
    """The point of the option: the scratch the adjoint summaries write shrinks by the stride."""
    from pallas_kernels.selective_scan import backward
    from pallas_kernels.selective_scan.scan import kernel_operands, make_problem, padded_operands

    args, _ = make_inputs((1, 32, 8, 4, 1), jnp.float32)
    sizes = {}
    for stride in (1, 2):
        cfg = dataclasses.replace(TINY, bwd_sub_chunk=2, bwd_adjoint_stride=stride)
        problem = make_problem(args["u"], args["A"], args["B"], args["D"], args["z"], args["delta_bias"], None,
                               delta_softplus=True, config=cfg, interpret=True).for_backward()
        ops = padded_operands(problem, *(args[k] for k in NAMES), None)
        d_out = jnp.ones_like(args["u"])
        shapes = jax.eval_shape(lambda o: backward.adjoint_summaries(problem, o),
                                kernel_operands(problem, *ops[:8], None, d_out=d_out))
        sizes[stride] = shapes[1].shape
    assert sizes[1][2] == 2 * sizes[2][2] == 4   # [Bt, nc, stored adjoints per chunk, n, d]


def test_config_is_shrunk_to_the_call():
    cfg = ScanBlockConfig(block_d=32, chunk=128, fwd_unroll=8, bwd_sub_chunk=4).fitted(seqlen=13, d=24, group_size=12)
    assert (cfg.block_d, cfg.chunk) == (4, 16)   # 4 = largest power of two dividing the group size 12
    with pytest.raises(TypeError, match="config"):
        selective_scan_pallas(*make_inputs((1, 4, 2, 2, 1), jnp.float32)[0].values(), None, delta_softplus=True,
                              config={"block_d": 4})


# ------------------------------------------------------------------------------------------------ GPU
NO_HINT = ScanBlockConfig(hide_channel_alignment=False)
FAST = ScanBlockConfig(fast_math=True, fused_multiply_add=True, f32_state_rows=True, bwd_hide_channel_alignment=False,
                       bwd_prefetch_rows=True)
# the default before 2026-12-04: libdevice math, two roundings per multiply-add, the hint everywhere
EXACT = ScanBlockConfig(fast_math=False, fused_multiply_add=False, bwd_hide_channel_alignment=None,
                        bwd_prefetch_rows=False)
GPU_CASES = [  # (id, shape, dtype, options, config (None: the default), tol)
    ("perf-shape-bf16", (8, 2048, 1536, 16, 1), jnp.bfloat16, dict(), None, 1e-2),
    ("perf-shape-bf16-fast-f32-rows", (8, 2048, 1536, 16, 1), jnp.bfloat16, dict(), FAST, 1e-2),
    ("perf-shape-bf16-exact-math", (8, 2048, 1536, 16, 1), jnp.bfloat16, dict(), EXACT, 1e-2),
    ("perf-shape-bf16-adjoint-stride-2", (8, 2048, 1536, 16, 1), jnp.bfloat16, dict(),
     ScanBlockConfig(bwd_adjoint_stride=2), 1e-2),
    ("f32-odd-everything-adjoint-stride-2", (2, 333, 40, 5, 2), jnp.float32, dict(with_reset=True),
     ScanBlockConfig(bwd_adjoint_stride=2), 1e-4),
    ("bf16-reset-groups-odd-T-fast", (3, 1000, 192, 16, 3), jnp.bfloat16, dict(with_reset=True), FAST, 1e-2),
    ("f32-odd-everything-fast", (2, 333, 40, 5, 2), jnp.float32, dict(with_reset=True), FAST, 1e-4),
    ("f16-bare-fast", (2, 300, 64, 16, 1), jnp.float16,
     dict(with_D=False, with_z=False, with_bias=False, with_h0=False), FAST, 5e-3),
    ("perf-shape-bf16-no-layout-hint", (8, 2048, 1536, 16, 1), jnp.bfloat16, dict(), NO_HINT, 1e-2),
    # the reduce-scatter's layout premise (lane = channel) holds on the GPU, or these fail
    ("perf-shape-bf16-shuffle-sums", (8, 2048, 1536, 16, 1), jnp.bfloat16, dict(), SHUFFLE_SUMS, 1e-2),
    ("bf16-reset-groups-odd-T-shuffle-sums", (3, 1000, 192, 16, 3), jnp.bfloat16, dict(with_reset=True),
     SHUFFLE_SUMS, 1e-2),
    ("bf16-reset-groups-odd-T", (3, 1000, 192, 16, 3), jnp.bfloat16, dict(with_reset=True), None, 1e-2),
    ("f32-odd-everything", (2, 333, 40, 5, 2), jnp.float32, dict(with_reset=True), None, 1e-4),
    ("f16-bare", (2, 300, 64, 16, 1), jnp.float16,
     dict(with_D=False, with_z=False, with_bias=False, with_h0=False), None, 5e-3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,options,config,tol", [c[1:] for c in GPU_CASES], ids=[c[0] for c in GPU_CASES])
def test_gpu_values_and_cotangents_match_reference(shape, dtype, options, config, tol):
    args, reset = make_inputs(shape, dtype, **options)
    check_against_reference(args, reset, config, tol)


@pytest.mark.gpu
def test_gpu_two_runs_are_bit_identical_at_the_perf_shape():
    args, _ = make_inputs((8, 2048, 1536, 16, 1), jnp.bfloat16)
    _, first, _ = run_both(args, None, None)
    _, second, _ = run_both(args, None, None)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_gpu_prefetching_the_backwards_rows_is_bit_identical_at_the_perf_shape():
    """bwd_prefetch_rows (the default) changes when rows are loaded, not what is computed."""
    args, _ = make_inputs((8, 2048, 1536, 16, 1), jnp.bfloat16)
    _, on, _ = run_both(args, None, None)
    _, off, _ = run_both(args, None, ScanBlockConfig(bwd_prefetch_rows=False))
    for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(on)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_gpu_fast_math_runs_are_bit_identical_and_f32_rows_change_nothing():
    """Two runs with the fast options agree bit for bit; reading B/C as float32 is the same values."""
    args, _ = make_inputs((8, 2048, 1536, 16, 1), jnp.bfloat16)
    _, first, _ = run_both(args, None, FAST)
    _, second, _ = run_both(args, None, FAST)
    _, bf16_rows, _ = run_both(args, None, dataclasses.replace(FAST, f32_state_rows=False))
    for a, b, c in zip(jax.tree.leaves(first), jax.tree.leaves(second), jax.tree.leaves(bf16_rows)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.gpu
def test_gpu_automatic_choice_is_pallas():
    args, _ = make_inputs((2, 64, 32, 16, 1), jnp.bfloat16)
    impl = dispatch.choose("selective_scan", None, u=args["u"], A=args["A"], B=args["B"], initial_state=None,
                           reset=None)
    assert impl.fn.__name__ == "selective_scan_pallas"
