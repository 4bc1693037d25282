"""Backward chunk kernel of the Mamba-3 SISO scan: every gradient of one chunk, in one program.

Why: given the state S_c entering chunk c (forward residual) and the adjoint dS = G_{c+1} of the state
leaving it (state_passes.adjoint_state_pass), the chunks' gradients are independent. One program per
(batch row, chunk, head) recomputes the chunk's operands (rotation included) and applies spec §4.4
steps 1-3 with A_ij = ⟨dY_i, v_j⟩, Λ the strictly lower decay matrix and w = e^{cs_end − cs}:

    dZ  = dO ⊙ Y ⊙ σ(Z)(1 + Z(1 − σ(Z)))            (Y recomputed),  dY = dO ⊙ silu(Z)
    dQ  = (A ⊙ Λ)·K̃ + diag(e^{cs})·dY·S_c
    dK̃  = (A ⊙ Λ)ᵀ·Q + diag(w)·V·dS
    dV  = ((Q K̃ᵀ) ⊙ Λ)ᵀ·dY + diag(w)·K̃·dSᵀ + diag(skip)·dY
    dskip_i = ⟨dY_i, v_i⟩
    dADT_i = Σ_{i' >= i} r_{i'} + ρ     (r, ρ as in §4.4 step 2)
    dk = s·dK̃,  ds_i = ⟨dK̃_i, k_i⟩,  dq̄ = R(θ)ᵀdQ,  dk̄ = R(θ)ᵀdk,  dθ from both rotations,
    d inc_i = Σ_{i' >= i in the chunk} dθ_{i'}       (the angle entering the chunk gets d inc_0)

The glue turns these into the op's cotangents (group sums over heads, bias sums, DT/Trap/D chains).

Numerics: float32 everywhere except dot operands (`matmul_dtype`, as in the forward); dV, dZ are
rounded once to their dtype; dq̄, dk̄ (per head) and every per-position scalar gradient are float32.
HBM: one pass reading the forward's inputs, dO, and two stored states per chunk; writing dV, dZ,
the per-head dq̄, dk̄ parts (and their per-chunk sums), the angle-increment gradients and three
per-position scalars.
No atomics: every output element is written by exactly one program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_forward import chunk_inputs, query_key_names
from pallas_kernels.mamba3_siso.chunk_math import (
    F32, ChunkDecay, angle_gradient, biased_parts, chunk_rotation, dot, reverse_cumsum, rotate, rotate_back, sigmoid,
    sum_over_parts, total)
from pallas_kernels.mamba3_siso.config import ScanGeometry


def chunk_gradients(geo: ScanGeometry, ops: dict, entering: dict, leaving_adjoint: dict) -> dict:
    """Pass 2 of the backward.

    Args:
      ops: the forward's chunk operands (see chunk_forward.chunk_outputs) plus d_out [Bt, Tp, H, Pp].
      entering: {part: [Bt, H, nc, Pp, w]} states entering each chunk (forward residual).
      leaving_adjoint: {part: [Bt, H, nc, Pp, w]} adjoint of the state leaving each chunk.

    Returns:
      dict with dv [Bt, Tp, H, Pp] (V dtype), dz (Z dtype, when Z), dq_{part}, dk_{part}
      [Bt, Tp, H, w] f32 (gradients of the biased, unrotated per-head q̄, k̄), dqb_{part}, dkb_{part}
      [Bt, H, nc, w] f32 (their per-chunk sums, for the bias gradients), d_adt, d_scale, d_skip
      [Bt, H, Tp] f32, d_inc [Bt, H, Tp, Sp] f32 (when S > 0).
    """
    grid = layout.ChunkGrid(geo)
    mm = geo.matmul_dtype
    names = geo.part_names

    def body(refs):
        # Phases are ordered so that few [L, w] / [L, L] tiles are live at once (the unrotated q̄, k̄
        # and the states are re-read where needed rather than kept): the kernel is register bound.
        decay = ChunkDecay(refs["adt"][...])
        lam = decay.strictly_lower()
        rotation = chunk_rotation(refs["inc"][...], refs["theta"][...]) if geo.has_angles else None
        scale, skip = refs["scale"][...], refs["skip"][...]
        q = rotate(biased_parts(refs, "q", names), rotation)
        k_scaled = {n: x * scale[:, None] for n, x in rotate(biased_parts(refs, "k", names), rotation).items()}
        v = refs["v"][...]

        # recomputed forward: masked scores and the entering-state read Q·S_cᵀ
        scores = sum_over_parts(dot(q[n], k_scaled[n], mm, trans_b=True) for n in names) * lam
        q_state = sum_over_parts(dot(q[n], refs[f"s_{n}"][...], mm, trans_b=True) for n in names)
        d_out = refs["d_out"][...].astype(F32)
        if geo.has_z:                                                   # step 1: the gate
            y = dot(scores, v, mm) + decay.read[:, None] * q_state + skip[:, None] * v.astype(F32)
            z = refs["z"][...].astype(F32)
            sz = sigmoid(z)
            refs["dz"][...] = (d_out * y * sz * (1.0 + z * (1.0 - sz))).astype(refs["dz"].dtype)
            dy = d_out * (z * sz)
        else:
            dy = d_out

        # step 2: the scan core. A_ij = <dY_i, v_j>; M = scores ⊙ Λ ⊙ A
        attn = dot(dy, v, mm, trans_b=True)
        m = scores * attn
        r = jnp.sum(m, axis=1) - jnp.sum(m, axis=0) + decay.read * jnp.sum(dy * q_state, axis=1)
        attn_lam = attn * lam
        refs["d_skip"][...] = jnp.sum(dy * v.astype(F32), axis=1)
        dv = (dot(scores, dy, mm, trans_a=True) + skip[:, None] * dy
              + decay.to_end[:, None] * sum_over_parts(dot(k_scaled[n], refs[f"ds_{n}"][...], mm, trans_b=True)
                                                       for n in names))
        refs["dv"][...] = dv.astype(refs["dv"].dtype)

        dq, dk_scaled, to_end_terms, state_dot = {}, {}, [], []
        for n in names:
            d_state = refs[f"ds_{n}"][...]
            state = refs[f"s_{n}"][...]
            v_ds = dot(v, d_state, mm)                                  # V·dS  [L, w]
            to_end_terms.append(jnp.sum(v_ds * k_scaled[n], axis=1))
            state_dot.append(total(state.astype(F32) * d_state.astype(F32)))
            dk_scaled[n] = dot(attn_lam, q[n], mm, trans_a=True) + decay.to_end[:, None] * v_ds
            dq[n] = dot(attn_lam, k_scaled[n], mm) + decay.read[:, None] * dot(dy, state, mm)
        # d ADT: r_i − m_i summed from the right, plus ρ = e^{cs_end}<S, dS> + Σ m (spec §4.4 step 2)
        to_end = decay.to_end * sum_over_parts(to_end_terms)
        refs["d_adt"][...] = reverse_cumsum(r - to_end) + (decay.chunk * sum_over_parts(state_dot) + jnp.sum(to_end))

        # step 3: rotation, scale, angles. With g = R(θ)ᵀdK̃: ds = <g, k̄>, dk̄ = s·g, dθ_k = s·∂θ<dK̃, R k̄>
        q_bar = biased_parts(refs, "q", names)
        k_bar = biased_parts(refs, "k", names)
        g = rotate_back(dk_scaled, rotation)
        refs["d_scale"][...] = sum_over_parts(jnp.sum(g[n] * k_bar[n], axis=1) for n in names)
        dq_bar = rotate_back(dq, rotation)
        for n in names:
            dk_bar = g[n] * scale[:, None]
            refs[f"dq_{n}"][...] = dq_bar[n]
            refs[f"dk_{n}"][...] = dk_bar
            refs[f"dqb_{n}"][...] = jnp.sum(dq_bar[n], axis=0)         # this chunk's share of dQ_bias
            refs[f"dkb_{n}"][...] = jnp.sum(dk_bar, axis=0)
        if geo.has_angles:
            d_theta = (angle_gradient(dq, q_bar, rotation)
                       + scale[:, None] * angle_gradient(dk_scaled, k_bar, rotation))
            refs["d_inc"][...] = reverse_cumsum(d_theta, axis=0)

    inputs = chunk_inputs(geo, grid, ops,
                          query_key_names(geo) + ["v", "z", "d_out", "adt", "scale", "skip", "inc", "theta"])
    inputs += [(f"s_{n}", entering[n], grid.chunk_state(w)) for n, w in geo.parts]
    inputs += [(f"ds_{n}", leaving_adjoint[n], grid.chunk_state(w)) for n, w in geo.parts]

    bsz, Tp, H, Pp = geo.batch, geo.padded_seqlen, geo.heads, geo.padded_headdim
    io = jnp.dtype(geo.io_dtype)
    seq = jax.ShapeDtypeStruct((bsz, H, Tp), F32)
    outputs = [("dv", jax.ShapeDtypeStruct((bsz, Tp, H, Pp), io), grid.head_rows())]
    if geo.has_z:
        outputs.append(("dz", jax.ShapeDtypeStruct((bsz, Tp, H, Pp), jnp.dtype(ops["z"].dtype)), grid.head_rows()))
    for n, w in geo.parts:
        outputs.append((f"dq_{n}", jax.ShapeDtypeStruct((bsz, Tp, H, w), F32), grid.head_parts(w)))
        outputs.append((f"dk_{n}", jax.ShapeDtypeStruct((bsz, Tp, H, w), F32), grid.head_parts(w)))
        outputs.append((f"dqb_{n}", jax.ShapeDtypeStruct((bsz, H, geo.n_chunks, w), F32), grid.chunk_vector(w)))
        outputs.append((f"dkb_{n}", jax.ShapeDtypeStruct((bsz, H, geo.n_chunks, w), F32), grid.chunk_vector(w)))
    outputs += [("d_adt", seq, grid.sequence()), ("d_scale", seq, grid.sequence()), ("d_skip", seq, grid.sequence())]
    if geo.has_angles:
        outputs.append(("d_inc", jax.ShapeDtypeStruct((bsz, H, Tp, geo.angle_width), F32), grid.angle_rows()))
    return layout.run_kernel(body, geo, grid, inputs, outputs, "mamba3_siso_bwd_chunk_gradients",
                             geo.config.num_warps_grad)
