"""Stitching chunks together: the short sequential scan over chunk boundaries (a tiny Pallas kernel).

Forward:  H_0 = h_{-1};            H_{j+1} = P_j·H_j + Q_j      (H_j = state entering chunk j)
Adjoint:  G_{nc-1} = λ;            G_{j-1} = P_j·G_j + R_j      (G_j = adjoint entering chunk j from the
          right, R_j = ā_first·dh_first of chunk j from a zero right boundary; G_{-1} = ∂h_{-1})

with P_j = exp(A·S_j) (S_j = Σ δ over chunk j), or 0 when a reset falls inside chunk j. Both are the
same recurrence walked in opposite directions, so one kernel serves both.

Why a kernel rather than XLA: the chain is nc steps long (32 for T = 2048 at chunk 64); an XLA while
loop pays a launch per step, an unrolled chain or associative scan several; this is one launch whose
programs (batch row, channel block) each walk the nc chunks with the state in registers.
Numerics: float32 throughout; each output is written once (deterministic). Reads Q/R and S once,
writes one state per chunk: 1/chunk of the [Bt, T, d, n] expansion.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.dtypes import F32
from pallas_kernels.selective_scan import layout
from pallas_kernels.selective_scan.channels import ChannelAccess, zero_operand
from pallas_kernels.selective_scan.config import ScanProblem



def chunk_states(problem: ScanProblem, A_t, local, delta_sums, keep_chunk, boundary, *, reverse: bool):
    """Walks the chunk recurrence.

    Args:
      A_t: [n, d] f32: A transposed and scaled by log2(e) (P_j = exp2(A_t·S_j)).
      local: [Bt, nc, n, d] f32: Q_j (forward) or R_j (adjoint).
      delta_sums: [Bt, nc, d] f32: S_j.
      keep_chunk: [Bt, nc] f32: 0.0 where chunk j holds a reset, else 1.0; or None (no resets).
      boundary: [Bt, n, d] f32: h_{-1} (forward) or the final-state cotangent λ (adjoint).
      reverse: False for the forward recurrence, True for the adjoint.

    Returns:
      (entering [Bt, nc, n, d] f32, last [Bt, n, d] f32): the value entering each chunk (H_j or G_j)
      and the value leaving the walk (the final state h_{T-1}, or ∂h_{-1}).
    """
    bsz, nc, n, d = local.shape
    bd = problem.config.block_d
    has_reset = keep_chunk is not None

    def body(refs):
        ch = ChannelAccess(problem, refs)
        A = ch.load("A_t")

        def step(k, h):
            j = nc - 1 - k if reverse else k
            ch.store("entering", h, j)
            p = jnp.exp2(A * ch.load("S", j)[None, :])
            if has_reset:
                p = p * refs["keep"][j]
            return p * h + ch.load("local", j)

        ch.store("last", jax.lax.fori_loop(0, nc, step, ch.load("boundary")))

    grid = problem.grid(bsz, per_chunk=False)
    inputs = [
        ("A_t", A_t, grid.transposed_A(n, bd)),
        ("local", local, grid.all_chunk_states(nc, n, bd)),
        ("S", delta_sums, grid.all_chunk_vectors(nc, bd)),
        ("boundary", boundary, grid.state(n, bd)),
    ]
    if has_reset:
        inputs.append(("keep", keep_chunk, grid.all_chunk_flags(nc)))
    if zero_operand(problem, grid):
        inputs.append(zero_operand(problem, grid))
    out = layout.launch(
        body, problem, grid, inputs,
        [("entering", jax.ShapeDtypeStruct((bsz, nc, n, d), F32), grid.all_chunk_states(nc, n, bd)),
         ("last", jax.ShapeDtypeStruct((bsz, n, d), F32), grid.state(n, bd))],
        "selective_scan_adjoint_chunk_combine" if reverse else "selective_scan_fwd_chunk_combine")
    return out["entering"], out["last"]
