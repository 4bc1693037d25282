"""A time-parallel variant of the forward's chunk-outputs pass (`ScanBlockConfig.fwd_parallel`).

`forward.chunk_outputs` walks its chunk one position at a time (one dependent step per position and
lane: latency bound, benchmarks/notes_selective_scan.md). This kernel loads the whole [chunk, block_d]
tiles of u, delta, z at once and, for each state index k < n, forms the chunk's decays and inputs
  a_t = exp2(δ_t·A2[k]) (0 at a reset),  b_t = δ_t·u_t·B_t[k]
and runs the recurrence h_t = a_t·h_{t-1} + b_t as one parallel prefix over time
(`pallas_kernels.common.affine_scan`, a Triton `tt.scan`), from the chunk's true start state H[k]:
  h_t[k] = Hscan_t + Acum_t·H[k],   y_t += h_t[k]·C_t[k]
then out_t = (y_t + D·u_t)·silu(z_t), stored as one tile. The official CUDA kernel has this structure
(a block scan over (a, b) pairs, one state index at a time).

Numerics: float32 as in `forward.chunk_outputs`; the partial products are combined in the scan's tree
order and y accumulates over k in order, so results differ from the serial kernel by rounding only.

Status (2026-12-01): matches the serial kernel under the CPU interpreter and lowers for an abstract
H200 (tests/test_selective_scan_pallas.py); **not yet run or timed on the GPU** — off by default,
`bash benchmarks/gpu_session.sh scan_parallel` times it (`--sweep-set parallel`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.affine_scan import affine_scan
from pallas_kernels.common.dtypes import F32
from pallas_kernels.selective_scan import layout
from pallas_kernels.selective_scan.channels import ChannelAccess
from pallas_kernels.selective_scan.config import ScanProblem
from pallas_kernels.selective_scan.forward import common_inputs
from pallas_kernels.selective_scan.kernel_math import sigmoid, time_step


def chunk_outputs_parallel(problem: ScanProblem, ops: dict, chunk_start_states):
    """Same contract as `forward.chunk_outputs` (padded operands, chunk-start states -> out [Bt, Tp, d])."""
    cfg = problem.config
    bsz, _, d = ops["u"].shape
    n, bd, chunk = problem.n, cfg.block_d, cfg.chunk
    grid = problem.grid(bsz)

    def body(refs):
        acc = ChannelAccess(problem, refs)
        u = acc.load("u").astype(F32)                                       # [chunk, bd]
        raw = acc.load("delta").astype(F32)
        if problem.has_bias:
            raw = raw + acc.load("bias").astype(F32)[None, :]
        dl = time_step(raw, None, problem.softplus)
        if problem.has_time_padding:
            start = grid.chunk(pl.program_id(0)) * chunk
            pos = start + jax.lax.broadcasted_iota(jnp.int32, (chunk, bd), 0)
            dl = jnp.where(pos < problem.seqlen, dl, 0.0)
        keep = refs["keep"][...][:, None] if problem.has_reset else None   # [chunk, 1]
        du = dl * u
        y = jnp.zeros((chunk, bd), F32)
        for k in range(n):
            a = jnp.exp2(dl * acc.load("A_t", k).astype(F32)[None, :])
            if keep is not None:
                a = a * keep
            b = du * refs["B"][:, k].astype(F32)[:, None]
            a_cum, h = affine_scan(a, b, axis=0)
            h = h + a_cum * acc.load("H", k)[None, :]
            y = y + h * refs["C"][:, k].astype(F32)[:, None]
        if problem.has_D:
            y = y + acc.load("D").astype(F32)[None, :] * u
        if problem.has_z:
            z = acc.load("z").astype(F32)
            y = y * (z * sigmoid(z))
        acc.store("out", y)

    out = layout.launch(
        body, problem, grid,
        common_inputs(problem, grid, ops, ("u", "delta", "z", "B", "C", "A_t", "D", "bias", "keep"))
        + [("H", chunk_start_states, grid.chunk_state(n, bd))],
        [("out", jax.ShapeDtypeStruct((bsz, problem.padded_seqlen, d), ops["u"].dtype), grid.rows(chunk, bd))],
        "selective_scan_fwd_chunk_outputs_parallel", num_warps=cfg.parallel_num_warps)
    return out["out"]
