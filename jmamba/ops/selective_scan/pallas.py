"""Glue between the `selective_scan` op and the Pallas kernels in `pallas_kernels/selective_scan`.

`supported(...)` says in words what the kernel cannot handle (dispatch then falls back to "xla" with
one warning, or raises when "pallas" was asked for explicitly); `selective_scan_pallas` runs the
kernels: compiled through Triton on a CUDA GPU, in the Pallas interpreter on CPU (slow: for tests).

Numerics are the kernels' (see pallas_kernels/selective_scan/scan.py): float32 state, δ and
accumulation whatever the input dtype, `out` rounded once to u.dtype, final state float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.core.validation import shape_of
from jmamba.ops.pallas_platform import interpret_mode, triton_platform_reason

# The state of a program is an [n, block_d] float32 tile kept in registers; beyond this it spills.
MAX_STATE_SIZE = 64


def supported(*, platform, u, A, B, initial_state=None, reset=None, tuning=None, **_):
    """None when the Pallas kernel can run this call on `platform`, else the reason in words."""
    reason = triton_platform_reason(platform, "the Pallas selective-scan kernel")
    if reason:
        return reason
    if jnp.result_type(u) == jnp.float64 or jnp.result_type(A) == jnp.float64:
        return "float64 inputs are not supported by the Pallas kernel (it computes in float32); use 'reference'"
    bsz, seqlen, d = shape_of(u)
    if min(bsz, seqlen, d) == 0:
        return f"empty input (u has shape {shape_of(u)})"
    n = shape_of(A)[1]
    if n > MAX_STATE_SIZE:
        return (f"d_state n={n} > {MAX_STATE_SIZE}: the kernel keeps an [n, block_d] float32 state tile in "
                f"registers per program, which would spill")
    if n == 0:
        return "d_state n=0"
    del B, initial_state, reset, tuning  # any grouping, initial state, reset mask and config are handled
    return None


def selective_scan_pallas(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, *, delta_softplus,
                          tuning=None):
    """The op's implementation signature (see api.py); `tuning.pallas_config`: a ScanBlockConfig or None."""
    from pallas_kernels.selective_scan import selective_scan_pallas as kernel_scan

    interpret = interpret_mode()
    return kernel_scan(u, delta, A, B, C, D, z, delta_bias, initial_state, reset,
                       delta_softplus=delta_softplus, config=tuning and tuning.pallas_config,
                       interpret=interpret)


def implementation():
    """The dispatch entry (registered lazily by api.py, so Pallas is imported on first use only)."""
    from jmamba.ops import dispatch

    return dispatch.Implementation(selective_scan_pallas, supported)
