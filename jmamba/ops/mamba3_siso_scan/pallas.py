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
from jmamba.ops.norms.reference import rms_norm
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
                            tuning=None, qk_norm=None):
    """The op's implementation contract (see api.py) around the kernels' `chunked_scan`.

    The per-position work is done here in float32 with the helpers the XLA implementation uses
    (common.py), and differentiated by JAX: the trapezoid weights (s = γ + σ̂; the skip term
    D + γ⟨q̄, k̄⟩ is formed in the kernels' core, ⟨q̄, k̄⟩ by the query/key kernel), the entering state with the
    β_0 term folded in, and the final key R(θ_{T-1})(K_{T-1} + K_bias). The raw Angles go to the
    kernels, which form the increments π·tanh(Angles)·DT themselves.
    `tuning`: a `Mamba3ScanTuning` (its chunk_size and pallas_config, a Mamba3ScanConfig or None).
    `qk_norm`: None, or a `Mamba3QKNorm` when Q, K are raw (api.py): the kernels' layout step normalizes
    them (pallas_kernels/mamba3_siso/qk_norm.py) where it can (S = 0 or a power of two >= 8) and
    Mamba3ScanConfig.fuse_qk_norm is on, else `rms_norm` here.
    """
    from pallas_kernels.mamba3_siso import chunked_scan
    from pallas_kernels.mamba3_siso.qk_norm import fuses_num_angles

    if reset is not None:
        raise NotImplementedError("reset: the Pallas Mamba-3 SISO kernels do not support reset masks")
    tuning = tuning or Mamba3ScanTuning()
    bsz, T, H, P = V.shape
    N = Q.shape[-1]
    S = Angles.shape[-1]
    fused_norm = None
    if qk_norm is not None:
        from pallas_kernels.mamba3_siso import DEFAULT_CONFIG
        if (tuning.pallas_config or DEFAULT_CONFIG).fuse_qk_norm and fuses_num_angles(S):
            fused_norm = (qk_norm.Q_weight, qk_norm.K_weight, qk_norm.eps)
        else:
            Q = rms_norm(Q, qk_norm.Q_weight, qk_norm.eps, Q.dtype)
            K = rms_norm(K, qk_norm.K_weight, qk_norm.eps, K.dtype)
    gamma, prev_weight, scale = trapezoid_weights(DT, Trap, F32)
    if initial_state is None:
        angle0, s0 = jnp.zeros((bsz, H, S), F32), None      # a zero state: the kernels read none
    else:
        state = Mamba3ScanState(*(x.astype(F32) for x in initial_state))
        angle0, s0 = state.angle, entering_ssm(state, prev_weight[:, 0])
    angles = Angles.astype(F32) if S else None     # [Bt, T, 1 or H, S] raw: π·tanh(angles)·DT inside the kernels
    out, ssm, theta, *normalized = chunked_scan(
        Q, K, V, Q_bias, K_bias, scale, gamma, D, ADT, angles, DT.astype(F32), angle0, s0, z,
        chunk_size=tuning.chunk_size, config=tuning.pallas_config, interpret=interpret_mode(), qk_norm=fused_norm)
    # the last key as the kernels used it (normalized by them with qk_norm)
    K_last = normalized[0] if normalized else K[:, T - 1].astype(F32)                    # [Bt, G, N]
    k_last = expand_groups(K_last, H) + K_bias.astype(F32)                              # [Bt, H, N]
    return out, Mamba3ScanState(theta, ssm, rotate_pairs(k_last, theta), V[:, T - 1].astype(F32))


def mamba3_siso_scan_projected_pallas(rest, V, z, initial_state, dt_bias, B_norm_weight, C_norm_weight, B_bias,
                                      C_bias, D, *, groups, A_floor, eps, tuning):
    """`mamba3_siso_scan_projected`'s fused path (projected.py): the scan from in_proj's rest block with
    the per-position work in pallas_kernels/mamba3_siso/projection.py's two kernels. Returns (out, final
    Mamba3ScanState) like the op's implementations."""
    from jmamba.ops.mamba3_siso_scan.per_position import per_head_for
    from pallas_kernels.mamba3_siso.scan import projected_scan

    bsz, T, H, P = V.shape
    N = B_norm_weight.shape[0]
    S = rest.shape[-1] - 2 * groups * N - 3 * H
    state = None if initial_state is None else tuple(x.astype(F32) for x in initial_state)
    out, ssm, theta, k_last = projected_scan(
        rest, V, dt_bias, B_norm_weight, C_norm_weight, C_bias, B_bias, D, state, z, groups=groups, d_state=N,
        num_angles=S, eps=eps, per_head=per_head_for(A_floor), chunk_size=tuning.chunk_size,
        config=tuning.pallas_config, interpret=interpret_mode())
    k_last = expand_groups(k_last, H) + B_bias.astype(F32)                               # [Bt, H, N]
    v_last = V[:, T - 1].astype(F32)
    return out, Mamba3ScanState(theta, ssm, rotate_pairs(k_last, theta), v_last)


def _projected_fits(*, N, S, config):
    """Whether the fused path runs: config.fuse_projection and the kernels' geometry (projection.fits_shape)."""
    from pallas_kernels.mamba3_siso import DEFAULT_CONFIG
    from pallas_kernels.mamba3_siso.projection import fits_shape

    config = config or DEFAULT_CONFIG
    return config.fuse_projection and fits_shape(N, S, config)


mamba3_siso_scan_projected_pallas.fits = _projected_fits
mamba3_siso_scan_pallas.fuses_qk_norm = True   # api.py passes `qk_norm` through (its kernels normalize)
mamba3_siso_scan_pallas.projected = mamba3_siso_scan_projected_pallas   # projected.py's fused path


def implementation():
    """The dispatch entry (registered lazily by api.py, so Pallas is imported on first use only)."""
    from jmamba.ops import dispatch

    return dispatch.Implementation(mamba3_siso_scan_pallas, supported)
