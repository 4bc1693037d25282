"""The "pallas" implementation of `mamba1_mixer_core`: one `custom_vjp` around Pallas kernels for the
conv + SiLU and the selective scan, with the two small projections between them in XLA.

Forward: u = silu(conv(x̃) + bias) by the conv kernel (`pallas_kernels.causal_conv.conv_silu_forward`,
reading x in place from in_proj's packed [Bt, T, 2E] output when the op is called with
`xz_packed=True`), the x / Δ projections (two matmuls), then the scan's forward kernels
(`pallas_kernels.selective_scan.selective_scan_forward`, which read the gate z in place from the
packed array too: `z_channel_offset`).
Saved for the backward: the op's inputs (x or the packed xz, z, weights, states, reset) and the scan's
chunk-start states and δ sums ([Bt, T/chunk, ...], nothing per position). The conv output, u, delta,
B and C are kept by default too (the tuning `SelectiveScanTuning.mixer_residuals="activations"`: u and
delta [Bt, T, E], the x projection [Bt, T, R + 2N]). With `mixer_residuals="inputs"` they are **not**
saved: the backward recomputes u with the conv kernel and delta, B, C with the two matmuls, which keeps
a layer's activation memory near the official fused path's. The values are the same either way (the
recomputation is deterministic); keeping them saves one conv launch and two matmuls per layer.
Backward: the recomputation, the scan's backward kernels from the saved chunk states, the projections'
transpose (matmuls), then one conv kernel (`conv_silu_backward`) that recomputes c, forms dc from
both cotangents of u, and writes dx (into the packed [Bt, T, 2E] cotangent beside dz), the carried
state's cotangent and per-block partials of the conv weight and bias gradients (summed by XLA in a
fixed order: deterministic).

Numerics: the formulas of the "xla"/"reference" composition in float32 (conv, SiLU and their
derivatives; the kernel sums the two cotangents of u in float32 where autodiff adds them in u's
dtype); tested against the reference on CPU (interpreted) and the GPU. Windows shorter than
d_conv - 1 (decode-sized prefixes) run the conv through the op's XLA formula instead
(`common.causal_conv1d`: the same float32 formula), inside the same custom_vjp structure.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.ops.mamba1_mixer.common import (b_and_c, conv_new_state, new_state_keep, scan_operands,
                                            x_projection_and_delta)
from jmamba.ops.pallas_platform import interpret_mode
from jmamba.ops.selective_scan import pallas as scan_pallas
from jmamba.ops.selective_scan.common import SelectiveScanTuning


def supported(*, platform, x, A, **call):
    """None when the Pallas kernels can run this call (those of the selective scan), else why not."""
    return scan_pallas.supported(platform=platform, u=x, A=A, B=None, **call)


def mamba1_mixer_core_pallas(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                             conv_state, ssm_state, reset, *, tuning=None, xz_packed=False):
    """The op's implementation signature (api.py); `tuning.pallas_config`: a ScanBlockConfig or None."""
    static = (tuning and tuning.pallas_config, interpret_mode())
    k_size = conv_kernel.shape[0]
    if x.shape[1] >= k_size - 1:
        keep = (tuning or SelectiveScanTuning()).mixer_residuals == "activations"
        conv_config = _conv_config(static[1], tuning and tuning.conv_config)
        return _core_conv_kernel(static + (xz_packed, keep, conv_config), x, z, conv_kernel, conv_bias,
                                 x_proj_kernel,
                                 dt_proj_kernel, dt_bias, A, D, conv_state, ssm_state, reset)
    if xz_packed:      # a window shorter than the conv's context: the XLA conv (same formula)
        e = conv_kernel.shape[1]
        x, z = x[..., :e], x[..., e:]
    return _core(static, x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                 conv_state, ssm_state, reset)


def _kernels():
    from pallas_kernels import selective_scan as kernels
    return kernels


def _conv_kernels():
    from pallas_kernels import causal_conv
    return causal_conv


