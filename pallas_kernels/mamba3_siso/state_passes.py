"""The passes over chunk boundaries: per-chunk contributions (parallel) and their combine (sequential).

Why: the chunked scan (spec §4.3) needs the state S_c entering every chunk c, and the backward (§4.4)
the adjoint of the state leaving it. Both are short recurrences over the nc chunks:

  forward   S_0 = augmented initial state,   S_{c+1} = e^{cs_end,c}·S_c + U_c,
            U_c = (V_c ⊙ e^{cs_end − cs}·s)ᵀ·K_c                (K_c rotated keys; (V ⊙ s)ᵀK = Vᵀ K̃)
  adjoint   G_nc = ∂L/∂S_final,              G_c     = e^{cs_end,c}·G_{c+1} + R_c,
            R_c = (dY_c ⊙ e^{cs})ᵀ·Q_c                         (Q_c rotated queries, dY = dO ⊙ silu(Z))

Each is split in two launches. `chunk_contributions`: one program per (batch row, chunk, head)
computes U_c (or R_c) with tensor-core dots, the RoPE rotation included; all chunks in parallel.
`combine_chunks`: one program per (batch row, head, block of headdim rows) walks the chunks with its
[rows, w] float32 tiles and does only elementwise work per step (load, multiply-add, store), so the
sequential chain is short. (A single pass that computed U_c inside the walk was latency bound on the
H200: every step's dots and reductions sat on the critical path.)

Numerics: float32 carry and accumulation; dot operands in `matmul_dtype` (bf16 for bf16
activations, as the official kernel); contributions and per-chunk states stored in
`config.stored_state_dtype` (float32 by default). HBM: the contributions are written once and read
once; the per-chunk states written once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_forward import chunk_inputs
from pallas_kernels.mamba3_siso.chunk_math import F32, ChunkDecay, biased_parts, chunk_rotation, dot, rotate, sigmoid
from pallas_kernels.mamba3_siso.config import ScanGeometry


def chunk_contributions(geo: ScanGeometry, ops: dict, *, adjoint: bool) -> dict:
    """U_c (forward) or R_c (adjoint) of every chunk: {part: [Bt, H, nc, Pp, w]} in the stored dtype.

    Args:
      ops: forward: k_/kb_{part}, v, adt, scale, inc, theta (layout.py); adjoint: q_/qb_{part},
        d_out, z (or None), adt, inc, theta.
      adjoint: False for U_c, True for R_c.
    """
    grid = layout.ChunkGrid(geo)
    names = geo.part_names
    prefix = "q" if adjoint else "k"

    def body(refs):
        decay = ChunkDecay(refs["adt"][...])
        rotation = chunk_rotation(refs["inc"][...], refs["theta"][...]) if geo.has_angles else None
        keys = rotate(biased_parts(refs, prefix, names), rotation)       # rotated k (or q)  {part: [L, w]}
        if adjoint:
            rows = refs["d_out"][...].astype(F32)                        # [L, Pp]
            if geo.has_z:
                z = refs["z"][...].astype(F32)
                rows = rows * z * sigmoid(z)
            rows = rows * decay.read[:, None]
        else:
            rows = refs["v"][...].astype(F32) * (decay.to_end * refs["scale"][...])[:, None]
        for n in names:
            refs[f"out_{n}"][...] = dot(rows, keys[n], geo.matmul_dtype, trans_a=True).astype(refs[f"out_{n}"].dtype)

    wanted = [f"{prefix}{s}_{n}" for n in names for s in ("", "b")] + ["adt", "inc", "theta"]
    wanted += ["d_out", "z"] if adjoint else ["v", "scale"]
    bsz, H, nc, Pp = geo.batch, geo.heads, geo.n_chunks, geo.padded_headdim
    out = layout.run_kernel(
        body, geo, grid, chunk_inputs(geo, grid, ops, wanted),
        [(f"out_{n}", jax.ShapeDtypeStruct((bsz, H, nc, Pp, w), geo.stored_state_dtype), grid.chunk_state(w))
         for n, w in geo.parts],
        "mamba3_siso_bwd_chunk_adjoints" if adjoint else "mamba3_siso_fwd_chunk_states", geo.config.num_warps_local)
    return {n: out[f"out_{n}"] for n in names}


def chunk_decays(geo: ScanGeometry, adt):
    """[Bt, H, Tp] ADT -> [Bt, H, nc] e^{Σ ADT over the chunk} (float32)."""
    bsz, H, _ = adt.shape
    return jnp.exp(adt.reshape(bsz, H, geo.n_chunks, geo.chunk).sum(axis=-1))


def combine_chunks(geo: ScanGeometry, contributions: dict, decays, boundary: dict, *, reverse: bool):
    """Walks X_{next} = decay_c·X + contribution_c over the chunks.

    Args:
      contributions: {part: [Bt, H, nc, Pp, w]} U_c or R_c.
      decays: [Bt, H, nc] e^{cs_end} of each chunk.
      boundary: {part: [Bt, H, Pp, w] f32}: S_0 (forward) or ∂L/∂S_final (reverse).
      reverse: False: chunks 0..nc-1 (forward states); True: nc-1..0 (adjoints).

    Returns:
      (per_chunk {part: [Bt, H, nc, Pp, w] stored dtype}: the value before chunk c's step, i.e. the
       state entering chunk c (forward) or the adjoint of the state leaving it (reverse);
       last {part: [Bt, H, Pp, w] f32}: the final state (forward) or ∂L/∂S_0 (reverse)).
    """
    grid = layout.StateGrid(geo)
    names = geo.part_names
    nc = geo.n_chunks

    def body(refs):
        def step(k, carry):
            c = nc - 1 - k if reverse else k
            decay = refs["decay"][c]
            out = []
            for name, x in zip(names, carry):
                refs[f"each_{name}"][c] = x.astype(refs[f"each_{name}"].dtype)
                out.append(decay * x + refs[f"local_{name}"][c].astype(F32))
            return tuple(out)

        last = jax.lax.fori_loop(0, nc, step, tuple(refs[f"boundary_{n}"][...] for n in names))
        for name, x in zip(names, last):
            refs[f"last_{name}"][...] = x

    inputs = [("decay", decays, grid.chunk_scalars())]
    inputs += [(f"local_{n}", contributions[n], grid.chunk_states(w)) for n, w in geo.parts]
    inputs += [(f"boundary_{n}", boundary[n], grid.state(w)) for n, w in geo.parts]
    bsz, H, Pp = geo.batch, geo.heads, geo.padded_headdim
    outputs = ([(f"each_{n}", jax.ShapeDtypeStruct((bsz, H, nc, Pp, w), geo.stored_state_dtype), grid.chunk_states(w))
                for n, w in geo.parts]
               + [(f"last_{n}", jax.ShapeDtypeStruct((bsz, H, Pp, w), F32), grid.state(w)) for n, w in geo.parts])
    out = layout.run_kernel(body, geo, grid, inputs, outputs,
                            "mamba3_siso_bwd_adjoint_combine" if reverse else "mamba3_siso_fwd_state_combine",
                            geo.config.num_warps_state)
    return {n: out[f"each_{n}"] for n in names}, {n: out[f"last_{n}"] for n in names}


def forward_state_pass(geo: ScanGeometry, ops: dict):
    """States entering every chunk ({part: [Bt, H, nc, Pp, w]}) and the final state ({part: [Bt, H, Pp, w]}).

    ops: as for chunk_contributions(adjoint=False), plus s0_{part} [Bt, H, Pp, w] f32 (S_0).
    """
    local = chunk_contributions(geo, ops, adjoint=False)
    return combine_chunks(geo, local, chunk_decays(geo, ops["adt"]),
                          {n: ops[f"s0_{n}"] for n in geo.part_names}, reverse=False)


def adjoint_state_pass(geo: ScanGeometry, ops: dict, d_final: dict):
    """Adjoints of the states leaving every chunk ({part: [Bt, H, nc, Pp, w]}: G_{c+1} for chunk c) and
    of the augmented initial state ({part: [Bt, H, Pp, w]}: G_0).

    ops: as for chunk_contributions(adjoint=True); d_final: {part: [Bt, H, Pp, w] f32} ∂L/∂S_final.
    """
    local = chunk_contributions(geo, ops, adjoint=True)
    return combine_chunks(geo, local, chunk_decays(geo, ops["adt"]), d_final, reverse=True)

