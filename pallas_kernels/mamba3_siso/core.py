"""The chunked Mamba-3 SISO core behind one `jax.custom_vjp`: three kernels forward, three to five backward
(the default; config.state_passes "split" adds one to each).

What the core computes (everything around it, elementwise or small, is plain JAX in scan.py and
differentiated by JAX): for the padded operands in the kernel layout of config.py,

    out, S_final = core(Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, S_0, D)

  forward   queries_keys.head_queries_keys_kernel -> per-head q, k̃ in the dot operand dtype and
                                                     ⟨q̄, k̄⟩ (for dγ and the scale's share); the chunk
                                                     kernels weight the scores' diagonal by γ/s (default,
                                                     skip_in_scores) or skip = D + γ⟨q̄, k̄⟩ is one
                                                     elementwise XLA op (1 kernel)
            state_passes.forward_state_pass   -> states entering every chunk, S_final  (1 kernel; 2 split)
            chunk_forward.chunk_outputs       -> out                                   (1 kernel)
  backward  state_passes.adjoint_state_pass   -> adjoints leaving every chunk, dS_0    (1 kernel; 2 split)
            chunk_backward.chunk_gradients    -> dV, dZ, dADT, dskip (the values launch) and, unless
                                                 head_gradients runs, dq, dk̃ (1-3 launches; default 2: keys+queries, then values)
            qk_gradients.query_key_gradients  -> dQ, dK, bias, scale and angle gradients from dq, dk̃,
                                                 with skip_in_scores=False the skip term's ⟨q̄, k̄⟩
                                                 gradient included (1 kernel)
            or, with config.rotate_in_chunk_gradients (head_gradients.fuses_rotation),
            head_gradients.head_query_key_gradients -> dq, dk̃ per chunk and head rotated back in the
                                                 launches that form them (1 or 2 kernels; XLA sums
                                                 the heads and the bias gradients)
  Partial sums (bias gradients over chunks, dQ and dK over slices of a group's heads) are reduced by
  XLA in a fixed order: deterministic, no atomics.

`chunked_core_with_angles` (config.angle_gradient_pass) is the same core with the chunk-entry angles
formed inside it and one more backward kernel (entry_angles.angle_gradients) finishing the angles' and
DT's gradients.

Residuals: the inputs (Q, K as the forward query/key kernel's position-major copies, [Bt, G, Np, Tp], with
config.qk_columns_from_forward), the per-head q, k̃ (dot operand dtype, [Bt, Tp, H, Np]), ⟨q̄, k̄⟩ ([Bt, Tp, H]
float32), the wrapped angle
at every position θ ([Bt, Tp, H, Sp] float32, or [Bt, H, Sp, Tp] position-major for the position-major
gradient kernel with stored_theta / angle_gradient_pass; none when that kernel forms θ again) and the
states entering every chunk
([Bt, H, nc, Pp, Np]), and when the config asks (stored_scores, stored_ungated) the chunks' masked
scores and the ungated output, written by the forward's chunk-output kernel for the values gradient
launch; the backward never calls the forward kernels' VJP.

Zeros: both custom VJPs take symbolic zeros. An absent initial state (s0 None) is neither read nor
differentiated, and a final state whose cotangent is a symbolic zero (unused by the loss, as in a
training step without carried state) gives the adjoint walk no boundary operand: no zero
[Bt, H, Pp, Np] arrays are formed, read or written for them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from pallas_kernels.common.dtypes import F32
from pallas_kernels.mamba3_siso import chunk_backward, chunk_forward, state_passes
from pallas_kernels.mamba3_siso.chunk_math import angle_rate
from pallas_kernels.mamba3_siso.config import ScanGeometry
from pallas_kernels.mamba3_siso.entry_angles import (angle_gradients, chunk_entry_angles, entry_angle_prefix,
                                                     later_chunk_sums, wrapped_chunk_sums)
from pallas_kernels.mamba3_siso.head_gradients import fuses_rotation, head_query_key_gradients
from pallas_kernels.mamba3_siso.qk_gradients import query_key_gradients
from pallas_kernels.mamba3_siso.qk_gradients_transposed import recomputes_theta
from pallas_kernels.mamba3_siso.queries_keys import head_queries_keys_kernel


def kernel_operands(q, k, v, z, adt, skip, s0=None, d_out=None, diag_weight=None):
    """The dict of arrays the kernels read (diag_weight None: absent)."""
    return dict(q=q, k=k, v=v, z=z, adt=adt, skip=skip, s0=s0, d_out=d_out, diag_weight=diag_weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_core(geo: ScanGeometry, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, s0, D):
    """The chunked scan on kernel layouts (config.py, layout.py).

    Args:
      geo: the static ScanGeometry.
      Q, K: [Bt, Tp, G, Np] in the activation dtype; Q_bias, K_bias: [H, Np] float32.
      scale: [Bt, Tp, H] float32 s = γ + σ̂; dt: [Bt, Tp, H] float32 DT;
      angles: [Bt, Tp, 1 or H, Sp] float32 the op's raw angles (the increment of head h is
        π·tanh(angles)·DT_h, formed inside the query/key kernels) and
        theta_entry: [Bt, nc, H, Sp] float32 wrapped angle entering each chunk, or both None (no angles).
      v: [Bt, Tp, H, Pp]; z: [Bt, Tp, H, Pp] or None.
      adt, gamma: [Bt, Tp, H] float32 (ADT; γ = λ·DT, the weight of ⟨q̄, k̄⟩ in skip = D + γ⟨q̄, k̄⟩).
      s0: [Bt, H, Pp, Np] float32, the augmented initial state, or None for a zero one (nothing read, and
        no cotangent formed: the adjoint walk then writes no ∂L/∂S_0; its cotangent is None).
      D: [H] float32 skip weight (zeros for none).

    Returns:
      (out [Bt, Tp, H, Pp] in v.dtype, final state [Bt, H, Pp, Np] float32).
    """
    out, final, _ = _forward(geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, s0, D)
    return out, final


def skip_term(D, gamma, diagonal):
    """skip = D + γ⟨q̄, k̄⟩ [Bt, Tp, H] float32 (D [H], γ and ⟨q̄, k̄⟩ [Bt, Tp, H])."""
    return D.astype(F32) + gamma * diagonal


def diagonal_weight(gamma, scale):
    """w = γ/s [Bt, Tp, H] float32 (0 where s = 0: the time padding), in (0, 1] since s = γ + σ̂ >= γ > 0:
    with config.skip_in_scores the chunk kernels' masked decay matrix carries w on its diagonal, so the
    scores' diagonal ⟨q_i, k̃_i⟩ = s_i⟨q̄_i, k̄_i⟩ gives the skip term's γ⟨q̄, k̄⟩ in the forward's dot and
    its q, k̃ gradients through (A ⊙ Λ) in the backward."""
    positive = scale > 0
    return jnp.where(positive, gamma / jnp.where(positive, scale, 1.0), 0.0)


def skip_operands(geo, D, gamma, scale, diagonal):
    """(skip, diagonal weight or None): D + γ⟨q̄, k̄⟩ [Bt, Tp, H] as a per-position weight of V, or, with
    config.skip_in_scores, D alone as one weight per head ([H, 1]: the chunk kernels load their head's)
    and γ/s on the scores' diagonal."""
    if geo.config.skip_in_scores:
        return D.astype(F32).reshape(-1, 1), diagonal_weight(gamma, scale)
    return skip_term(D, gamma, diagonal), None


def _forward(geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, s0, D, *, for_backward=False):
    # θ at every position is kept for the backward unless its query/key gradient kernel forms it itself
    keep_theta = for_backward and not (recomputes_theta(geo) and not geo.config.rotate_in_chunk_gradients)
    keep_columns = for_backward and geo.qk_columns_from_forward
    q, k, theta, diagonal, Q_cols, K_cols = head_queries_keys_kernel(
        geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, keep_theta=keep_theta, keep_columns=keep_columns)
    skip, weight = skip_operands(geo, D, gamma, scale, diagonal)
    ops = kernel_operands(q, k, v, z, adt, skip, s0=s0, diag_weight=weight)
    entering, final = state_passes.forward_state_pass(geo, ops)
    out, stored = chunk_forward.chunk_outputs(geo, ops, entering, for_backward=for_backward)
    return out, final, (q, k, theta, diagonal, entering, stored, Q_cols, K_cols)


def _values(args):
    """The primal values of a symbolic-zeros fwd rule's arguments (CustomVJPPrimal leaves; None kept)."""
    return tuple(a.value if isinstance(a, CustomVJPPrimal) else a for a in args)


def _instantiated(ct):
    """A cotangent as an array: zeros for a symbolic zero."""
    return jnp.zeros(ct.aval.shape, ct.aval.dtype) if isinstance(ct, SymbolicZero) else ct


def _core_fwd(geo, *args):
    return _core_fwd_values(geo, *_values(args))


def _core_fwd_values(geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, s0, D):
    if geo.angle_pass:
        raise ValueError("chunked_core: with config.angle_gradient_pass (geo.angle_pass) the core that forms the "
                         "chunk-entry angles itself, chunked_core_with_angles, must be used")
    return _core_forward(geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, s0, D)


def _core_forward(geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, s0, D):
    out, final, (q, k, theta, diagonal, entering, stored, Q_cols, K_cols) = _forward(
        geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, s0, D, for_backward=True)
    if Q_cols is not None:      # the backward reads Q, K only position-major (config.qk_columns_from_forward)
        Q, K = Q_cols, K_cols
    # a zero-size marker: whether an initial state was given (None is kept by the residuals' pytree)
    has_initial = None if s0 is None else jnp.zeros((0,), F32)
    return (out, final), (Q, K, Q_bias, K_bias, scale, angles, dt, theta, theta_entry if theta is None else None,
                          q, k, v, z, adt, gamma, D, diagonal, entering, stored, has_initial)


def _core_bwd(geo, residuals, cotangents):
    (Q, K, Q_bias, K_bias, scale, angles, dt, theta, theta_entry, q, k, v, z, adt, gamma, D, diagonal, entering,
     stored, has_initial) = residuals
    d_out, d_final = cotangents
    d_out = _instantiated(d_out)
    # the final state unused (a symbolic zero cotangent): the adjoint walk starts from zeros, no operand
    d_final = None if isinstance(d_final, SymbolicZero) else d_final.astype(F32)
    skip, weight = skip_operands(geo, D, gamma, scale, diagonal)
    ops = dict(kernel_operands(q, k, v, z, adt, skip, d_out=d_out.astype(v.dtype), diag_weight=weight), **stored)
    leaving, d_initial = state_passes.adjoint_state_pass(geo, ops, d_final, want_initial=has_initial is not None)
    if fuses_rotation(geo, ops):
        g = chunk_backward.chunk_gradients(geo, ops, entering, leaving, values_only=True)
        dQ, dK, dQ_bias, dK_bias, d_scale, d_angles, d_dt, d_entry = head_query_key_gradients(
            geo, ops, entering, leaving, Q, K, Q_bias, K_bias, scale, gamma, angles, dt, theta)
    else:
        g = chunk_backward.chunk_gradients(geo, ops, entering, leaving)
        dQ, dK, dQ_bias, dK_bias, d_scale, d_angles, d_dt, d_entry = query_key_gradients(
            geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta, g["dq"], g["dk"],
            d_diagonal=None if weight is not None else g["d_skip"] * gamma, theta_entry=theta_entry,
            qk_position_major=geo.qk_columns_from_forward)
    d_skip = g["d_skip"]      # ⟨dY_i, v_i⟩: the gradient of skip, and of γ⟨q̄, k̄⟩ per unit of it
    if weight is not None:
        # the term is w·⟨q_i, k̃_i⟩ with w = γ/s: dw = d skip·s⟨q̄, k̄⟩, so dγ = dw/s = d skip·⟨q̄, k̄⟩ (as
        # below) and ds gets dw·(−γ/s²) = −d skip·⟨q̄, k̄⟩·w besides its share through k̃
        d_scale = d_scale - d_skip * diagonal * weight
    d_D = jnp.sum(d_skip, axis=(0, 1))
    return (dQ.astype(Q.dtype), dK.astype(K.dtype), dQ_bias, dK_bias, d_scale, d_angles, d_dt, d_entry, g["dv"],
            g.get("dz"), g["d_adt"], d_skip * diagonal, d_initial, d_D)


chunked_core.defvjp(_core_fwd, _core_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_core_with_angles(geo: ScanGeometry, Q, K, Q_bias, K_bias, scale, angles, dt, angle0, v, z, adt, gamma,
                             s0, D):
    """`chunked_core` that forms the chunk-entry angles itself (config.angle_gradient_pass, geo.angle_pass):
    angle0 [Bt, H, Sp] float32, the angle entering the window, replaces theta_entry, and a third output
    θ_final [Bt, H, Sp] is returned. Why inside one custom VJP: the backward then knows the later
    chunks' sums of dθ when it finishes the angle gradients, so one small kernel
    (entry_angles.angle_gradients) writes d angles and d DT, with no XLA pass over the per-head angles
    to add them (other arguments and outputs as chunked_core)."""
    theta_entry, theta_final = _entry_angles(geo, angles, dt, angle0)
    out, final, _ = _forward(geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt, gamma, s0, D)
    return out, final, theta_final


def _entry_angles(geo, angles, dt, angle0):
    """(θ_entry [Bt, nc, H, Sp], θ_final [Bt, H, Sp]): XLA's chunk sums, then the prefix over the chunks
    by XLA (chunk_entry_angles) or with config.entry_prefix_kernel one small launch (entry_angle_prefix)."""
    if geo.config.entry_prefix_kernel:
        return entry_angle_prefix(geo, wrapped_chunk_sums(geo, angle_rate(angles), dt), angle0)
    return chunk_entry_angles(geo, angle_rate(angles), dt, angle0)


def _with_angles_fwd(geo, *args):
    return _with_angles_fwd_values(geo, *_values(args))


def _with_angles_fwd_values(geo, Q, K, Q_bias, K_bias, scale, angles, dt, angle0, v, z, adt, gamma, s0, D):
    if not geo.angle_pass:
        raise ValueError("chunked_core_with_angles runs only where config.angle_gradient_pass applies (geo.angle_pass)")
    theta_entry, theta_final = _entry_angles(geo, angles, dt, angle0)
    (out, final), residuals = _core_forward(geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, v, z, adt,
                                            gamma, s0, D)
    return (out, final, theta_final), residuals


def _with_angles_bwd(geo, residuals, cotangents):
    d_out, d_final, d_theta_final = cotangents
    grads = list(_core_bwd(geo, residuals, (d_out, d_final)))
    d_theta_final = _instantiated(d_theta_final)
    angles, dt = residuals[5], residuals[6]
    d_inc, d_entry = grads[5], grads[7]          # the in-chunk sums of dθ (position-major), Σ dθ per chunk
    later, d_angle0 = later_chunk_sums(d_entry, d_theta_final.astype(F32))
    grads[5], grads[6] = angle_gradients(geo, d_inc, later, angles, dt)
    grads[7] = d_angle0
    return tuple(grads)


chunked_core_with_angles.defvjp(_with_angles_fwd, _with_angles_bwd, symbolic_zeros=True)
