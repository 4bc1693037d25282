"""The Pallas causal conv + SiLU kernels (`pallas_kernels.causal_conv`) against the pure-JAX conv of
`jmamba.ops.causal_conv1d` followed by SiLU, differentiated by its own custom_vjp: u and every
cotangent (x, the carried state, the taps, the bias; the packed dz copy), float32 / bf16 / f16,
d_conv 1, 3 and 4, odd lengths and widths (padding, partial channel blocks), resets, interpreted on
the CPU; lowering for an abstract H200; and on the H200 itself."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_close
from jmamba.ops import causal_conv1d
from pallas_kernels.causal_conv import ConvBlockConfig, conv_silu_backward, conv_silu_forward


def make(bt, seqlen, e, k, dtype, *, packed, reset, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s, dt=jnp.float32: jnp.asarray(rng.normal(size=s), dt)
    src = f(bt, seqlen, 2 * e if packed else e, dt=dtype)
    state = f(bt, k - 1, e)
    kernel, bias = 0.5 * f(k, e), 0.2 * f(e)
    rs = jnp.asarray(rng.random((bt, seqlen)) < 0.12) if reset else None
    du_a, du_b = f(bt, seqlen, e, dt=dtype), f(bt, seqlen, e, dt=dtype)
    dz = f(bt, seqlen, e, dt=dtype) if packed else None
    return src, state, kernel, bias, rs, du_a, du_b, dz


def reference(src, state, kernel, bias, reset, du, d_new=None):
    """(u, (dx, dstate, dkernel, dbias)) of silu(causal_conv1d(x)) with the cotangent du (and d_new
    for the new conv state), in float32."""
    e = kernel.shape[1]
    x = src[..., :e].astype(jnp.float32)

    def f(x, state, kernel, bias):
        c, new = causal_conv1d(x, state, kernel, bias, reset)
        return jax.nn.silu(c), new

    (u, new), vjp = jax.vjp(f, x, state, kernel, bias)
    return u, vjp((du, jnp.zeros_like(new) if d_new is None else d_new))


def kernel_d_new(d_new, reset, k):
    """The kernel's d_new argument: the rows a reset drops zeroed (the caller's job, see conv.py)."""
    from jmamba.ops.mamba1_mixer.common import new_state_keep
    keep = new_state_keep(reset, k)
    return d_new if keep is None else jnp.where(keep, d_new, 0.0)


CASES = [
    # (Bt, T, E, K), dtype, packed, reset, config, tolerance
    ((2, 37, 8, 4), jnp.float32, True, True, ConvBlockConfig(block_t=8, block_e=4), 2e-6),
    ((3, 16, 12, 3), jnp.bfloat16, True, True, ConvBlockConfig(block_t=4, block_e=8), 1e-2),
    ((1, 5, 4, 4), jnp.float16, False, True, ConvBlockConfig(block_t=4, block_e=2), 2e-3),
    ((2, 9, 6, 1), jnp.float32, True, True, ConvBlockConfig(block_t=4, block_e=2), 2e-6),   # K = 1
    ((1, 70, 16, 4), jnp.bfloat16, True, False, None, 1e-2),                                  # the defaults
    # the exact sigmoid and separate multiply and add (the defaults are the fast forms)
    ((2, 37, 8, 4), jnp.float32, True, True, ConvBlockConfig(block_t=8, block_e=4, fast_math=False,
                                                             fused_multiply_add=False), 2e-6),
    # loop_rows: the kernels as a loop over positions (rows_loop.py)
    ((2, 37, 8, 4), jnp.float32, True, True, ConvBlockConfig(block_t=8, block_e=4, loop_rows=True), 2e-6),
    ((3, 16, 12, 3), jnp.bfloat16, True, True, ConvBlockConfig(block_t=4, block_e=8, loop_rows=True), 1e-2),
    ((1, 5, 4, 4), jnp.float16, False, True, ConvBlockConfig(block_t=4, block_e=2, loop_rows=True), 2e-3),
    ((2, 9, 6, 1), jnp.float32, True, True, ConvBlockConfig(block_t=4, block_e=2, loop_rows=True), 2e-6),
    ((1, 70, 16, 4), jnp.float32, False, False, ConvBlockConfig(block_t=32, loop_rows=True), 2e-6),
]


@pytest.mark.parametrize("shape,dtype,packed,reset,config,tol", CASES,
                         ids=["f32-packed-resets", "bf16-K3", "f16-short", "f32-K1", "bf16-defaults", "f32-exact", "loop-f32-packed-resets",
                              "loop-bf16-K3", "loop-f16-short", "loop-f32-K1", "loop-f32-block32"])
def test_values_and_every_cotangent_match_the_xla_conv(shape, dtype, packed, reset, config, tol):
    bt, seqlen, e, k = shape
    src, state, kernel, bias, rs, du_a, du_b, dz = make(bt, seqlen, e, k, dtype, packed=packed, reset=reset)
    d_new = jnp.asarray(np.random.default_rng(5).normal(size=state.shape), jnp.float32)
    u = conv_silu_forward(src, state, kernel, bias, rs, config=config, interpret=True)
    d_src, d_state, d_kernel, d_bias = conv_silu_backward(src, state, kernel, bias, rs, du_a, du_b, dz,
                                                          kernel_d_new(d_new, rs, k), config=config,
                                                          interpret=True)
    du = du_a.astype(jnp.float32) + du_b.astype(jnp.float32)
    want_u, (dx, dstate, dkernel, dbias) = reference(src, state, kernel, bias, rs, du, d_new)
    assert u.dtype == src.dtype and u.shape == (bt, seqlen, e)
    assert d_src.dtype == src.dtype and d_src.shape == src.shape
    assert_close("u", u, want_u, tol)
    assert_close("dx", d_src[..., :e], dx, tol)
    assert_close("d_state", d_state, dstate, tol)
    assert_close("d_kernel", d_kernel, dkernel, tol)
    assert_close("d_bias", d_bias, dbias, tol)
    if packed:
        np.testing.assert_array_equal(np.asarray(d_src[..., e:], np.float32), np.asarray(dz, np.float32))


def test_no_bias_and_no_reset_mask_are_the_zero_bias_and_no_reset():
    src, state, kernel, bias, rs, du_a, du_b, dz = make(2, 21, 8, 4, jnp.float32, packed=False, reset=False)
    cfg = ConvBlockConfig(block_t=4, block_e=4)
    u = conv_silu_forward(src, state, kernel, None, None, config=cfg, interpret=True)
    want_u, (dx, *_) = reference(src, state, kernel, jnp.zeros_like(bias), None, du_a + du_b)
    assert_close("u", u, want_u, 2e-6)
    no_resets = jnp.zeros((2, 21), bool)
    got = conv_silu_backward(src, state, kernel, bias, no_resets, du_a, du_b, None, config=cfg, interpret=True)
    plain = conv_silu_backward(src, state, kernel, bias, None, du_a, du_b, None, config=cfg, interpret=True)
    for name, a, b in zip(("dx", "d_state", "d_kernel", "d_bias"), got, plain):   # (FMA contraction may differ)
        assert_close(name, a, b, 1e-6)


def test_dz_must_come_with_a_packed_source_and_d_new_with_the_state_shape():
    src, state, kernel, bias, rs, du_a, du_b, dz = make(1, 8, 4, 4, jnp.float32, packed=False, reset=False)
    with pytest.raises(ValueError, match="dz must be given exactly when src is the packed"):
        conv_silu_backward(src, state, kernel, bias, None, du_a, du_b, du_a, interpret=True)
    with pytest.raises(ValueError, match=r"d_new must be \[Bt, K-1, E\]"):
        conv_silu_backward(src, state, kernel, bias, None, du_a, du_b, None, state[:, :2], interpret=True)


@pytest.mark.parametrize("loop_rows", [False, True], ids=["rows-loaded", "rows-loop"])
@pytest.mark.parametrize("seqlen", [34, 33, 40])
def test_the_new_state_cotangent_lands_on_the_last_rows_across_a_block_boundary(seqlen, loop_rows):
    """T-(K-1) .. T-1 can straddle two blocks (T = 33, 34 with block_t 32) or end one (T = 40, 8)."""
    src, state, kernel, bias, rs, du_a, du_b, dz = make(1, seqlen, 4, 4, jnp.float32, packed=True, reset=False)
    d_new = jnp.asarray(np.random.default_rng(7).normal(size=state.shape), jnp.float32)
    cfg = ConvBlockConfig(block_t=32 if seqlen < 40 else 8, block_e=4, loop_rows=loop_rows)
    got = conv_silu_backward(src, state, kernel, bias, None, du_a, du_b, dz, d_new, config=cfg, interpret=True)
    _, want = reference(src, state, kernel, bias, None, du_a + du_b, d_new)
    assert_close("dx", got[0][..., :4], want[0], 2e-6)


@pytest.mark.parametrize("config", [None, ConvBlockConfig(loop_rows=True)], ids=["rows-loaded", "rows-loop"])
def test_kernels_lower_to_triton_for_h200(config):
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def f(src, st, w, b, reset, g1, g2, dz):
        return (conv_silu_forward(src, st, w, b, reset, config=config),
                conv_silu_backward(src, st, w, b, reset, g1, g2, dz, config=config))

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    for reset in (None, s((8, 2048), jnp.bool_)):
        args = (s((8, 2048, 3072), bf), s((8, 3, 1536), jnp.float32), s((4, 1536), jnp.float32),
                s((1536,), jnp.float32), reset, s((8, 2048, 1536), bf), s((8, 2048, 1536), bf),
                s((8, 2048, 1536), bf))
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
            warnings.simplefilter("ignore", DeprecationWarning)
            text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 2


def _lowered_kernels(config):
    """The Triton kernels of one forward + backward call lowered for an abstract H200, as text."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType
    s = jax.ShapeDtypeStruct

    def f(src, st, w, b, g):
        return (conv_silu_forward(src, st, w, b, None, config=config),
                conv_silu_backward(src, st, w, b, None, g, g, None, config=config))

    device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
    args = (s((2, 64, 128), jnp.bfloat16), s((2, 3, 128), jnp.float32), s((4, 128), jnp.float32),
            s((128,), jnp.float32), s((2, 64, 128), jnp.bfloat16))
    with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh):
        warnings.simplefilter("ignore", DeprecationWarning)
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_fast_math_and_fma_options_reach_the_lowered_kernels():
    """fast_math puts the hardware rcp into both kernels' sigmoid and fused_multiply_add the fma
    instruction into their taps (inline assembly, visible in the Triton IR that the custom calls
    carry); with both off there is neither."""
    exact = _lowered_kernels(ConvBlockConfig(fast_math=False, fused_multiply_add=False))
    fast = _lowered_kernels(None)      # the default: both on
    assert exact.count("__gpu$xla.gpu.triton") == fast.count("__gpu$xla.gpu.triton") == 2
    assert exact.count("fma.rn.f32") == exact.count("rcp.approx") == 0
    assert fast.count("fma.rn.f32") >= 2 and fast.count("rcp.approx") >= 2


