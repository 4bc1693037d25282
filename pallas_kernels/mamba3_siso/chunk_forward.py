"""Forward chunk kernel of the Mamba-3 SISO scan: every chunk's output from its entering state.

Why: with the state S_c entering chunk c known (state_passes.forward_state_pass), the chunks are
independent, so one program per (batch row, chunk, head) computes docs/mamba3_siso.md §4.3 with three tensor-core
dots:

    Y = diag(e^{cs})·Q·S_cᵀ + ((Q·K̃ᵀ) ⊙ Λ)·V + diag(skip)·V,     out = Y ⊙ silu(Z)  (if Z)

with Q the biased rotated queries and K̃ = s·(rotated biased keys) of this head (formed in the dot
operand dtype by queries_keys.head_queries_keys_kernel), Λ_ij = e^{cs_i − cs_j}[i > j] and skip = D + γ⟨q̄, k̄⟩ (per position: ⟨q̄, k̄⟩
from the query/key kernel, one elementwise op in core.py).

Numerics: decays, the gate and every accumulation are float32; dot operands are in `matmul_dtype`
(bf16 for bf16 activations: Q, K̃, the scores ⊙ Λ, V and S_c, as the official kernel does; exact
float32 for float32 activations); `out` is rounded once to V's dtype.
HBM: one pass, reading Q, K̃, V, Z, two per-position scalars and one stored state per chunk; writing out
(and, for the backward when the config asks, the masked scores and the ungated Y: chunk_backward.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.dtypes import F32
from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_math import ChunkDecay, chunk_decay, dot, gate_sigmoid
from pallas_kernels.mamba3_siso.config import ScanGeometry


def chunk_inputs(geo: ScanGeometry, grid: layout.ChunkGrid, ops: dict, names) -> list:
    """(name, array, BlockSpec) of the chunk-grid operands among `names` (absent ones skipped)."""
    specs = {"q": grid.head_rows(geo.padded_state), "k": grid.head_rows(geo.padded_state),
             "v": grid.head_rows(geo.padded_headdim), "z": grid.head_rows(geo.padded_headdim),
             "d_out": grid.head_rows(geo.padded_headdim), "adt": grid.sequence(),
             # per position [Bt, Tp, H], or one weight per head [H, 1] (D alone: skip_in_scores)
             "skip": grid.head_vector(1) if ops.get("skip") is not None and ops["skip"].ndim == 2 else grid.sequence(),
             "scores": grid.head_rows(geo.chunk), "ungated": grid.head_rows(geo.padded_headdim),
             "diag_weight": grid.sequence()}
    return [(n, ops[n], specs[n]) for n in names if ops.get(n) is not None]


def chunk_output(geo: ScanGeometry, decay: ChunkDecay, lam, q, k, v, skip, state):
    """(Y [L, Pp] float32, the masked scores (Q·K̃ᵀ) ⊙ Λ [L, L] float32) of one chunk.

    q, k: [L, Np] queries and scaled keys; v: [L, Pp] in its own dtype; skip: [L] (or [1]: one weight for the head); state: [Pp, Np].
    """
    mm = geo.matmul_dtype
    scores = dot(q, k, mm, trans_b=True) * lam
    q_state = dot(q, state, mm, trans_b=True)
    return dot(scores, v, mm) + decay.read[:, None] * q_state + skip[:, None] * v.astype(F32), scores


def stores(geo: ScanGeometry, for_backward: bool) -> tuple:
    """Names of the products the forward keeps for the values (and, with config.stored_for_keys, keys)
    gradient launches (config.stored_scores, stored_ungated): "scores" and/or "ungated", only when a
    backward will run."""
    if not for_backward:
        return ()
    cfg = geo.config
    return (("scores",) if cfg.stored_scores else ()) + (("ungated",) if cfg.stored_ungated and geo.has_z else ())


def chunk_outputs(geo: ScanGeometry, ops: dict, entering, *, for_backward: bool = False):
    """The chunk outputs (after the state pass).

    Args:
      ops: q, k [Bt, Tp, H, Np] (dot operand dtype), v, z (or None) [Bt, Tp, H, Pp], adt, skip [Bt, Tp, H] (or [H, 1], D alone).
      entering: [Bt, H, nc, Pp, Np] states entering each chunk.
      for_backward: also return the products `stores` names, for the backward.

    Returns:
      (out [Bt, Tp, H, Pp] in V's dtype, dict of the stored products: "scores" [Bt, Tp, H, L] (row i of
      chunk c is row i of that chunk's masked scores) in the dot operand dtype (float32 with
      config.stored_for_keys), "ungated" [Bt, Tp, H, Pp] float32 Y before the gate).
    """
    grid = layout.ChunkGrid(geo)
    kept = stores(geo, for_backward)

    def body(refs):
        decay = chunk_decay(refs["adt"][...], geo)
        lam = decay.lower(refs["diag_weight"][...] if "diag_weight" in refs else None)
        y, scores = chunk_output(geo, decay, lam, refs["q"][...], refs["k"][...], refs["v"][...],
                                 refs["skip"][...], refs["state"][...])
        if "scores" in kept:
            refs["scores"][...] = scores.astype(refs["scores"].dtype)
        if "ungated" in kept:
            refs["ungated"][...] = y
        if geo.has_z:
            z = refs["z"][...].astype(F32)
            y = y * (z * gate_sigmoid(z, geo))
        refs["out"][...] = y.astype(refs["out"].dtype)

    inputs = chunk_inputs(geo, grid, ops, ["q", "k", "v", "z", "adt", "skip", "diag_weight"])
    inputs.append(("state", entering, grid.chunk_state()))
    bsz, Tp, H, Pp = geo.batch, geo.padded_seqlen, geo.heads, geo.padded_headdim
    outputs = [("out", jax.ShapeDtypeStruct((bsz, Tp, H, Pp), jnp.dtype(geo.io_dtype)), grid.head_rows(Pp))]
    if "scores" in kept:
        scores_dtype = F32 if geo.config.stored_for_keys else jnp.dtype(geo.matmul_dtype)
        outputs.append(("scores", jax.ShapeDtypeStruct((bsz, Tp, H, geo.chunk), scores_dtype),
                        grid.head_rows(geo.chunk)))
    if "ungated" in kept:
        outputs.append(("ungated", jax.ShapeDtypeStruct((bsz, Tp, H, Pp), F32), grid.head_rows(Pp)))
    out = layout.launch(body, geo, grid, inputs, outputs, "mamba3_siso_fwd_chunk_outputs", geo.config.num_warps_chunk)
    return out["out"], {n: out[n] for n in kept}
