"""The query/key gradient kernel on position-major tiles (Mamba3ScanConfig.qk_gradients_transposed).

Same math and outputs as qk_gradients.py (read its docstring first); only the orientation of the
per-head tiles differs. There, a head's dq, dk̃ and θ are [rows, width] tiles: Triton lays a
[64, 32] float32 tile out with the 8 warps over the rows (each warp holds whole rows), so every sum
over the rows (the six bias column sums per head, the chunk total of dθ) and the in-chunk reverse
prefix sum of dθ cross the warps through shared memory: 43 barriers per head
(benchmarks/triton_inspect.py, Triton 3.6, sm_90). Here every per-head tile is [width, rows], so a
warp holds whole columns: those sums and the prefix sums stay inside a warp (shuffles), and only the
sums over the columns (d s and d DT per position) cross the warps (27 barriers per head).

Where the tiles come from:
  dq, dk̃   position-major [Bt, H, Np, Tp] arrays, written so by the chunk-gradient launch that makes
           them (chunk_backward.py stores the transposed tile): a [width, rows] tile is a plain load;
  θ        recomputed from the chunk's entering angle and the increments, θ = wrap(θ_entry +
           Σ_{r <= t} inc_r), a prefix sum along the rows that also stays inside a warp; the forward
           then writes no θ ([Bt, Tp, H, Sp] float32: 50 MB per layer at the benchmark shape). Only
           when the block is a whole chunk (qk_grad_blocks = 1); otherwise the stored θ is loaded and
           transposed in the kernel. With config.stored_theta the forward stores θ position-major
           ([Bt, H, Sp, Tp]) and a head's tile is a plain load;
  Q, K     and the raw angles: XLA transposes them to position-major before the launch (the group
           rows are small; the angles are [Bt, Tp, Sp] when shared by the heads, the model's case).
           Transposing them in the kernel instead made Triton keep the biased rows in the transposed
           register layout and convert the products with them inside the head loop.
  outputs  dQ, dK are transposed in the kernel once per program (after the head loop); the per-head
           angle gradient (angles per head) is transposed in the kernel per head before its store,
           or with config.position_major_d_angles written position-major (the shared angles' too)
           and moved back by XLA, inside the sums that consume it. With config.angle_gradient_pass
           (per-head angles) the kernel reads neither the angles nor DT and writes the in-chunk
           reverse sums of dθ position-major instead of d angles and d DT (entry_angles.py finishes).
Outputs: exactly qk_gradients.py's kernel outputs, which that module finishes; with the angle gradient
pass d_inc (the in-chunk reverse sums of dθ, position-major) replaces d angles and d DT.
Numerics: float32 throughout; the sums over the rows run in another order than in qk_gradients.py,
and the recomputed θ may differ from the forward's in the last bit (its prefix sum runs along the
other axis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_math import (angle_gradient, angle_rate_and_slope, dot, rotate_back, rotation_of,
                                                  triangle, wrap_angle)
from pallas_kernels.mamba3_siso.config import ScanGeometry


def _prefix_over_columns(x, *, by_matmul, reverse=False):
    """Σ_{i' <= i} x[:, i'] (Σ_{i' >= i} with `reverse`) of a [width, rows] tile: the prefix sums over
    positions (a scan along the rows of each column, inside a warp), or as a dot with a triangular 0/1
    matrix (chunk_math.prefix_sum's by_matmul)."""
    if by_matmul:
        return dot(x, triangle(x.shape[1], upper=not reverse), F32)
    if reverse:
        return jnp.sum(x, axis=1, keepdims=True) - jnp.cumsum(x, axis=1) + x
    return jnp.cumsum(x, axis=1)


def _group_cols(grid: layout.GroupGrid):
    """[Bt, G, Np, Tp] (Q, K position-major): the block's [Np, rows]."""
    def index(p):
        b, c, g, _ = grid.index(p)
        return b, g, 0, c
    return pl.BlockSpec((None, None, grid.geo.padded_state, grid.block_rows), index)


def _shared_cols(grid: layout.GroupGrid, width):
    """[Bt, width, Tp] (angles shared by the heads, position-major): the block's [width, rows]."""
    return pl.BlockSpec((None, width, grid.block_rows), lambda p: (grid.index(p)[0], 0, grid.index(p)[1]))


def recomputes_theta(geo: ScanGeometry) -> bool:
    """Whether the transposed kernel forms θ itself (each program's block is a whole chunk and θ is not
    stored position-major: stored_theta / angle_gradient_pass), so the forward need not store it."""
    return geo.qk_grad_position_major and geo.qk_grad_rows == geo.chunk and not geo.theta_position_major


def query_key_gradients_transposed(geo: ScanGeometry, Q, K, Q_bias, K_bias, scale, angles, dt, theta, dq, dk,
                                   d_diagonal=None, theta_entry=None, qk_position_major=False):
    """The kernel of qk_gradients.query_key_gradients on position-major tiles.

    Args: as qk_gradients.query_key_gradients (Q, K [Bt, Tp, G, Np], or with qk_position_major already
      [Bt, G, Np, Tp]), except dq, dk [Bt, H, Np, Tp] position-major (the chunk
      launch's position-major output), and θ: the stored angles, [Bt, H, Sp, Tp] when
      `geo.theta_position_major`, else [Bt, Tp, H, Sp], or None with theta_entry [Bt, nc, H, Sp] (the
      chunk-entry angles) when `recomputes_theta(geo)`.

    Returns the kernel's outputs by name in qk_gradients.py's layouts (dQ, dK [Bt, Tp, G, splits, Np],
    d_scale, the bias and dθ_entry partials, d angles, d DT; with `geo.angle_pass` d_inc, the in-chunk
    reverse sums of dθ position-major, instead of d angles and d DT), which that module sums and finishes.
    """
    grid = layout.GroupGrid(geo, rows=geo.qk_grad_rows)
    pieces = geo.pieces
    rotated = angles is not None
    shared_angles = rotated and angles.shape[2] == 1
    recompute = rotated and theta is None
    if recompute and not recomputes_theta(geo):
        raise ValueError("query_key_gradients_transposed: θ can be recomputed only when a block is a whole chunk")
    theta_cols = theta is not None and geo.theta_position_major
    d_angles_cols = geo.config.position_major_d_angles
    angle_pass = rotated and geo.angle_pass     # d inc out, no angles or DT in: entry_angles.angle_gradients finishes
    if angle_pass and not theta_cols:
        raise ValueError("query_key_gradients_transposed: the angle gradient pass needs θ stored position-major")
    with_diagonal = d_diagonal is not None
    by_matmul = geo.angle_sums_by_matmul
    op_cols = lambda start, width: layout.piece_columns(geo, start, width)   # Q, K, biases, dQ, dK, bias partials

    def body(refs):
        def group_cols(ref):    # the block's group rows as [width, rows] pieces
            return {n: ref[op_cols(start, width), :].astype(F32) for n, start, width in pieces}

        def biased(cols, bias_ref, head):
            return {n: cols[n] + bias_ref[head, op_cols(start, width)][:, None] for n, start, width in pieces}

        q_cols, k_cols = group_cols(refs["Q"]), group_cols(refs["K"])
        # the shared rate π·tanh(angles) [Sp, rows]; its slope is formed after the head loop (not held through it)
        shared_rate = angle_rate_and_slope(refs["angles"][...])[0] if shared_angles else None

        def head_step(j, sums):
            dq_sum, dk_sum, d_rate_sum = sums
            rotation = None
            if rotated:
                if not angle_pass:
                    dt_j = refs["dt"][:, j][None, :]                                              # [1, rows]
                    rate_j, slope_j = ((shared_rate, None) if shared_angles
                                       else angle_rate_and_slope(refs["angles"][j, :, :]))
                if recompute:
                    inc = rate_j * dt_j
                    theta_j = wrap_angle(refs["theta_entry"][j, :][:, None]
                                         + _prefix_over_columns(inc, by_matmul=by_matmul))
                elif theta_cols:
                    theta_j = refs["theta"][j]
                else:
                    theta_j = refs["theta"][:, j, :].T
                rotation = rotation_of(theta_j, geo, backward=True)                             # [Sp, rows]
            s = refs["scale"][:, j][None, :]
            dq_h = {n: refs["dq"][j, pl.ds(start, width), :].astype(F32) for n, start, width in pieces}
            dk_h = {n: refs["dk"][j, pl.ds(start, width), :].astype(F32) for n, start, width in pieces}
            x, y = biased(q_cols, refs["Q_bias"], j), biased(k_cols, refs["K_bias"], j)
            gq, gk = rotate_back(dq_h, rotation), rotate_back(dk_h, rotation)
            # d s = Σ over the columns of ȳ·R(θ)ᵀdk̃: the pieces of one width are added elementwise first,
            # so that only one sum per width crosses the warps
            by_width = {}
            for n, _, width in pieces:
                term = y[n] * gk[n]
                by_width[width] = term if width not in by_width else by_width[width] + term
            d_scale = None
            for term in by_width.values():
                term = jnp.sum(term, axis=0)
                d_scale = term if d_scale is None else d_scale + term
            refs["d_scale"][:, j] = d_scale
            dq_sum, dk_sum = dict(dq_sum), dict(dk_sum)
            c = refs["d_diagonal"][:, j][None, :] if with_diagonal else None
            for n, start, width in pieces:
                dk_bar = s * gk[n]
                if with_diagonal:
                    gq[n] = gq[n] + c * y[n]
                    dk_bar = dk_bar + c * x[n]
                refs["dqb"][j, op_cols(start, width)] = jnp.sum(gq[n], axis=1)
                refs["dkb"][j, op_cols(start, width)] = jnp.sum(dk_bar, axis=1)
                dq_sum[n] = dq_sum[n] + gq[n]
                dk_sum[n] = dk_sum[n] + dk_bar
            if rotated:
                d_angle = angle_gradient(dq_h, x, rotation) + s * angle_gradient(dk_h, y, rotation)  # [Sp, rows]
                d_inc = _prefix_over_columns(d_angle, by_matmul=by_matmul, reverse=True)
                if angle_pass:
                    refs["d_inc"][j] = d_inc
                else:
                    refs["d_dt"][:, j] = jnp.sum(d_inc * rate_j, axis=0)
                    if shared_angles:
                        d_rate_sum = d_rate_sum + d_inc * dt_j
                    elif d_angles_cols:
                        refs["d_angles"][j] = d_inc * dt_j * slope_j
                    else:
                        refs["d_angles"][:, j, :] = (d_inc * dt_j * slope_j).T
                refs["d_theta_entry"][j, :] = jnp.sum(d_angle, axis=1)
            return dq_sum, dk_sum, d_rate_sum

        zeros = {n: jnp.zeros((w, grid.block_rows), F32) for n, _, w in pieces}
        rate_zeros = jnp.zeros((geo.angle_width, grid.block_rows), F32) if shared_angles else None
        dq_sum, dk_sum, d_rate_sum = jax.lax.fori_loop(0, grid.heads_per_slice, head_step,
                                                       (zeros, dict(zeros), rate_zeros))
        if shared_angles:
            d_rate = d_rate_sum * angle_rate_and_slope(refs["angles"][...])[1]
            refs["d_angles"][...] = d_rate if d_angles_cols else d_rate.T
        for n, start, width in pieces:
            refs["dQ"][:, op_cols(start, width)] = dq_sum[n].T.astype(refs["dQ"].dtype)
            refs["dK"][:, op_cols(start, width)] = dk_sum[n].T.astype(refs["dK"].dtype)

    bsz, G, Np = geo.batch, geo.groups, geo.padded_state
    Sp = geo.angle_width
    slices = (G, grid.splits, grid.heads_per_slice)
    per_slice = grid.per_slice_cols                                      # [Bt, H, w, Tp] -> [Bt, G, sl, hps, w, Tp] (free)
    positions_last = lambda x: jnp.moveaxis(x, 1, 3)                    # [Bt, Tp, G or H, w] -> [Bt, G or H, w, Tp]
    cols = (lambda x: x) if qk_position_major else positions_last     # XLA's transposes unless the forward's copies
    inputs = [("Q", cols(Q), _group_cols(grid)), ("K", cols(K), _group_cols(grid)),
              ("Q_bias", Q_bias.reshape(slices + (Np,)), grid.biases()),
              ("K_bias", K_bias.reshape(slices + (Np,)), grid.biases()),
              ("scale", grid.per_head(scale), grid.head_scalars()),
              ("dq", per_slice(dq), grid.head_cols(Np)), ("dk", per_slice(dk), grid.head_cols(Np)),
              ("theta",) + ((None, None) if theta is None else (per_slice(theta), grid.head_cols(Sp)) if theta_cols
                            else (grid.per_head(theta), grid.head_rows(Sp))),
              ("theta_entry", grid.per_head(theta_entry) if recompute else None, grid.per_chunk(Sp)),
              ("d_diagonal", None if d_diagonal is None else grid.per_head(d_diagonal.astype(F32)),
               grid.head_scalars())]
    if rotated and not angle_pass:
        if shared_angles:          # [Bt, Tp, 1, Sp] -> [Bt, Sp, Tp]
            inputs.append(("angles", jnp.swapaxes(angles[:, :, 0], 1, 2), _shared_cols(grid, Sp)))
        else:                      # [Bt, Tp, H, Sp] -> [Bt, H, Sp, Tp]
            inputs.append(("angles", per_slice(positions_last(angles)), grid.head_cols(Sp)))
        inputs.append(("dt", grid.per_head(dt), grid.head_scalars()))
    # one program per group (no partial sums for XLA to add): dQ, dK in Q's dtype, rounded once as before
    group_dtype = Q.dtype if grid.splits == 1 else F32
    outputs = kernel_outputs(grid, bsz, G, rotated=rotated, shared_angles=shared_angles, biases=True,
                             group_dtype=group_dtype)
    if angle_pass:                     # d inc [Bt, G, sl, hps, Sp, Tp] instead of d angles and d DT
        outputs = [(name, shape, spec) for name, shape, spec in outputs if name not in ("d_angles", "d_dt")]
        outputs.append(("d_inc", jax.ShapeDtypeStruct((bsz,) + slices + (Sp, geo.padded_seqlen), F32),
                        grid.head_cols(Sp)))
    elif rotated and d_angles_cols:      # [Bt, G, sl, (hps,) Sp, Tp]: moved back to kernel_outputs' layout below
        d_angles = ((bsz, G, grid.splits, Sp, geo.padded_seqlen), grid.slice_cols(Sp)) if shared_angles else \
            ((bsz,) + slices + (Sp, geo.padded_seqlen), grid.head_cols(Sp))
        outputs = [("d_angles", jax.ShapeDtypeStruct(d_angles[0], F32), d_angles[1]) if name == "d_angles"
                   else (name, shape, spec) for name, shape, spec in outputs]
    out = layout.launch(body, geo, grid, inputs, outputs, "mamba3_siso_bwd_query_key_gradients_t",
                        geo.config.num_warps_qk_grad)
    if rotated and d_angles_cols and not angle_pass:
        out["d_angles"] = jnp.moveaxis(out["d_angles"], -1, 1)
    return out


def kernel_outputs(grid: layout.GroupGrid, bsz, G, *, rotated, shared_angles, biases, group_dtype=F32):
    """The (name, ShapeDtypeStruct, BlockSpec) outputs of both query/key gradient kernels (this module's
    and qk_gradients.py's, which write the same arrays): the slice's dQ, dK rows (in `group_dtype`), d s
    per head, the per-block bias partials (`biases`), and with angles d angles (per slice when shared by
    the heads, per head otherwise), d DT and the per-block dθ_entry partials; the rest float32."""
    geo = grid.geo
    Tp, Np, Sp = geo.padded_seqlen, geo.padded_state, geo.angle_width
    slices = (G, grid.splits, grid.heads_per_slice)
    slice_sums = jax.ShapeDtypeStruct((bsz, Tp, G, grid.splits, Np), group_dtype)
    outputs = [("dQ", slice_sums, grid.slice_rows()), ("dK", slice_sums, grid.slice_rows()),
               ("d_scale", jax.ShapeDtypeStruct((bsz, Tp) + slices, F32), grid.head_scalars())]
    if biases:
        partials = jax.ShapeDtypeStruct((bsz, grid.blocks) + slices + (Np,), F32)
        outputs += [("dqb", partials, grid.per_chunk(Np)), ("dkb", partials, grid.per_chunk(Np))]
    if rotated:
        d_angles = ((jax.ShapeDtypeStruct((bsz, Tp, G, grid.splits, Sp), F32), grid.slice_rows(Sp)) if shared_angles
                    else (jax.ShapeDtypeStruct((bsz, Tp) + slices + (Sp,), F32), grid.head_rows(Sp)))
        outputs += [("d_angles",) + d_angles,
                    ("d_dt", jax.ShapeDtypeStruct((bsz, Tp) + slices, F32), grid.head_scalars()),
                    ("d_theta_entry", jax.ShapeDtypeStruct((bsz, grid.blocks) + slices + (Sp,), F32),
                     grid.per_chunk(Sp))]
    return outputs