def test_conv_config_flags_must_be_bools():
    with pytest.raises(TypeError, match="ConvBlockConfig.fast_math must be a bool"):
        ConvBlockConfig(fast_math=1).validate()
    with pytest.raises(TypeError, match="ConvBlockConfig.fused_multiply_add must be a bool"):
        ConvBlockConfig(fused_multiply_add="yes").validate()


FAST_CONV = ConvBlockConfig(fast_math=True, fused_multiply_add=True)       # the default
EXACT_CONV = ConvBlockConfig(fast_math=False, fused_multiply_add=False)
LOOP_CONV = ConvBlockConfig(loop_rows=True)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype,packed,reset,config,tol", [
    ((8, 2048, 1536, 4), jnp.bfloat16, True, False, EXACT_CONV, 1e-2),
    ((2, 999, 96, 4), jnp.float32, False, True, EXACT_CONV, 2e-5),
    ((3, 300, 40, 3), jnp.float16, True, True, None, 3e-3),
    ((8, 2048, 1536, 4), jnp.bfloat16, True, False, FAST_CONV, 1e-2),
    ((2, 999, 96, 4), jnp.float32, False, True, FAST_CONV, 2e-5),
    ((8, 2048, 1536, 4), jnp.bfloat16, True, False, LOOP_CONV, 1e-2),
    ((2, 999, 96, 4), jnp.float32, False, True, LOOP_CONV, 2e-5),
    ((3, 300, 40, 3), jnp.float16, True, True, LOOP_CONV, 3e-3),
], ids=["perf-shape-packed-exact", "f32-odd-resets-exact", "f16-K3", "perf-shape-packed-fast-fma", "f32-odd-resets-fast-fma",
        "perf-shape-packed-loop", "f32-odd-resets-loop", "f16-K3-loop"])
