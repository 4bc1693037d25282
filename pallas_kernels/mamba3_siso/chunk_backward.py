"""Backward chunk kernels of the Mamba-3 SISO scan: every gradient of one chunk, in one to three launches.

Why: given the state S_c entering chunk c (forward residual) and the adjoint dS = G_{c+1} of the state
leaving it (state_passes.adjoint_state_pass), the chunks' gradients are independent. One program per
(batch row, chunk, head) applies docs/mamba3_siso.md §4.4 steps 1-2 to the kernel's operands (Q the rotated biased
queries, K̃ the scaled rotated biased keys; the rotation, biases and scale are differentiated by the
query/key gradient kernel, qk_gradients.py), with A_ij = ⟨dY_i, v_j⟩, Λ the strictly lower decay matrix and w = e^{cs_end − cs}:

    dZ  = dO ⊙ Y ⊙ σ(Z)(1 + Z(1 − σ(Z)))            (Y recomputed),  dY = dO ⊙ silu(Z)
    dQ  = (A ⊙ Λ)·K̃ + diag(e^{cs})·dY·S_c
    dK̃  = (A ⊙ Λ)ᵀ·Q + diag(w)·V·dS
    dV  = ((Q K̃ᵀ) ⊙ Λ)ᵀ·dY + diag(w)·K̃·dSᵀ + diag(skip)·dY
    dskip_i = ⟨dY_i, v_i⟩
    dADT_i = Σ_{i' >= i} r_{i'} + ρ     (r, ρ as in §4.4 step 2; ⟨dY_i, Q_i S_cᵀ⟩ = ⟨dY_i S_c, Q_i⟩)

Tensor-core dots over the whole d_state: 8 (10 with Z) in one launch, 11 (13) over three; split by
`config.gradient_kernels` into two (dQ apart) or three (values dV, dZ, dskip / keys dK̃, dADT /
queries dQ; `keys_with_queries` puts the last two back in one launch; with the scores and Y stored,
`adt_in_values` moves dADT from the keys launch to the values launch): each launch recomputes the few
products it shares with the others (A = dY·Vᵀ, the scores), in exchange for fewer live tiles per
program (the one-launch kernel spills).

Numerics: float32 everywhere except dot operands (`matmul_dtype`, as in the forward); dV, dZ are
rounded once to their dtype; dQ, dK̃ are float32 (or rounded once to the dot operand dtype,
config.qk_gradient_dtype) and the per-position scalar gradients are float32.
HBM: each launch reads its share of Q, K̃, V, Z, dO, two per-position scalars and two stored states
per chunk; together they write dV, dZ, dQ, dK̃ and two per-position scalars.
No atomics: every output element is written by exactly one program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common.dtypes import F32
from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_forward import chunk_inputs
from pallas_kernels.mamba3_siso.chunk_math import chunk_decay, dot, reverse_cumsum, gate_sigmoid, total
from pallas_kernels.mamba3_siso.config import ScanGeometry


def forms_adt_with_values(geo: ScanGeometry, ops: dict) -> bool:
    """config.adt_in_values and what it needs: three launches and both the scores and the ungated Y
    stored (Y is stored only with Z), so the values launch can form dADT without Q or a Q·S_cᵀ dot."""
    return bool(geo.config.adt_in_values and geo.config.gradient_kernels == 3 and "scores" in ops
                and "ungated" in ops)


def state_dot_with_keys(geo: ScanGeometry, ops: dict) -> bool:
    """config.state_dot_with_keys and what it needs: the keys and queries in one launch (it holds S_c
    and dS) and the values launch forming dADT (it then reads ρ_S = e^{cs_end}⟨S_c, dS⟩ from it)."""
    return bool(geo.config.state_dot_with_keys and geo.config.keys_with_queries and forms_adt_with_values(geo, ops))


def chunk_gradients(geo: ScanGeometry, ops: dict, entering, leaving_adjoint, *, values_only: bool = False) -> dict:
    """The chunk gradients (after the adjoint pass).

    Args:
      ops: the forward's chunk operands (see chunk_forward.chunk_outputs) plus d_out [Bt, Tp, H, Pp].
      entering: [Bt, H, nc, Pp, Np] states entering each chunk (forward residual).
      leaving_adjoint: [Bt, H, nc, Pp, Np] adjoint of the state leaving each chunk.
      values_only: only the values launch (dV, dZ, dskip and dADT; needs forms_adt_with_values): the
        queries' and keys' gradients come from head_gradients.py instead.

    Returns:
      dict with dq, dk [Bt, Tp, H, Np] (gradients of the kernel's Q and K̃; float32, or the dot operand
      dtype with config.qk_gradient_dtype "dot_operand"; [Bt, H, Np, Tp] with config.qk_gradients_transposed),
      dv [Bt, Tp, H, Pp]
      (V dtype), dz (Z dtype, when Z), d_adt, d_skip [Bt, Tp, H] float32.
    """
    grid = layout.ChunkGrid(geo)
    mm = geo.matmul_dtype
    # dq, dk̃ stored [width, L] into [Bt, H, Np, Tp] for qk_gradients_transposed.py (the transpose rides on
    # the conversion from the dot's register layout that any store of a dot result makes)
    position_major = (lambda x: x.T) if geo.qk_grad_position_major else (lambda x: x)

    adt_in_values = forms_adt_with_values(geo, ops)
    rho_from_keys = state_dot_with_keys(geo, ops) and not values_only

    def body(refs, *, values: bool, keys: bool, queries: bool):
        """The gradients of the chosen groups: values (dV, dZ, dskip), keys (dK̃, dADT), queries (dQ);
        dADT with the values instead when `adt_in_values`."""
        adt_values = values and adt_in_values           # this launch forms dADT from the stored products
        adt_keys = keys and not adt_in_values
        # position-major dq, dk̃ as transposed dots (config.transposed_gradient_dots), unless dADT needs V·dS
        # or dY·S_c row-major in this launch
        transposed_dots = geo.qk_grad_position_major and geo.config.transposed_gradient_dots and not adt_keys
        decay = chunk_decay(refs["adt"][...], geo)
        # the forward's products, when the launch was given them (config.stored_scores / stored_ungated /
        # stored_for_keys; the launches are then one group each)
        stored_scores, stored_y = "scores" in refs, "ungated" in refs
        formed_scores = (values or adt_keys) and not stored_scores
        lam = (decay.lower(refs["diag_weight"][...] if "diag_weight" in refs else None)
               if (formed_scores or keys or queries) else None)
        k, v = refs["k"][...], refs["v"][...]
        d_out = refs["d_out"][...].astype(F32)
        if geo.has_z:
            z = refs["z"][...].astype(F32)
            sz = gate_sigmoid(z, geo)
            dy = d_out * (z * sz)                                       # dY = dO ⊙ silu(Z)
        else:
            dy = d_out
        if keys or queries or adt_values:
            attn = dot(dy, v, mm, trans_b=True)                         # A_ij = <dY_i, v_j>
        q_state_needed = (values and geo.has_z and not stored_y) or (adt_keys and not queries and not stored_y)
        if formed_scores or q_state_needed or keys:
            q = refs["q"][...]
        if formed_scores:
            scores = dot(q, k, mm, trans_b=True) * lam                  # recomputed (Q K̃ᵀ) ⊙ Λ
        elif stored_scores:
            scores = refs["scores"][...]     # stored: float32 when keys read it; the dots round it to mm anyway
        if values or keys:
            d_state = refs["d_state"][...]
        q_state = dot(q, refs["state"][...], mm, trans_b=True) if q_state_needed else None   # Q·S_cᵀ [L, Pp]

        if values:
            skip = refs["skip"][...]
            if geo.has_z:                                               # step 1: the gate
                y = (refs["ungated"][...] if stored_y
                     else dot(scores, v, mm) + decay.read[:, None] * q_state + skip[:, None] * v.astype(F32))
                refs["dz"][...] = (d_out * y * sz * (1.0 + z * (1.0 - sz))).astype(refs["dz"].dtype)
            d_skip = jnp.sum(dy * v.astype(F32), axis=1)
            refs["d_skip"][...] = d_skip
            k_ds = dot(k, d_state, mm, trans_b=True)                    # K̃·dSᵀ  [L, Pp]
            dv = dot(scores, dy, mm, trans_a=True) + skip[:, None] * dy + decay.to_end[:, None] * k_ds
            refs["dv"][...] = dv.astype(refs["dv"].dtype)
            if adt_values:
                # step 2 from the stored products: M = scores ⊙ A with the stored (dot operand dtype)
                # scores; <v_i, dS k̃_i> = Σ_p v_ip (K̃·dSᵀ)_ip, so no V·dS dot
                m = scores.astype(F32) * attn
                r = jnp.sum(dy * refs["ungated"][...], axis=1) - skip * d_skip - jnp.sum(m, axis=0)
                to_end = decay.to_end * jnp.sum(v.astype(F32) * k_ds, axis=1)
                if rho_from_keys:   # ρ_S = e^{cs_end}⟨S_c, dS⟩ from the keys+queries launch
                    rho_state = jnp.sum(refs["rho_state"][...])
                else:
                    rho_state = decay.chunk * total(refs["state"][...].astype(F32) * d_state.astype(F32))
                refs["d_adt"][...] = reverse_cumsum(r - to_end) + (rho_state + jnp.sum(to_end))

        if adt_keys:                                                    # step 2: M = scores ⊙ A
            m = scores.astype(F32) * attn
            if stored_y:
                # with y = (P·V) + e^{cs}(Q S_cᵀ) + skip·V: e^{cs_i}<dY_i, (Q S_cᵀ)_i> = <dY_i, y_i> − Σ_j m_ij
                # − skip_i<dY_i, v_i>, so r needs neither Q·S_cᵀ nor the row sums of m
                r = (jnp.sum(dy * refs["ungated"][...], axis=1) - refs["skip"][...] * jnp.sum(dy * v.astype(F32), axis=1)
                     - jnp.sum(m, axis=0))
            else:
                r = jnp.sum(m, axis=1) - jnp.sum(m, axis=0)
        if keys and transposed_dots:    # dK̃ᵀ = q̃ᵀ·(A⊙Λ) + (dSᵀ·Vᵀ)·diag(w): [Np, L] straight from the dots
            refs["dk"][...] = (dot(q, attn * lam, mm, trans_a=True)
                               + dot(d_state, v, mm, trans_a=True, trans_b=True)
                               * decay.to_end[None, :]).astype(refs["dk"].dtype)
        elif keys:
            v_ds = dot(v, d_state, mm)                                  # V·dS  [L, Np]
            refs["dk"][...] = position_major((dot(attn * lam, q, mm, trans_a=True)
                                              + decay.to_end[:, None] * v_ds).astype(refs["dk"].dtype))
        if adt_keys:
            to_end = decay.to_end * jnp.sum(v_ds * k.astype(F32), axis=1)
            state_dot = total(refs["state"][...].astype(F32) * d_state.astype(F32))

        if queries and transposed_dots:  # dQᵀ = K̃ᵀ·(A⊙Λ)ᵀ + (S_cᵀ·dYᵀ)·diag(e^{cs})
            refs["dq"][...] = (dot(k, attn * lam, mm, trans_a=True, trans_b=True)
                               + dot(refs["state"][...], dy, mm, trans_a=True, trans_b=True)
                               * decay.read[None, :]).astype(refs["dq"].dtype)
        elif queries:
            dy_state = dot(dy, refs["state"][...], mm)                  # dY·S_c  [L, Np]
            refs["dq"][...] = position_major((dot(attn * lam, k, mm)
                                              + decay.read[:, None] * dy_state).astype(refs["dq"].dtype))
        if keys and queries and "rho_state" in refs:                    # for the values launch's dADT
            state_dot = total(refs["state"][...].astype(F32) * d_state.astype(F32))
            refs["rho_state"][...] = jnp.full((1,), decay.chunk * state_dot, F32)

        if adt_keys:
            # <dY_i, Q_i S_cᵀ> = <dY_i S_c, Q_i>: whichever of the two products this program has
            if not stored_y:
                diag = (jnp.sum(dy_state * q.astype(F32), axis=1) if queries
                        else jnp.sum(dy * q_state, axis=1))
                r = r + decay.read * diag
            # d ADT: r_i − m_i summed from the right, plus ρ = e^{cs_end}<S, dS> + Σ m (docs/mamba3_siso.md §4.4 step 2)
            refs["d_adt"][...] = reverse_cumsum(r - to_end) + (decay.chunk * state_dot + jnp.sum(to_end))

    bsz, Tp, H, Pp, Np = geo.batch, geo.padded_seqlen, geo.heads, geo.padded_headdim, geo.padded_state
    io = jnp.dtype(geo.io_dtype)
    seq = jax.ShapeDtypeStruct((bsz, Tp, H), F32)
    if geo.qk_grad_position_major:       # position-major for qk_gradients_transposed.py
        per_head, qk_spec = jax.ShapeDtypeStruct((bsz, H, Np, Tp), geo.qk_gradient_dtype), grid.head_cols(Np)
    else:
        per_head, qk_spec = jax.ShapeDtypeStruct((bsz, Tp, H, Np), geo.qk_gradient_dtype), grid.head_rows(Np)
    outputs = {"values": [("dv", jax.ShapeDtypeStruct((bsz, Tp, H, Pp), io), grid.head_rows(Pp)),
                          ("d_skip", seq, grid.sequence())],
               "keys": [("dk", per_head, qk_spec), ("d_adt", seq, grid.sequence())],
               "queries": [("dq", per_head, qk_spec)]}
    if geo.has_z:
        outputs["values"].append(("dz", jax.ShapeDtypeStruct((bsz, Tp, H, Pp), jnp.dtype(ops["z"].dtype)),
                                  grid.head_rows(Pp)))
    kept = {n for n in ("scores", "ungated") if n in ops}     # the forward's products (chunk_forward.stores)
    values_reads = {"k", "v", "z", "d_out", "adt", "skip", "d_state"} | kept
    if "scores" not in ops or (geo.has_z and "ungated" not in ops):
        values_reads |= {"q"} | ({"state"} if geo.has_z and "ungated" not in ops else set())
    keys_reads = {"q", "k", "v", "z", "d_out", "adt", "state", "d_state"}
    if geo.config.stored_for_keys:
        keys_reads |= kept | ({"skip"} if "ungated" in kept else set())
    if adt_in_values:
        outputs["values"] += [o for o in outputs["keys"] if o[0] == "d_adt"]
        outputs["keys"] = [o for o in outputs["keys"] if o[0] != "d_adt"]
        values_reads |= {"state"}
        keys_reads -= {"state"}
    rho_spec = grid.chunk_vector(1)           # [Bt, nc, H, 1]: one float32 per (batch row, chunk, head)
    if rho_from_keys:
        values_reads -= {"state"}
        outputs["keys"].append(("rho_state", jax.ShapeDtypeStruct((bsz, geo.n_chunks, H, 1), F32), rho_spec))
    reads = {"values": values_reads,
             "keys": keys_reads,
             "queries": {"k", "v", "z", "d_out", "adt", "state"}}
    launches = {1: [("values", "keys", "queries")], 2: [("values", "keys"), ("queries",)],
                3: [("values",), ("keys",), ("queries",)]}[geo.config.gradient_kernels]
    if geo.config.keys_with_queries:   # keys first when the values launch reads their ρ_S
        launches = [("keys", "queries"), ("values",)] if rho_from_keys else [("values",), ("keys", "queries")]
    if values_only:
        if not adt_in_values:
            raise ValueError("chunk_gradients(values_only=True) needs dADT formed by the values launch "
                             "(forms_adt_with_values)")
        launches = [("values",)]
    arrays = dict(ops, state=entering, d_state=leaving_adjoint)
    specs = {"state": grid.chunk_state(), "d_state": grid.chunk_state()}
    grads = {}
    for groups in launches:
        names = set().union(*(reads[g] for g in groups))
        inputs = chunk_inputs(geo, grid, ops, [n for n in ("q", "k", "v", "z", "d_out", "adt", "skip", "scores",
                                                           "ungated") if n in names] + ["diag_weight"])
        inputs += [(n, arrays[n], specs[n]) for n in ("state", "d_state") if n in names]
        if rho_from_keys and "values" in groups:
            inputs.append(("rho_state", grads["rho_state"], rho_spec))
        grads.update(layout.launch(
            functools.partial(body, **{g: g in groups for g in ("values", "keys", "queries")}), geo, grid, inputs,
            [o for g in groups for o in outputs[g]], "mamba3_siso_bwd_chunk_gradients_" + "_".join(groups),
            geo.config.num_warps_values if groups == ("values",) and geo.config.num_warps_values is not None
            else geo.config.num_warps_grad))
    grads.pop("rho_state", None)
    return grads