def _conv_config(interpret, config=None):
    """The conv kernels' block config: `config` (the tuning's conv_config; None: the default) on the
    GPU; under the CPU interpreter 8-position blocks, because the interpreter compiles each program's
    unrolled rows (its cost grows with block_t, not with the work). The kernels are tested at both
    sizes (tests/test_causal_conv_pallas.py)."""
    if not interpret:
        return config
    import dataclasses
    from pallas_kernels.causal_conv import ConvBlockConfig
    return dataclasses.replace(config or ConvBlockConfig(), block_t=8)


# ------------------------------------------------------------------- the conv kernel path (T >= K-1)
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core_conv_kernel(static, src, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                      conv_state, ssm_state, reset):
    out, _ = _core_conv_kernel_fwd(static, src, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel,
                                   dt_bias, A, D, conv_state, ssm_state, reset)
    return out


def _split(src, z, conv_kernel, packed):
    """(x, gate array, the gate's channel offset in it): the packed array's first half and the packed
    array itself with offset E (the scan kernels read the gate in place), or the arrays themselves."""
    if not packed:
        return src, z, 0
    e = conv_kernel.shape[1]
    return src[..., :e], src, e


def _core_conv_kernel_fwd(static, src, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A,
                          D, conv_state, ssm_state, reset):
    config, interpret, packed, keep, conv_config = static
    x, gate, gate_offset = _split(src, z, conv_kernel, packed)
    u = _conv_kernels().conv_silu_forward(src, conv_state, conv_kernel, conv_bias, reset,
                                          config=conv_config, interpret=interpret)
    x_dbl, delta = x_projection_and_delta(u, x_proj_kernel, dt_proj_kernel)
    Bm, Cm = b_and_c(x_dbl, dt_proj_kernel.shape[0])
    y, h_last, scan_residuals = _kernels().selective_scan_forward(
        u, delta, A, Bm, Cm, D, gate, dt_bias, ssm_state, reset, delta_softplus=True, config=config,
        interpret=interpret, z_channel_offset=gate_offset)
    new_conv = conv_new_state(x, conv_state, reset, conv_kernel.shape[0], accum_dtype(x.dtype, conv_kernel.dtype))
    residuals = (src, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state,
                 ssm_state, reset, scan_residuals, (u, x_dbl, delta) if keep else None)
    return (y, new_conv, h_last), residuals


def _projections_vjp(u, x_dbl, x_proj_kernel, dt_proj_kernel, d_delta, dB, dC):
    """Cotangents (du, dW_x, dW_dt) of `x_projection_and_delta` from u and x_dbl: the transposes that
    autodiff forms (the forward products themselves are not recomputed: they are dead code here)."""
    rank = dt_proj_kernel.shape[0]
    _, delta_vjp = jax.vjp(lambda a, w: jnp.dot(a, w.astype(a.dtype)), x_dbl[..., :rank], dt_proj_kernel)
    d_dt_in, d_dt_proj = delta_vjp(d_delta)
    d_x_dbl = jnp.concatenate([d_dt_in, dB[..., 0, :].astype(d_dt_in.dtype), dC[..., 0, :].astype(d_dt_in.dtype)],
                              axis=-1)
    _, x_dbl_vjp = jax.vjp(lambda a, w: jnp.dot(a, w.astype(a.dtype)), u, x_proj_kernel)
    du, d_x_proj = x_dbl_vjp(d_x_dbl)
    return du, d_x_proj, d_dt_proj


