"""Forward chunk kernel of the Mamba-3 SISO scan: every chunk's output from its entering state.

Why: with the state S_c entering chunk c known (state_passes.forward_state_pass), the chunks are
independent, so one program per (batch row, chunk, head) computes spec §4.3 with tensor-core dots:

    Y = diag(e^{cs})·Q·S_cᵀ + ((Q·K̃ᵀ) ⊙ Λ)·V + diag(skip)·V,     out = Y ⊙ silu(Z)  (if Z)

with Q, K the biased keys/queries rotated in the kernel (RoPE angle θ = θ_entry + within-chunk
cumulative sum of the increments, wrapped mod 2π), K̃ = s·K, Λ_ij = e^{cs_i − cs_j}[i > j] and
skip = D + γ⟨q̄, k̄⟩ (precomputed per position by the glue).

Numerics: biases, rotation, decays, the gate and every accumulation are float32; dot operands are
rounded to `matmul_dtype` (bf16 for bf16 activations: Q, K̃, the scores ⊙ Λ, V and S_c, as the
official kernel does; exact float32 for float32 activations); `out` is rounded once to V's dtype.
HBM: one pass, reading Q, K (group rows, shared by the heads of a group through L2), V, Z, the
per-position scalars, the angle increments and one stored state per chunk; writing out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_math import (
    F32, ChunkDecay, biased_parts, chunk_rotation, dot, rotate, sigmoid, sum_over_parts)
from pallas_kernels.mamba3_siso.config import ScanGeometry


def chunk_inputs(geo: ScanGeometry, grid: layout.ChunkGrid, ops: dict, names) -> list:
    """(name, array, BlockSpec) of the chunk-grid operands among `names` (absent ones skipped)."""
    specs = {
        "v": grid.head_rows(), "z": grid.head_rows(), "d_out": grid.head_rows(),
        "adt": grid.sequence(), "scale": grid.sequence(), "skip": grid.sequence(),
    }
    if geo.has_angles:
        specs.update(inc=grid.angle_rows(), theta=grid.chunk_angle())
    for name, width in geo.parts:
        for prefix in ("q", "k"):
            specs[f"{prefix}_{name}"] = grid.group_rows(width)
            specs[f"{prefix}b_{name}"] = grid.bias(width)
    out = []
    for n in names:
        if n in ("inc", "theta") and not geo.has_angles:
            continue
        if ops.get(n) is not None:
            out.append((n, ops[n], specs[n]))
    return out


def query_key_names(geo: ScanGeometry):
    return [f"{prefix}{suffix}_{name}" for name in geo.part_names for prefix in ("q", "k") for suffix in ("", "b")]


class ChunkOperands:
    """The recomputed per-chunk quantities both chunk kernels start from (float32).

    Attributes:
      decay: ChunkDecay of the chunk; lam: [L, L] Λ.
      rotation: (cos θ, sin θ) [L, Sp] or None (no angles).
      q_bar, k_bar: {part: [L, w]} biased, unrotated queries / keys.
      q, k: {part: [L, w]} rotated; k_scaled: s·k.
      scale, skip: [L].
    """

    def __init__(self, geo: ScanGeometry, refs):
        self.decay = ChunkDecay(refs["adt"][...])
        self.lam = self.decay.strictly_lower()
        self.rotation = chunk_rotation(refs["inc"][...], refs["theta"][...]) if geo.has_angles else None
        self.q_bar = biased_parts(refs, "q", geo.part_names)
        self.k_bar = biased_parts(refs, "k", geo.part_names)
        self.q = rotate(self.q_bar, self.rotation)
        self.k = rotate(self.k_bar, self.rotation)
        self.scale = refs["scale"][...]
        self.skip = refs["skip"][...]
        self.k_scaled = {n: x * self.scale[:, None] for n, x in self.k.items()}


def chunk_output(geo: ScanGeometry, x: ChunkOperands, v, states):
    """(Y [L, Pp] float32, masked scores (Q·K̃ᵀ)⊙Λ [L, L], Q·S_cᵀ [L, Pp]) of one chunk.

    v: [L, Pp] in its own dtype; states: {part: [Pp, w]} entering state.
    """
    mm = geo.matmul_dtype
    scores = sum_over_parts(dot(x.q[n], x.k_scaled[n], mm, trans_b=True) for n in geo.part_names) * x.lam
    q_state = sum_over_parts(dot(x.q[n], states[n], mm, trans_b=True) for n in geo.part_names)
    y = (dot(scores, v, mm) + x.decay.read[:, None] * q_state + x.skip[:, None] * v.astype(F32))
    return y, scores, q_state


def chunk_outputs(geo: ScanGeometry, ops: dict, entering: dict):
    """Pass 2 of the forward: out [Bt, Tp, H, Pp] in V's dtype.

    Args:
      ops: q_/k_{part} [Bt, Tp, G, w], qb_/kb_{part} [H, w], v, z (or None) [Bt, Tp, H, Pp],
        adt, scale, skip [Bt, H, Tp], inc [Bt, H, Tp, Sp], theta [Bt, H, nc, Sp].
      entering: {part: [Bt, H, nc, Pp, w]} states entering each chunk.
    """
    grid = layout.ChunkGrid(geo)

    def body(refs):
        x = ChunkOperands(geo, refs)
        v = refs["v"][...]
        y, _, _ = chunk_output(geo, x, v, {n: refs[f"s_{n}"][...] for n in geo.part_names})
        if geo.has_z:
            z = refs["z"][...].astype(F32)
            y = y * (z * sigmoid(z))
        refs["out"][...] = y.astype(refs["out"].dtype)

    inputs = chunk_inputs(geo, grid, ops, query_key_names(geo) + ["v", "z", "adt", "scale", "skip", "inc", "theta"])
    inputs += [(f"s_{n}", entering[n], grid.chunk_state(w)) for n, w in geo.parts]
    out = layout.run_kernel(
        body, geo, grid, inputs,
        [("out", jax.ShapeDtypeStruct((geo.batch, geo.padded_seqlen, geo.heads, geo.padded_headdim),
                                      jnp.dtype(geo.io_dtype)), grid.head_rows())],
        "mamba3_siso_fwd_chunk_outputs", geo.config.num_warps_chunk)
    return out["out"]
