"""The "pallas" implementation of `mamba1_mixer_core`: one `custom_vjp` around the per-position
preprocessing and the Pallas selective-scan kernels.

Forward: `scan_operands` (conv + SiLU, x_proj, dt_proj; XLA fusions and two matmuls), then the scan's
forward kernels (`pallas_kernels.selective_scan.selective_scan_forward`).
Saved for the backward: the op's inputs (x, z, weights, states, reset) and the scan's chunk-start
states and δ sums ([Bt, T/chunk, ...], nothing per position). The conv output, u, delta, B and C are
**not** saved: the backward recomputes them from x (one conv fusion and two small matmuls), which is
what keeps a layer's activation memory near the official fused path's (x, z and the out_proj input).
Backward: the recomputation, the scan's backward kernels (`selective_scan_backward`) from the saved
chunk states, then the transpose of the preprocessing (XLA, fixed-order reductions: deterministic).

Numerics: identical to the "xla"/"reference" composition's formulas. The backward recomputes u and
delta with the same operations as the forward (bit-identical on CPU, where it is tested; on the GPU
XLA compiles the recomputation inside the backward's program, which is expected but not tested to
round identically), and the scan's backward reads them beside the forward's saved chunk states.
"""

from __future__ import annotations

import functools

import jax

from jmamba.ops.mamba1_mixer.common import scan_operands
from jmamba.ops.pallas_platform import interpret_mode
from jmamba.ops.selective_scan import pallas as scan_pallas


def supported(*, platform, x, A, **call):
    """None when the Pallas kernels can run this call (those of the selective scan), else why not."""
    return scan_pallas.supported(platform=platform, u=x, A=A, B=None, **call)


def mamba1_mixer_core_pallas(x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                             conv_state, ssm_state, reset, *, tuning=None):
    """The op's implementation signature (api.py); `tuning.pallas_config`: a ScanBlockConfig or None."""
    static = (tuning and tuning.pallas_config, interpret_mode())
    return _core(static, x, z, conv_kernel, conv_bias, x_proj_kernel, dt_proj_kernel, dt_bias, A, D,
                 conv_state, ssm_state, reset)


def _kernels():
    from pallas_kernels import selective_scan as kernels
    return kernels


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
