"""The chunked Mamba-3 SISO core behind one `jax.custom_vjp`: two kernels forward, two backward.

What the core computes (everything around it, elementwise or small, is plain JAX in scan.py and
differentiated by JAX): for the padded, permuted operands of layout.py,

    out, S_final = core(q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, S_0)

  forward   state_passes.forward_state_pass   -> states entering every chunk, S_final
            chunk_forward.chunk_outputs       -> out
  backward  state_passes.adjoint_state_pass   -> adjoints leaving every chunk, dS_0
            chunk_backward.chunk_gradients    -> per-chunk gradients
            then XLA sums the per-head dq̄ / dk̄ over the heads of each group (→ dq, dk) and their
            per-chunk sums over (batch, chunk) (→ the bias gradients), in a fixed order
            (deterministic; no atomics).

Residuals: the inputs and the states entering every chunk ([Bt, H, nc, Pp, N] in
`config.stored_state_dtype`); the backward never calls the forward kernels' VJP.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mamba3_siso import chunk_backward, chunk_forward, state_passes
from pallas_kernels.mamba3_siso.config import ScanGeometry

F32 = jnp.float32


def _operands(geo: ScanGeometry, q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, s0=None, d_out=None):
    ops = dict(v=v, z=z, adt=adt, scale=scale, skip=skip, inc=inc, theta=theta, d_out=d_out)
    for i, name in enumerate(geo.part_names):
        ops[f"q_{name}"], ops[f"k_{name}"] = q[i], k[i]
        ops[f"qb_{name}"], ops[f"kb_{name}"] = q_bias[i], k_bias[i]
        if s0 is not None:
            ops[f"s0_{name}"] = s0[i]
    return ops


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked_core(geo: ScanGeometry, q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, s0):
    """The chunked scan on kernel layouts (layout.py).

    Args:
      geo: the static ScanGeometry.
      q, k: tuples (one per part) of [Bt, Tp, G, w] in the activation dtype.
      q_bias, k_bias: tuples of [H, w] float32.
      v: [Bt, Tp, H, Pp]; z: [Bt, Tp, H, Pp] or None.
      adt, scale, skip: [Bt, H, Tp] float32 (ADT, s = γ + σ̂, D + γ⟨q̄, k̄⟩).
      inc: [Bt, H, Tp, Sp] float32 angle increments, theta: [Bt, H, nc, Sp] float32 angle entering
        each chunk (both None when there are no angles).
      s0: tuple of [Bt, H, Pp, w] float32, the augmented initial state.

    Returns:
      (out [Bt, Tp, H, Pp] in v.dtype, tuple of [Bt, H, Pp, w] float32 final state parts).
    """
    out, final, _ = _forward(geo, q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, s0)
    return out, final


def _forward(geo, q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, s0):
    ops = _operands(geo, q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, s0)
    entering, final = state_passes.forward_state_pass(geo, ops)
    out = chunk_forward.chunk_outputs(geo, ops, entering)
    return out, tuple(final[n] for n in geo.part_names), entering


def _core_fwd(geo, q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, s0):
    out, final, entering = _forward(geo, q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, s0)
    return (out, final), (q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, entering)


def _core_bwd(geo, residuals, cotangents):
    q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, entering = residuals
    d_out, d_final = cotangents
    names = geo.part_names
    ops = _operands(geo, q, k, q_bias, k_bias, v, z, adt, scale, skip, inc, theta, d_out=d_out.astype(v.dtype))
    leaving, d_initial = state_passes.adjoint_state_pass(
        geo, ops, {n: d.astype(F32) for n, d in zip(names, d_final)})
    g = chunk_backward.chunk_gradients(geo, ops, entering, leaving)

    def group_sum(per_head, like):  # [Bt, Tp, H, w] -> [Bt, Tp, G, w]
        bsz, tp, H, w = per_head.shape
        return per_head.reshape(bsz, tp, geo.groups, H // geo.groups, w).sum(axis=3).astype(like.dtype)

    dq = tuple(group_sum(g[f"dq_{n}"], x) for n, x in zip(names, q))
    dk = tuple(group_sum(g[f"dk_{n}"], x) for n, x in zip(names, k))
    dq_bias = tuple(g[f"dqb_{n}"].sum(axis=(0, 2)) for n in names)
    dk_bias = tuple(g[f"dkb_{n}"].sum(axis=(0, 2)) for n in names)
    d_inc = d_theta = None
    if geo.has_angles:
        d_inc = g["d_inc"]
        d_theta = d_inc[:, :, ::geo.chunk]          # dθ_entry of chunk c = the in-chunk suffix sum at its start
    return (dq, dk, dq_bias, dk_bias, g["dv"], g.get("dz"), g["d_adt"], g["d_scale"], g["d_skip"], d_inc, d_theta,
            tuple(d_initial[n] for n in names))


chunked_core.defvjp(_core_fwd, _core_bwd)
