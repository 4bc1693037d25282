"""The Pallas Mamba-3 SISO scan on prepared operands: layout, chunk-entry angles, the chunked core.

`chunked_scan(Q, K, V, Q_bias, K_bias, scale, gamma, D, ADT, angles, dt, angle0, s0, Z, *, chunk_size)`
-> (out [Bt, T, H, P] in V.dtype, ssm_final [Bt, H, P, N] float32, θ_final [Bt, H, S] float32),
differentiable w.r.t. every array argument. The per-position preprocessing that turns the op's
arguments into these operands (the trapezoid weights, the skip term, the entering state) is shared with the XLA implementation and lives with the op
(jmamba/ops/mamba3_siso_scan/pallas.py and common.py), so JAX differentiates it; only the chunked
core (core.py: one custom_vjp around three kernels forward and three to five backward by default, one more
each with state_passes "split", the query/key
kernels of queries_keys.py and qk_gradients.py included) is hand-differentiated (docs/mamba3_siso.md §4).

  operands       s = γ + σ̂ [Bt, T, H] (key scale), γ [Bt, T, H] and D [H] (the skip term
                 D + γ⟨q̄, k̄⟩ is formed inside the core, ⟨q̄, k̄⟩ by the query/key kernel; by default
                 γ⟨q̄, k̄⟩ enters as the chunk kernels' scores' diagonal, config.skip_in_scores),
                 the raw Angles [Bt, T, 1 or H, S] (None when S = 0) and DT [Bt, T, H]: the
                 per-head angle increment inc = π·tanh(Angles)·DT is formed inside the kernels
                 (neither it nor the rate π·tanh(Angles) is ever a [Bt, T, H, S] array in HBM;
                 the chunk sums below fuse the tanh into their reduction), θ_{-1} [Bt, H, S],
                 S_0 = h_{-1} + DT_0(1 − λ_0)·v_{-1}k_{-1}ᵀ [Bt, H, P, N] (the β_0 term folded in)
  per chunk      the angle entering each chunk: a triangular matmul over the wrapped chunk sums of
                 inc, wrapped again (chunk_entry_angles); the query/key kernels form the angle at
                 every position, θ_t = (θ_entry + Σ_{r <= t in the chunk} inc_r) mod 2π

Layout work done here (layout.py, config.py): T padded to a multiple of the chunk (ADT = 0 and
s = γ = DT = 0 there: identity steps with zero input, so the final state is exact), headdim
padded to Pp, and d_state of Q, K, the biases and the state permuted into the kernel layout
(even | odd | rest pieces, zero-padded): [.., G, N] arrays only; the per-head [.., H, Np] operands
are formed in that layout inside the core. Where that layout is a pure permutation (config.qk_op_order,
ScanGeometry.qk_op_order_fits) Q, K and the biases go in as they are, and the query/key kernels read
(and write the gradients of) the even and odd pieces as strided columns.

Numerics: float32 operands (the dot operands in bf16/f16 when Q, K and V are); see the kernel
modules. float64 inputs are not supported (the kernels compute in float32).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.common.dtypes import F32, is_sixteen_bit_float
from pallas_kernels.common.padding import pad_axis_to
from pallas_kernels.mamba3_siso.chunk_math import angle_rate
from pallas_kernels.mamba3_siso.config import Mamba3ScanConfig, ScanGeometry, make_geometry
from pallas_kernels.mamba3_siso.core import chunked_core, chunked_core_with_angles
from pallas_kernels.mamba3_siso.entry_angles import chunk_entry_angles
from pallas_kernels.mamba3_siso.qk_norm import normalized_kernel_layout
from pallas_kernels.mamba3_siso.queries_keys import from_kernel_layout, to_kernel_layout


def matmul_dtype(Q, K, V):
    """bf16 / f16 when Q, K and V all are that dtype (tensor-core dots), else float32."""
    dtypes = {jnp.dtype(x.dtype) for x in (Q, K, V)}
    if len(dtypes) == 1 and is_sixteen_bit_float(next(iter(dtypes))):
        return next(iter(dtypes))
    return jnp.dtype(F32)


def chunked_scan(Q, K, V, Q_bias, K_bias, scale, gamma, D, ADT, angles, dt, angle0, s0, Z, *, chunk_size,
                 config: Mamba3ScanConfig | None = None, interpret: bool = False, qk_norm=None):
    """Chunked Pallas Mamba-3 SISO scan on prepared operands.

    Args:
      Q, K: [Bt, T, G, N] (unrotated, before the biases); V: [Bt, T, H, P]; Q_bias, K_bias: [H, N].
      scale, gamma, ADT: [Bt, T, H] float32 (see the module docstring); D: [H] skip weight or None.
      angles: [Bt, T, 1 or H, S] the op's raw (pre-tanh) Angles (1: shared by the heads), or None when
        S = 0; dt: [Bt, T, H] float32 DT (the increment of head h is π·tanh(angles)·DT_h; unused when S = 0).
      angle0: [Bt, H, S] the entering angle; s0: [Bt, H, P, N] the entering (augmented) state, or None
        for a zero one (the kernels then read none and form no gradient for it).
      Z: [Bt, T, H, P] gate or None.
      chunk_size: requested chunk length (rounded by config.chunk_length).
      config: launch parameters (None: DEFAULT_CONFIG).
      interpret: run the kernels in the Pallas interpreter (CPU).
      qk_norm: None, or (Q_weight [N], K_weight [N], eps) when Q, K are raw: they are RMS-normalized
        over d_state into the kernel layout by qk_norm.py's kernels (S = 0 or a power of two >= 8).

    Returns:
      (out [Bt, T, H, P] in V.dtype, ssm_final [Bt, H, P, N] float32, θ_final [Bt, H, S] float32), and with
      qk_norm a fourth, K's normalized last row [Bt, G, N] float32 (as the kernels used it).
    """
    bsz, T, H, P = V.shape
    G, N = Q.shape[2:]
    S = angle0.shape[-1]
    geo = make_geometry(batch=bsz, seqlen=T, heads=H, groups=G, headdim=P, d_state=N, num_angles=S,
                        chunk_size=chunk_size, has_z=Z is not None, matmul_dtype=matmul_dtype(Q, K, V),
                        io_dtype=V.dtype, config=config, interpret=interpret,
                        shared_angles=bool(S) and angles.shape[2] == 1)
    if qk_norm is None and geo.qk_op_order_fits:     # Q, K and the biases as they are (kernel layout: qk_norm.py)
        geo = dataclasses.replace(geo, qk_op_order=True)
    theta_entry = None
    theta_final = angle0
    if S:
        dt = _pad_time(geo, dt.astype(F32))                                  # [Bt, Tp, H]
        angles = _pad_time(geo, angles.astype(F32))                          # zero padding: tanh(0) = 0
        if not geo.angle_pass:                                               # else the core forms them
            theta_entry, theta_final = chunk_entry_angles(geo, angle_rate(angles), dt, angle0)
            theta_entry = pad_axis_to(theta_entry, 3, geo.angle_width)      # [Bt, nc, H, Sp]
        angles = pad_axis_to(angles, 3, geo.angle_width)                     # [Bt, Tp, 1 or H, Sp]
    else:
        angles = dt = None
    if geo.qk_op_order:
        Qk, Kk = _pad_time(geo, Q), _pad_time(geo, K)
    elif qk_norm is None:
        Qk, Kk = to_kernel_layout(geo, _pad_time(geo, Q)), to_kernel_layout(geo, _pad_time(geo, K))
    else:
        Q_weight, K_weight, eps = qk_norm
        Qk, Kk = normalized_kernel_layout(geo, _pad_time(geo, Q), _pad_time(geo, K), Q_weight, K_weight, eps)
    core_args = (geo, Qk, Kk, Q_bias, K_bias, _pad_time(geo, scale), angles, dt, theta_entry, V, Z,
                 _pad_time(geo, ADT.astype(F32)), _pad_time(geo, gamma.astype(F32)), s0, D)
    if S and geo.angle_pass:
        out, final, theta_final = _run_core(*core_args, angle0=pad_axis_to(angle0.astype(F32), 2, geo.angle_width))
        theta_final = theta_final[..., :S]
    else:
        out, final = _run_core(*core_args)
    result = out[:, :T, :, :P], from_kernel_layout(geo, final[:, :, :P]), theta_final
    if qk_norm is not None:
        result += (from_kernel_layout(geo, Kk[:, T - 1].astype(F32)),)
    return result


def _run_core(geo: ScanGeometry, Qk, Kk, Q_bias, K_bias, scale, angles, dt, theta_entry, V, Z, adt, gamma, s0, D,
              angle0=None):
    """`chunked_core` on operands whose per-position arrays are already time-padded (Qk, Kk in the kernel
    layout, or in the op's d_state order with geo.qk_op_order): the biases (unless geo.qk_op_order) and s0
    laid out (None: a zero initial state), V, Z padded (time, headdim), D zeros when None. Returns (out
    [Bt, Tp, H, Pp], final state [Bt, H, Pp, Np]) as the core does; with angle0 ([Bt, H, Sp], theta_entry
    None) `chunked_core_with_angles`, and θ_final [Bt, H, Sp] third."""
    H = V.shape[2]
    core, entry = (chunked_core, theta_entry) if angle0 is None else (chunked_core_with_angles, angle0)
    bias = (lambda b: b.astype(F32)) if geo.qk_op_order else (lambda b: to_kernel_layout(geo, b.astype(F32)))
    return core(
        geo, Qk, Kk, bias(Q_bias), bias(K_bias),
        scale, angles, dt, entry,
        _pad_headdim(geo, _pad_time(geo, V)), None if Z is None else _pad_headdim(geo, _pad_time(geo, Z)),
        adt, gamma,      # zero time padding: ADT = 0 is the identity decay
        None if s0 is None else _pad_headdim(geo, to_kernel_layout(geo, s0), axis=2),
        jnp.zeros((H,), F32) if D is None else D.astype(F32))


def _pad_time(geo: ScanGeometry, x):
    """[Bt, T, ...] -> [Bt, Tp, ...], zero-padded (T up to whole chunks)."""
    return pad_axis_to(x, 1, geo.padded_seqlen)


def _pad_headdim(geo: ScanGeometry, x, axis=3):
    """The headdim axis (3 of [Bt, Tp, H, P], 2 of a state [Bt, H, P, N]) zero-padded from P to Pp."""
    return pad_axis_to(x, axis, geo.padded_headdim)



def projected_scan(rest, V, dt_bias, K_weight, Q_weight, Q_bias, K_bias, D, initial_state, Z, *, groups, d_state,
                   num_angles, eps, per_head, chunk_size, config: Mamba3ScanConfig | None = None,
                   interpret: bool = False):
    """The chunked scan fed straight from in_proj's rest block (projection.py does the per-position work).

    Args:
      rest: [Bt, T, R] in_proj's columns after z and x: B, C [G·N each], dd_dt, dd_A, trap [H each], the
        raw angles [S] (shared by the heads); V: [Bt, T, H, P]; Z: [Bt, T, H, P] or None.
      dt_bias: [H]; K_weight, Q_weight: [N] the B and C norms' weights; Q_bias, K_bias: [H, N] (C_bias,
        B_bias); D: [H] or None.
      initial_state: None or (angle [Bt, H, S], ssm [Bt, H, P, N], k [Bt, H, N], v [Bt, H, P]) float32.
      groups, d_state, num_angles: G, N, S; eps: the norms' epsilon;
      per_head: (dd_dt, dd_A, trap, dt_bias) -> (ADT, DT, γ, β/α), the caller's formulas (projection.py).
      chunk_size, config, interpret: as chunked_scan.

    Returns:
      (out [Bt, T, H, P] in V.dtype, ssm_final [Bt, H, P, N], θ_final [Bt, H, S], k_last [Bt, G, N] the
      normalized B of the last position, float32 from rest's dtype).
    """
    from pallas_kernels.mamba3_siso.projection import projection

    bsz, T, H, P = V.shape
    G, N, S = groups, d_state, num_angles
    geo = make_geometry(batch=bsz, seqlen=T, heads=H, groups=G, headdim=P, d_state=N, num_angles=S,
                        chunk_size=chunk_size, has_z=Z is not None, matmul_dtype=matmul_dtype(rest, rest, V),
                        io_dtype=V.dtype, config=config, interpret=interpret, shared_angles=True)
    Kk, Qk, adt, dt, gamma, prev_weight, angles = projection(geo, _pad_time(geo, rest), dt_bias, K_weight, Q_weight,
                                                             T, float(eps), per_head)
    # s = γ + σ̂, σ̂_t = β/α at t + 1 (zero past the window: the padding rows are zeros)
    scale = gamma + jnp.concatenate([prev_weight[:, 1:], jnp.zeros_like(prev_weight[:, :1])], axis=1)
    if initial_state is None:
        angle0, s0 = jnp.zeros((bsz, H, S), F32), None      # a zero state: the walks read none
    else:
        angle0, ssm, k, v = (x.astype(F32) for x in initial_state)
        # the β_0 term of the carried (k, v) folded into the entering state
        s0 = ssm + prev_weight[:, 0, :, None, None] * v[..., :, None] * k[..., None, :]
    theta_entry, theta_final = None, angle0
    if S:
        theta_entry, theta_final = chunk_entry_angles(geo, angle_rate(angles), dt, angle0)
    out, final = _run_core(geo, Qk, Kk, Q_bias, K_bias, scale, angles, dt if S else None, theta_entry, V, Z,
                           adt, gamma, s0, D)
    k_last = from_kernel_layout(geo, Kk[:, T - 1].astype(F32))
    return out[:, :T, :, :P], from_kernel_layout(geo, final[:, :, :P]), theta_final, k_last
