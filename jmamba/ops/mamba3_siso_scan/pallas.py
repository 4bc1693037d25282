"""Glue between the `mamba3_siso_scan` op and the Pallas kernels in `pallas_kernels/mamba3_siso`.

`supported(...)` says in words what the kernels cannot handle (dispatch then falls back to "xla" with
one warning, or raises when "pallas" was asked for explicitly); `mamba3_siso_scan_pallas` runs them:
compiled through Triton on a CUDA GPU, in the Pallas interpreter on CPU (slow: for tests).

Numerics are the kernels' (see pallas_kernels/mamba3_siso/scan.py and the kernel modules): float32
running state, decays, rotation and accumulation whatever the input dtype; dot operands in bf16/f16
when Q, K and V are that dtype (tensor cores, as the official kernel), exact float32 otherwise; the
per-chunk boundary states kept for the chunk kernels stored in that same operand dtype (they are only
read as dot operands, and by ⟨S, dS⟩ in dADT); `out` rounded once to V.dtype; final states float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.ops.mamba3_siso_scan.common import Mamba3ScanStates
from jmamba.ops.pallas_platform import interpret_mode, triton_platform_reason
from jmamba.ops.validation import shape_of

# Beyond these the per-program tiles ([chunk, d_state] queries/keys and their gradients, [headdim,
# d_state] states) no longer fit in registers; the kernels are tuned and tested for N=128, P=64.
MAX_D_STATE = 256
MAX_HEADDIM = 128


def supported(*, platform, Q, V, Angles, initial_states=None, reset=None, chunk_size=64, **_):
    """None when the Pallas kernels can run this call on `platform`, else the reason in words."""
    reason = triton_platform_reason(platform, "the Pallas Mamba-3 SISO kernels")
    if reason:
        return reason
    arrays = [Q, V, Angles] + ([] if initial_states is None else list(initial_states))
    if any(jnp.result_type(x) == jnp.float64 for x in arrays):
        return "float64 inputs are not supported by the Pallas kernels (they compute in float32); use 'reference'"
    if reset is not None:
        return ("reset masks are not supported by the Pallas kernels (the chunked kernels carry one segment "
                "per row); 'xla' handles them")
    bsz, T, H, P = shape_of(V)
    N = shape_of(Q)[-1]
    if min(bsz, T, H, P, N) == 0:
        return f"empty input (V has shape {shape_of(V)}, Q has shape {shape_of(Q)})"
    if N > MAX_D_STATE:
        return (f"d_state N={N} > {MAX_D_STATE}: the kernels hold [chunk, N] query/key tiles and [headdim, N] "
                f"state tiles in registers, which would spill")
    if P > MAX_HEADDIM:
        return (f"headdim P={P} > {MAX_HEADDIM}: the kernels hold [chunk, P] and [P, N] tiles in registers, "
                f"which would spill")
    del chunk_size  # any positive chunk_size is rounded to a power of two in [16, 128]
    return None


def mamba3_siso_scan_pallas(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states, reset, *,
                            chunk_size, config=None):
    """The op's implementation signature (see api.py); `config`: a Mamba3ScanConfig or None."""
    from pallas_kernels.mamba3_siso import mamba3_siso_scan_pallas as kernel_scan

    interpret = interpret_mode()
    out, final = kernel_scan(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states, reset,
                             chunk_size=chunk_size, config=config, interpret=interpret)
    return out, Mamba3ScanStates(*final)


def implementation():
    """The dispatch entry (registered lazily by api.py, so Pallas is imported on first use only)."""
    from jmamba.ops import dispatch

    return dispatch.Implementation(mamba3_siso_scan_pallas, supported)
