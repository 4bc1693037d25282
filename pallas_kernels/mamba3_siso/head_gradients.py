"""Backward chunk kernel of the Mamba-3 SISO scan for the queries and keys, rotated back in the same
launch: from one chunk of one head straight to the gradients of the op's Q, K rows, scale and angles.

Why: the chunk-gradient launches (chunk_backward.py) form dq, dk̃, the gradients of the kernels'
rotated operands, per (batch row, chunk, head); the query/key gradient kernel (qk_gradients.py) then
reads them back and walks a group's heads serially to rotate them back (H200, session 21: 0.50 ms
per call at B=32 T=512, ~9× its bandwidth floor). Here one program per (batch row, chunk, head)
(layout.ChunkGrid; two launches by default, config.head_gradient_launches: the queries' side and the
keys' side) forms dq, dk̃ piece by piece of the kernel layout (config.py: even | odd | rest column
pieces, each a dot over the whole chunk),

    dq  = (A ⊙ Λ)·K̃ + diag(e^{cs})·dY·S_c          dk̃ = (A ⊙ Λ)ᵀ·Q + diag(w)·V·dS      (A = dY·Vᵀ)

as chunk_backward.py does, and applies qk_gradients.py's backward of the rotation, bias and scale to
them while they are in registers (x̄ = Q[g] + Q_bias[h], ȳ = K[g] + K_bias[h], q = R(θ)x̄, k̃ = s·R(θ)ȳ):

    dx̄_h = R(θ)ᵀdq + c·ȳ      dȳ_h = s·R(θ)ᵀdk̃ + c·x̄      ds = ⟨ȳ, R(θ)ᵀdk̃⟩
    dθ   = ∂θ⟨dq, R(θ)x̄⟩ + s·∂θ⟨dk̃, R(θ)ȳ⟩,   d inc_t = Σ_{t' >= t in the chunk} dθ_t',   dθ_entry = Σ_chunk dθ
    d DT = ⟨d inc, π·tanh(angles)⟩,   d angles = π(1 − tanh² angles)·d inc·DT  (per head)

with c = γ·d skip = γ·⟨dY_i, v_i⟩ the gradient of the skip term's ⟨x̄, ȳ⟩ (recomputed here from the
dY and V the launch loads anyway). dq and dk̃ never reach HBM; the per-head dx̄_h, dȳ_h are written
instead (same bytes) and XLA sums them over a group's heads (dQ, dK) and over positions (the bias
gradients) in a fixed order; with angles shared by the heads, the per-head d inc·DT is summed over
the heads by XLA too. No atomics: every output element is written by exactly one program.

Measured (H200, session 22, B=32 T=512 per-head angles, one call): the two launches take 520 + 461 µs
against 156 + 151 + 505 µs for the keys / queries launches and the query/key gradient kernel, plus
~0.1 ms of XLA head and bias sums: kernel sum 2176 → 2466 µs (one launch at 8 warps: 1095 µs). The
rotation's dependent elementwise work, scans and reductions add ~13 µs of latency to every
(chunk, head) program here, about what one iteration of the serial head loop costs there (~11 µs):
spreading it over 24× the programs does not hide it, and the piecewise dots add more. So it is off by default (benchmarks/notes_mamba3_scan.md v13).

When it runs (`fuses_rotation`): config.rotate_in_chunk_gradients, dADT formed by the values launch
(chunk_backward.forms_adt_with_values: a Z and the forward's scores and ungated Y stored; this launch
forms no dADT), and every column piece at least min_width wide (each piece is a dot's output width).
Otherwise the keys / queries launches and the query/key gradient kernel run; both compute the same
sums (this one rounds dq, dk̃ once less: it never stores them).

Numerics: float32 except the dot operands (`matmul_dtype`); dx̄_h, dȳ_h rounded once to
geo.qk_gradient_dtype (bf16 for bf16 dots by default), every other output float32.
The pure-JAX reference is the composition chunk_backward's dq, dk̃ → the VJP of
queries_keys.head_queries_keys ∘ position_angles (and head_diagonal); tests compare the op against the
reference scan (tests/test_mamba3_scan_pallas.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_backward import forms_adt_with_values
from pallas_kernels.mamba3_siso.chunk_forward import chunk_inputs
from pallas_kernels.mamba3_siso.chunk_math import (chunk_decay, angle_gradient, angle_rate_and_slope, dot,
                                                   reverse_cumsum, rotate_back, rotation_of, gate_sigmoid)
from pallas_kernels.mamba3_siso.config import ScanGeometry


def fuses_rotation(geo: ScanGeometry, ops: dict) -> bool:
    """Whether the backward runs this launch instead of the keys / queries launches and the query/key
    gradient kernel (see the module docstring)."""
    return bool(geo.config.rotate_in_chunk_gradients and forms_adt_with_values(geo, ops)
                and all(width >= geo.config.min_width for _, _, width in geo.pieces))


def head_query_key_gradients(geo: ScanGeometry, ops: dict, entering, leaving_adjoint, Q, K, Q_bias, K_bias,
                             scale, gamma, angles, dt, theta):
    """The queries' and keys' gradients of every chunk, rotated back (after the adjoint pass).

    Args:
      ops: the forward's chunk operands (chunk_forward.chunk_outputs: q, k̃, v, z, adt) plus d_out.
      entering, leaving_adjoint: [Bt, H, nc, Pp, Np] states entering each chunk and adjoints of the
        states leaving it.
      Q, K: [Bt, Tp, G, Np] (kernel layout, activation dtype); Q_bias, K_bias: [H, Np] float32;
      scale, gamma: [Bt, Tp, H] float32 (s and γ of the core);
      angles: [Bt, Tp, 1 or H, Sp] raw angles, dt: [Bt, Tp, H] DT and theta: [Bt, Tp, H, Sp] the wrapped
        angle at every position (the forward kernel's), or all None (no angles).

    Returns:
      (dQ, dK [Bt, Tp, G, Np] float32, dQ_bias, dK_bias [H, Np] float32, d_scale [Bt, Tp, H] float32,
       d_angles (angles' shape), d_dt [Bt, Tp, H], d_theta_entry [Bt, nc, H, Sp] float32, or all three None),
      as qk_gradients.query_key_gradients.
    """
    grid = layout.ChunkGrid(geo)
    mm = geo.matmul_dtype
    rotated = theta is not None
    shared_angles = rotated and angles.shape[2] == 1
    pieces = geo.pieces
    pairs = [p for p in pieces if p[0] in ("even", "odd")]
    rest = [p for p in pieces if p[0] not in ("even", "odd")]

    def body(refs, *, queries: bool, keys: bool):
        """The chosen sides' gradients: queries (dx̄ and its share of the angle gradients), keys (dȳ,
        ds and theirs)."""
        decay = chunk_decay(refs["adt"][...], geo)
        v = refs["v"][...]
        d_out = refs["d_out"][...].astype(F32)
        if geo.has_z:
            z = refs["z"][...].astype(F32)
            dy = d_out * (z * gate_sigmoid(z, geo))                                   # dY = dO ⊙ silu(Z)
        else:
            dy = d_out
        lam = decay.lower(refs["diag_weight"][...] if "diag_weight" in refs else None)
        masked = dot(dy, v, mm, trans_b=True) * lam                        # (A ⊙ Λ), A_ij = <dY_i, v_j>
        s = refs["scale"][...] if keys else None
        # γ·d skip: the gradient of the skip term's ⟨x̄, ȳ⟩ (zero with config.skip_in_scores: the term is
        # then the scores' diagonal and its gradient reaches dq, dk̃ through (A ⊙ Λ))
        c = (0.0 if "diag_weight" in refs
             else (refs["gamma"][...] * jnp.sum(dy * v.astype(F32), axis=1))[:, None])

        def piece_terms(start, width):
            """dq, dk̃ (None for a side not formed), x̄, ȳ of one column piece, float32 [L, width]."""
            cols = pl.ds(start, width)
            dq = dk = None
            if queries:
                dq = dot(masked, refs["k"][:, cols], mm) + decay.read[:, None] * dot(dy, refs["state"][:, cols], mm)
            if keys:
                dk = (dot(masked, refs["q"][:, cols], mm, trans_a=True)
                      + decay.to_end[:, None] * dot(v, refs["d_state"][:, cols], mm))
            x = refs["Q"][:, cols].astype(F32) + refs["Q_bias"][cols][None, :]
            y = refs["K"][:, cols].astype(F32) + refs["K_bias"][cols][None, :]
            return dq, dk, x, y

        def write(start, width, gq, gk, x, y):
            """Stores dx̄, dȳ of a piece; returns its share of ds (None without the keys)."""
            cols = pl.ds(start, width)
            if queries:
                refs["dx"][:, cols] = (gq + c * y).astype(refs["dx"].dtype)
            if keys:
                refs["dy"][:, cols] = (s[:, None] * gk + c * x).astype(refs["dy"].dtype)
                return jnp.sum(y * gk, axis=1)
            return None

        def add(a, b):
            return b if a is None else a + b

        d_scale = None
        if pairs:                                           # the rotated pair of pieces (even, odd) together
            terms = {n: piece_terms(start, width) for n, start, width in pairs}
            dq, dk, x, y = ({n: terms[n][i] for n in terms} for i in range(4))
            rotation = None
            if rotated:
                angle = refs["theta"][...]
                rotation = rotation_of(angle, geo, backward=True)
            gq = rotate_back(dq, rotation) if queries else dq
            gk = rotate_back(dk, rotation) if keys else dk
            for n, start, width in pairs:
                share = write(start, width, gq[n], gk[n], x[n], y[n])
                d_scale = add(d_scale, share) if keys else None
            if rotated:
                d_angle = None                                                          # [L, Sp]
                if queries:
                    d_angle = angle_gradient(dq, x, rotation)
                if keys:
                    d_angle = add(d_angle, s[:, None] * angle_gradient(dk, y, rotation))
                d_inc = reverse_cumsum(d_angle, axis=0, by_matmul=geo.angle_sums_by_matmul)
                rate, slope = angle_rate_and_slope(refs["angles"][...])
                refs["d_dt"][...] = jnp.sum(d_inc * rate, axis=1)
                d_inc_dt = d_inc * refs["dt"][...][:, None]
                refs["d_angles"][...] = d_inc_dt if shared_angles else d_inc_dt * slope
                refs["d_theta_entry"][...] = jnp.sum(d_angle, axis=0)
        for _, start, width in rest:                        # unrotated pieces: one at a time
            dq, dk, x, y = piece_terms(start, width)
            share = write(start, width, dq, dk, x, y)
            d_scale = add(d_scale, share) if keys else None
        if keys:
            refs["d_scale"][...] = d_scale

    bsz, Tp, G, Np = Q.shape
    H, Sp, nc = geo.heads, geo.angle_width, geo.n_chunks
    seq = jax.ShapeDtypeStruct((bsz, Tp, H), F32)
    per_head = jax.ShapeDtypeStruct((bsz, Tp, H, Np), geo.qk_gradient_dtype)
    sides = {"queries": (["k"], "state", ("dx", per_head, grid.head_rows(Np))),
             "keys": (["q"], "d_state", ("dy", per_head, grid.head_rows(Np)))}
    launches = [("queries", "keys")] if geo.config.head_gradient_launches == 1 else [("queries",), ("keys",)]
    results = []
    for chosen in launches:
        names = [n for side in chosen for n in sides[side][0]]
        inputs = chunk_inputs(geo, grid, ops, sorted(set(names)) + ["v", "z", "d_out", "adt", "diag_weight"])
        inputs += [(sides[side][1], entering if side == "queries" else leaving_adjoint, grid.chunk_state())
                   for side in chosen]
        inputs += [("Q", Q, grid.group_rows()), ("K", K, grid.group_rows()),
                   ("Q_bias", Q_bias, grid.head_vector(Np)), ("K_bias", K_bias, grid.head_vector(Np)),
                   ("gamma", gamma, grid.sequence())]
        outputs = [sides[side][2] for side in chosen]
        if "keys" in chosen:
            inputs.append(("scale", scale, grid.sequence()))
            outputs.append(("d_scale", seq, grid.sequence()))
        if rotated:
            inputs += [("theta", theta, grid.head_rows(Sp)), ("dt", dt, grid.sequence()),
                       ("angles", angles[:, :, 0], grid.shared_rows(Sp)) if shared_angles
                       else ("angles", angles, grid.head_rows(Sp))]
            outputs += [("d_angles", jax.ShapeDtypeStruct((bsz, Tp, H, Sp), F32), grid.head_rows(Sp)),
                        ("d_dt", seq, grid.sequence()),
                        ("d_theta_entry", jax.ShapeDtypeStruct((bsz, nc, H, Sp), F32), grid.chunk_vector(Sp))]
        results.append(layout.launch(
            functools.partial(body, queries="queries" in chosen, keys="keys" in chosen), geo, grid, inputs, outputs,
            "mamba3_siso_bwd_head_gradients_" + "_".join(chosen), geo.config.num_warps_head_grad))
    out = {n: a for r in results for n, a in r.items() if n in ("dx", "dy", "d_scale")}
    dx, dy = out["dx"].astype(F32), out["dy"].astype(F32)
    per_group = (bsz, Tp, G, H // G, Np)
    d_angles = d_dt = d_entry = None
    if rotated:                                      # the launches' shares (linear in dθ) added in a fixed order
        d_angles, d_dt, d_entry = (functools.reduce(jnp.add, [r[n] for r in results])
                                   for n in ("d_angles", "d_dt", "d_theta_entry"))
        if shared_angles:                       # Σ_h d inc_h·DT_h, then the slope of the shared tanh
            d_angles = jnp.sum(d_angles, axis=2, keepdims=True) * angle_rate_and_slope(angles)[1]
    return (dx.reshape(per_group).sum(axis=3), dy.reshape(per_group).sum(axis=3),
            dx.sum(axis=(0, 1)), dy.sum(axis=(0, 1)), out["d_scale"], d_angles, d_dt, d_entry)