def _core_conv_kernel_bwd(static, residuals, cotangents):
    config, interpret, packed, _, conv_config = static
    (src, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state, ssm_state, reset,
     scan_residuals, kept) = residuals
    d_y, d_new_conv, d_h_last = cotangents
    k_size = conv_kernel.shape[0]
    _, gate, gate_offset = _split(src, z, conv_kernel, packed)
    conv = _conv_kernels()
    if kept is None:     # "inputs": recompute u, then x_dbl and delta, exactly as the forward did
        u = conv.conv_silu_forward(src, conv_state, conv_kernel, conv_bias, reset, config=conv_config,
                                   interpret=interpret)
        x_dbl, delta = x_projection_and_delta(u, x_proj_kernel, dt_proj_kernel)
    else:
        u, x_dbl, delta = kept
    Bm, Cm = b_and_c(x_dbl, dt_proj_kernel.shape[0])
    du, d_delta, dA, dB, dC, dD, dz, d_dt_bias, d_ssm = _kernels().selective_scan_backward(
        u, delta, A, Bm, Cm, D, gate, dt_bias, ssm_state, reset, scan_residuals, d_y, d_h_last,
        delta_softplus=True, config=config, interpret=interpret, z_channel_offset=gate_offset)
    du_proj, d_x_proj, d_dt_proj = _projections_vjp(u, x_dbl, x_proj_kernel, dt_proj_kernel, d_delta, dB, dC)
    # The new state is x's last K-1 rows (T >= K-1 on this path): the kernel adds its cotangent to dx.
    keep = new_state_keep(reset, k_size)
    d_new = d_new_conv if keep is None else jnp.where(keep, d_new_conv, 0.0)
    d_src, d_conv_state, d_conv_kernel, d_conv_bias = conv.conv_silu_backward(
        src, conv_state, conv_kernel, conv_bias, reset, du, du_proj, dz if packed else None, d_new,
        config=conv_config, interpret=interpret)
    return (d_src, None if packed else dz, d_conv_kernel.astype(conv_kernel.dtype),
            None if conv_bias is None else d_conv_bias.astype(conv_bias.dtype),
            d_x_proj, d_dt_proj, d_dt_bias, dA, dD, d_conv_state.astype(conv_state.dtype), d_ssm, None)


_core_conv_kernel.defvjp(_core_conv_kernel_fwd, _core_conv_kernel_bwd)


# ------------------------------------------------------------- the XLA conv path (windows < K-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(static, x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state,
          ssm_state, reset):
    out, _ = _core_fwd(static, x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                       conv_state, ssm_state, reset)
    return out


def _core_fwd(static, x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state,
              ssm_state, reset):
    config, interpret = static
    u, delta, Bm, Cm, new_conv = scan_operands(x, conv_state, conv_kernel, conv_bias, x_proj_kernel,
                                               dt_proj_kernel, reset)
    y, h_last, scan_residuals = _kernels().selective_scan_forward(
        u, delta, A, Bm, Cm, D, z, dt_bias, ssm_state, reset, delta_softplus=True, config=config,
        interpret=interpret)
    residuals = (x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state,
                 ssm_state, reset, scan_residuals)
    return (y, new_conv, h_last), residuals


def _core_bwd(static, residuals, cotangents):
    config, interpret = static
    (x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D, conv_state, ssm_state, reset,
     scan_residuals) = residuals
    d_y, d_new_conv, d_h_last = cotangents

    def operands(x, conv_state, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel):
        return scan_operands(x, conv_state, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, reset)

    (u, delta, Bm, Cm, _), operands_vjp = jax.vjp(operands, x, conv_state, conv_kernel, conv_bias,
                                                  x_proj_kernel, dt_proj_kernel)
    du, d_delta, dA, dB, dC, dD, dz, d_dt_bias, d_ssm = _kernels().selective_scan_backward(
        u, delta, A, Bm, Cm, D, z, dt_bias, ssm_state, reset, scan_residuals, d_y, d_h_last,
        delta_softplus=True, config=config, interpret=interpret)
    dx, d_conv_state, d_conv_kernel, d_conv_bias, d_x_proj, d_dt_proj = operands_vjp(
        (du, d_delta, dB, dC, d_new_conv))
    return (dx, dz, d_conv_kernel, d_conv_bias, d_x_proj, d_dt_proj, d_dt_bias, dA, dD, d_conv_state, d_ssm,
            None)


_core.defvjp(_core_fwd, _core_bwd)


def implementation():
    """The dispatch entry (registered lazily by api.py, so Pallas is imported on first use only)."""
    from jmamba.ops import dispatch

    return dispatch.Implementation(mamba1_mixer_core_pallas, supported)
