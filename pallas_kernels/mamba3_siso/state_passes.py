"""The passes over chunk boundaries: each chunk's contribution and the walk that combines them.

Why: the chunked scan (docs/mamba3_siso.md §4.3) needs the state S_c entering every chunk c, and the backward (§4.4)
the adjoint of the state leaving it. Both are short recurrences over the nc chunks:

  forward   S_0 = augmented initial state,   S_{c+1} = e^{cs_end,c}·S_c + U_c,
            U_c = (V_c ⊙ e^{cs_end − cs})ᵀ·K̃_c                  (K̃ = s·R(θ)k̄: scaled rotated keys)
  adjoint   G_nc = ∂L/∂S_final,              G_c     = e^{cs_end,c}·G_{c+1} + R_c,
            R_c = (dY_c ⊙ e^{cs})ᵀ·Q_c                         (Q_c rotated queries, dY = dO ⊙ silu(Z))

Two forms (config.state_passes):
  "walk" (default) `walk_chunks`: one launch per pass; one program per (batch row, head, walk_block_p
         headdim rows) walks the chunks and forms each U_c (or R_c) for its rows with one tensor-core
         dot inside the walk, the next chunk's operands loaded before that dot so their latency
         overlaps it, and only the multiply-add on the serial chain. H200 (session 23, 64 rows):
         forward 191 → 99 µs, backward 211 → 123 µs per B=32 T=512 call, 184 → 107 and 204 → 138 at
         B=8 T=2048; the float32 contributions never reach HBM.
  "split" two launches per pass: `chunk_contributions`, one program per (batch row, chunk, head)
         computing U_c (or R_c) with one dot, all chunks in parallel; then `combine_chunks`, one
         program per (batch row, head, block of state_block_p headdim rows) walking the chunks with
         only elementwise work per step (load, multiply-add, store). (The first single pass, in an
         early design with float32 states, 16-row programs and no prefetch, was latency bound: this
         split replaced it then.)

Numerics: float32 carry, accumulation and contributions (so the final state only sees the dots'
operand rounding); dot operands in `matmul_dtype` (bf16 for bf16 activations, as the official
kernel); the per-chunk states / adjoints stored in `config.stored_state_dtype`. HBM: the per-chunk
states written once; "split" also writes and reads the float32 contributions once, "walk" instead
reads K̃ (or Q) once per block of rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_math import chunk_decay, dot, gate_sigmoid
from pallas_kernels.mamba3_siso.config import ScanGeometry


def chunk_contributions(geo: ScanGeometry, ops: dict, *, adjoint: bool):
    """U_c (forward) or R_c (adjoint) of every chunk: [Bt, H, nc, Pp, Np] float32.

    Args:
      ops: forward: k, v, adt (layout.py); adjoint: q, d_out, z (or None), adt.
      adjoint: False for U_c, True for R_c.
    """
    grid = layout.ChunkGrid(geo)
    key = "q" if adjoint else "k"

    def body(refs):
        decay = chunk_decay(refs["adt"][...], geo)
        if adjoint:
            rows = refs["d_out"][...].astype(F32)                        # [L, Pp]
            if geo.has_z:
                z = refs["z"][...].astype(F32)
                rows = rows * z * gate_sigmoid(z, geo)
            rows = rows * decay.read[:, None]
        else:
            rows = refs["v"][...].astype(F32) * decay.to_end[:, None]
        refs["out"][...] = dot(rows, refs[key][...], geo.matmul_dtype, trans_a=True).astype(refs["out"].dtype)

    Np, Pp = geo.padded_state, geo.padded_headdim
    inputs = [(key, ops[key], grid.head_rows(Np)), ("adt", ops["adt"], grid.sequence())]
    if adjoint:
        inputs += [("d_out", ops["d_out"], grid.head_rows(Pp)), ("z", ops["z"], grid.head_rows(Pp))]
    else:
        inputs += [("v", ops["v"], grid.head_rows(Pp))]
    out = layout.launch(
        body, geo, grid, inputs,
        [("out", jax.ShapeDtypeStruct((geo.batch, geo.heads, geo.n_chunks, Pp, Np), F32),
          grid.chunk_state())],
        "mamba3_siso_bwd_chunk_adjoints" if adjoint else "mamba3_siso_fwd_chunk_states", geo.config.num_warps_local)
    return out["out"]


def chunk_decays(geo: ScanGeometry, adt):
    """[Bt, Tp, H] ADT -> [Bt, H, nc] e^{Σ ADT over the chunk} (float32)."""
    bsz, _, H = adt.shape
    return jnp.exp(jnp.transpose(adt.reshape(bsz, geo.n_chunks, geo.chunk, H).sum(axis=2), (0, 2, 1)))


def combine_chunks(geo: ScanGeometry, contributions, decays, boundary, *, reverse: bool, want_last: bool = True):
    """Walks X_{next} = decay_c·X + contribution_c over the chunks.

    Args:
      contributions: [Bt, H, nc, Pp, Np] U_c or R_c.
      decays: [Bt, H, nc] e^{cs_end} of each chunk.
      boundary: [Bt, H, Pp, Np] f32: S_0 (forward) or ∂L/∂S_final (reverse); None: zero (no operand).
      reverse: False: chunks 0..nc-1 (forward states); True: nc-1..0 (adjoints).
      want_last: False: `last` is not written (None; the adjoint of an absent initial state).

    Returns:
      (per_chunk [Bt, H, nc, Pp, Np] stored dtype: the value before chunk c's step, i.e. the state
       entering chunk c (forward) or the adjoint of the state leaving it (reverse);
       last [Bt, H, Pp, Np] f32: the final state (forward) or ∂L/∂S_0 (reverse), or None).
    """
    grid = layout.StateGrid(geo)
    nc = geo.n_chunks

    def body(refs):
        def chunk_at(k):   # the k-th chunk visited
            return nc - 1 - k if reverse else k

        def load(k):       # (decay, contribution) of the k-th chunk visited (k clamped: a harmless reload)
            c = chunk_at(jnp.minimum(k, nc - 1))
            return refs["decay"][c], refs["local"][c].astype(F32)

        def step(k, carry):
            # the next chunk's operands are loaded before this step's store and multiply-add, so their
            # global-memory latency overlaps this step (a hand-written prefetch: Triton does not
            # pipeline this loop)
            x, (decay, local) = carry
            ahead = load(k + 1)
            refs["each"][chunk_at(k)] = x.astype(refs["each"].dtype)
            return decay * x + local, ahead

        last = jax.lax.fori_loop(0, nc, step, (_start(refs, (grid.block_p, geo.padded_state)), load(0)))[0]
        if want_last:
            refs["last"][...] = last

    inputs = [("decay", decays, grid.chunk_scalars()), ("local", contributions, grid.chunk_states()),
              ("boundary", boundary, grid.state())]
    out = layout.launch(body, geo, grid, inputs, _outputs(geo, grid, want_last),
                        "mamba3_siso_bwd_adjoint_combine" if reverse else "mamba3_siso_fwd_state_combine",
                        geo.config.num_warps_state)
    return out["each"], out.get("last")


def _start(refs, shape):
    """The walk's first carry: the boundary block, or zeros when the boundary is absent (None: no
    operand, nothing read)."""
    return refs["boundary"][...] if "boundary" in refs else jnp.zeros(shape, F32)


def _outputs(geo: ScanGeometry, grid, want_last: bool):
    """The outputs of a walk or combine: every chunk's value before its step, and (want_last) the value
    after the last."""
    bsz, H, nc, Pp, Np = geo.batch, geo.heads, geo.n_chunks, geo.padded_headdim, geo.padded_state
    outputs = [("each", jax.ShapeDtypeStruct((bsz, H, nc, Pp, Np), geo.stored_state_dtype), grid.chunk_states())]
    if want_last:
        outputs.append(("last", jax.ShapeDtypeStruct((bsz, H, Pp, Np), F32), grid.state()))
    return outputs


def walk_chunks(geo: ScanGeometry, ops: dict, boundary, *, adjoint: bool, want_last: bool = True):
    """config.state_passes == "walk": the contributions and their combine in one launch.

    One program per (batch row, head, block of walk_block_p headdim rows) walks the chunks (0..nc-1,
    or nc-1..0 for the adjoint) with its [rows, Np] float32 carry X and, at each, forms the chunk's
    contribution to its rows with one dot, U_c = (V_c ⊙ e^{cs_end − cs})ᵀ·K̃_c (or R_c = (dY_c ⊙
    e^{cs})ᵀ·Q_c), stores X (the state entering chunk c, or the adjoint of the state leaving it) and
    steps X ← e^{cs_end,c}·X + U_c. The next chunk's operands are loaded before this step's dot, so
    their latency overlaps it; the dot does not depend on X, so only the multiply-add is on the chain.
    The same sums as chunk_contributions + combine_chunks, with no contribution in HBM (K̃ or Q is
    read once per row block, i.e. Pp / walk_block_p times, mostly from L2).

    Args: ops as for chunk_contributions; boundary [Bt, H, Pp, Np] f32 (S_0, or ∂L/∂S_final) or None
      (zero: no operand); want_last as combine_chunks.
    Returns: as combine_chunks.
    """
    grid = layout.StateGrid(geo, rows=geo.walk_block_p)
    nc, L, mm = geo.n_chunks, geo.chunk, geo.matmul_dtype
    key = "q" if adjoint else "k"
    rows_names = ("d_out", "z") if adjoint else ("v",)

    def body(refs):
        def chunk_at(k):   # the k-th chunk visited
            return nc - 1 - k if adjoint else k

        def operands(k):   # the raw tiles of the k-th chunk visited (k clamped: a harmless reload)
            t = pl.ds(chunk_at(jnp.minimum(k, nc - 1)) * L, L)
            got = {"adt": refs["adt"][t], key: refs[key][t, :]}
            got.update({n: refs[n][t, :] for n in rows_names if n in refs})
            return got

        def step(k, carry):
            x, cur = carry
            ahead = operands(k + 1)
            decay = chunk_decay(cur["adt"], geo)
            if adjoint:
                rows = cur["d_out"].astype(F32)
                if "z" in cur:
                    z = cur["z"].astype(F32)
                    rows = rows * z * gate_sigmoid(z, geo)
                rows = rows * decay.read[:, None]
            else:
                rows = cur["v"].astype(F32) * decay.to_end[:, None]
            local = dot(rows, cur[key], mm, trans_a=True)                  # [rows, Np]
            refs["each"][chunk_at(k)] = x.astype(refs["each"].dtype)
            return decay.chunk * x + local, ahead

        last = jax.lax.fori_loop(0, nc, step, (_start(refs, (grid.block_p, Np)), operands(0)))[0]
        if want_last:
            refs["last"][...] = last

    Np = geo.padded_state
    inputs = [(key, ops[key], grid.head_sequence_rows(Np)), ("adt", ops["adt"], grid.head_sequence())]
    inputs += [(n, ops.get(n), grid.head_sequence_block()) for n in rows_names]
    inputs.append(("boundary", boundary, grid.state()))
    out = layout.launch(body, geo, grid, inputs, _outputs(geo, grid, want_last),
                        "mamba3_siso_bwd_adjoint_walk" if adjoint else "mamba3_siso_fwd_state_walk",
                        walk_warps(geo.config, adjoint))
    return out["each"], out.get("last")


def walk_warps(config, adjoint: bool) -> int:
    """Triton warps of a walk launch: config.num_warps_adjoint_walk for the adjoint walk when set, else
    config.num_warps_walk."""
    if adjoint and config.num_warps_adjoint_walk is not None:
        return config.num_warps_adjoint_walk
    return config.num_warps_walk


def forward_state_pass(geo: ScanGeometry, ops: dict):
    """(states entering every chunk [Bt, H, nc, Pp, Np], final state [Bt, H, Pp, Np] f32).

    ops: as for chunk_contributions(adjoint=False), plus s0 [Bt, H, Pp, Np] f32 (S_0), or None for a zero
    initial state (the walk then starts from zeros and reads none).
    """
    if geo.config.state_passes == "walk":
        return walk_chunks(geo, ops, ops["s0"], adjoint=False)
    local = chunk_contributions(geo, ops, adjoint=False)
    return combine_chunks(geo, local, chunk_decays(geo, ops["adt"]), ops["s0"], reverse=False)


def adjoint_state_pass(geo: ScanGeometry, ops: dict, d_final, *, want_initial: bool = True):
    """(adjoints of the states leaving every chunk [Bt, H, nc, Pp, Np]: G_{c+1} for chunk c; adjoint
    of the augmented initial state [Bt, H, Pp, Np]: G_0, or None when not want_initial).

    ops: as for chunk_contributions(adjoint=True); d_final: [Bt, H, Pp, Np] f32 ∂L/∂S_final, or None
    (a zero cotangent: the final state unused); want_initial: False when there is no initial state to
    differentiate (G_0 is then not written).
    """
    if geo.config.state_passes == "walk":
        return walk_chunks(geo, ops, d_final, adjoint=True, want_last=want_initial)
    local = chunk_contributions(geo, ops, adjoint=True)
    return combine_chunks(geo, local, chunk_decays(geo, ops["adt"]), d_final, reverse=True, want_last=want_initial)
