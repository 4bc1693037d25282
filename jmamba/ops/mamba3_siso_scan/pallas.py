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

import jax.numpy as jnp

from jmamba.core.validation import shape_of
from jmamba.ops.mamba3_siso_scan.common import (
    Mamba3ScanState, Mamba3ScanTuning, entering_ssm, expand_groups, rotate_pairs,
    trapezoid_weights)
from jmamba.ops.pallas_platform import interpret_mode, triton_platform_reason

# Beyond these the per-program tiles ([chunk, d_state] queries/keys and their gradients, [headdim,
# d_state] states) no longer fit in registers; the kernels are tuned and tested for N=128, P=64.
MAX_D_STATE = 256
MAX_HEADDIM = 128
F32 = jnp.float32


def supported(*, platform, Q, V, Angles, initial_state=None, reset=None, tuning=None, **_):
    """None when the Pallas kernels can run this call on `platform`, else the reason in words."""
    reason = triton_platform_reason(platform, "the Pallas Mamba-3 SISO kernels")
    if reason:
        return reason
    arrays = [Q, V, Angles] + ([] if initial_state is None else list(initial_state))
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
    del tuning  # any positive chunk_size is rounded to a power of two in [16, 128]
    return None


def mamba3_siso_scan_pallas(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, z, initial_state, reset, *,
                            tuning=None):
    """The op's implementation contract (see api.py) around the kernels' `chunked_scan`.

    The per-position work is done here in float32 with the helpers the XLA implementation uses
    (common.py), and differentiated by JAX: the trapezoid weights (s = γ + σ̂; the skip term
    D + γ⟨q̄, k̄⟩ is formed in the kernels' core, ⟨q̄, k̄⟩ by the query/key kernel), the entering state with the
    β_0 term folded in, and the final key R(θ_{T-1})(K_{T-1} + K_bias). The raw Angles go to the
    kernels, which form the increments π·tanh(Angles)·DT themselves.
    `tuning`: a `Mamba3ScanTuning` (its chunk_size and pallas_config, a Mamba3ScanConfig or None).
    """
    from pallas_kernels.mamba3_siso import chunked_scan

    if reset is not None:
        raise NotImplementedError("reset: the Pallas Mamba-3 SISO kernels do not support reset masks")
    tuning = tuning or Mamba3ScanTuning()
    bsz, T, H, P = V.shape
    N = Q.shape[-1]
    S = Angles.shape[-1]
    gamma, prev_weight, scale = trapezoid_weights(DT, Trap, F32)
    if initial_state is None:
        angle0, s0 = jnp.zeros((bsz, H, S), F32), jnp.zeros((bsz, H, P, N), F32)
    else:
        state = Mamba3ScanState(*(x.astype(F32) for x in initial_state))
        angle0, s0 = state.angle, entering_ssm(state, prev_weight[:, 0])
    angles = Angles.astype(F32) if S else None     # [Bt, T, 1 or H, S] raw: π·tanh(angles)·DT inside the kernels
    out, ssm, theta = chunked_scan(Q, K, V, Q_bias, K_bias, scale, gamma, D, ADT, angles, DT.astype(F32), angle0, s0, z,
                                   chunk_size=tuning.chunk_size, config=tuning.pallas_config,
                                   interpret=interpret_mode())
    k_last = expand_groups(K[:, T - 1].astype(F32), H) + K_bias.astype(F32)            # [Bt, H, N]
    return out, Mamba3ScanState(theta, ssm, rotate_pairs(k_last, theta), V[:, T - 1].astype(F32))


def implementation():
    """The dispatch entry (registered lazily by api.py, so Pallas is imported on first use only)."""
    from jmamba.ops import dispatch

    return dispatch.Implementation(mamba3_siso_scan_pallas, supported)