def test_gpu_values_and_cotangents_match_the_cpu_reference(shape, dtype, packed, reset, config, tol):
    """On the H200, against the XLA conv run on the CPU (XLA:GPU fuses with excess precision)."""
    bt, seqlen, e, k = shape
    ops_ = make(bt, seqlen, e, k, dtype, packed=packed, reset=reset)
    src, state, kernel, bias, rs, du_a, du_b, dz = ops_
    d_new = jnp.asarray(np.random.default_rng(5).normal(size=state.shape), jnp.float32)
    u = conv_silu_forward(src, state, kernel, bias, rs, config=config)
    got = conv_silu_backward(src, state, kernel, bias, rs, du_a, du_b, dz, kernel_d_new(d_new, rs, k), config=config)
    again = conv_silu_backward(src, state, kernel, bias, rs, du_a, du_b, dz, kernel_d_new(d_new, rs, k),
                               config=config)
    for a, b in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        src, state, kernel, bias, rs, du_a, du_b, dz, d_new = jax.device_put(ops_ + (d_new,), cpu)
        want_u, want = reference(src, state, kernel, bias, rs, du_a.astype(jnp.float32) + du_b.astype(jnp.float32),
                                 d_new)
    assert_close("u", u, want_u, tol)
    for name, g, w in zip(("dx", "d_state", "d_kernel", "d_bias"), (got[0][..., :e],) + tuple(got[1:]), want):
        assert_close(name, g, w, tol)
