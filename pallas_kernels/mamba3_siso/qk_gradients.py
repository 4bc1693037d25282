"""Query/key gradient kernel of the Mamba-3 SISO scan: from the per-head gradients of the chunk
kernels' operands q, k̃ back to Q, K, the biases, the trapezoid scale and the RoPE angles.

Why a kernel: per head h of group g, with x̄ = Q[g] + Q_bias[h] (likewise ȳ for keys), q = R(θ)x̄ and
k̃ = s·R(θ)ȳ (queries_keys.py), the backward is

    dx̄_h = R(θ)ᵀ dq_h                          dQ[g]  = Σ_{h in g} dx̄_h,     dQ_bias[h] = Σ_{b,t} dx̄_h
    dȳ_h = s·R(θ)ᵀ dk̃_h                        dK[g]  = Σ_{h in g} dȳ_h,     dK_bias[h] = Σ_{b,t} dȳ_h
    ds_h = ⟨ȳ_h, R(θ)ᵀ dk̃_h⟩                   dθ_h   = ∂θ⟨dq_h, R(θ)x̄_h⟩ + s·∂θ⟨dk̃_h, R(θ)ȳ_h⟩

plus, when the skip term's inner product ⟨x̄_h, ȳ_h⟩ (queries_keys.head_diagonal) has a gradient c_h
(d_diagonal = γ·d skip), c_h·ȳ_h in dx̄_h and c_h·x̄_h in dȳ_h (the rotation leaves it unchanged, so
dθ gets nothing from it)

and, with θ_t = (θ_entry + Σ_{r <= t in the chunk} inc_r) mod 2π (written by the forward kernel, so
only the reverse prefix sum is formed here), d inc_t = Σ_{t' >= t in the chunk} dθ_t' and
dθ_entry = Σ_{chunk} dθ. The increments are inc_h = rate·DT_h with rate = π·tanh(angles) of the op's
raw angles (formed here from the angles, as in the forward kernel), so the kernel returns
d DT_h = ⟨d inc_h, rate⟩ and d angles = π(1 − tanh² angles)·Σ_h d inc_h·DT_h (summed over the slice's
heads when the angles are shared by the heads, per head otherwise): neither d inc ([Bt, T, H, S]
float32) nor d rate is written.

XLA's autodiff of queries_keys.head_queries_keys took ~1.25 ms for this at the benchmark shape (docs/performance.md) (several
passes over the 400 MB of float32 per-head gradients). Here one program per (batch row, block of
positions, group, slice of the group's heads) (layout.GroupGrid) reads each per-head gradient once,
walks the heads of its slice with a loop and keeps the slice's sums in registers; the rotation is elementwise between the even and
odd pieces of the kernel layout, loaded as column blocks of the refs.

A block is a chunk, or with Mamba3ScanConfig.qk_grad_blocks > 1 a power-of-two share of its rows
(fewer registers per program, more programs): the reverse sum of dθ then runs within the block, and
XLA adds the totals of the chunk's later blocks to d DT and d angles afterwards (`_add_later_blocks`).

Outputs per program: the slice's share of the dQ, dK rows, ds and dθ per head, and the block's share
of the bias gradients and of dθ_entry (the shares are summed by XLA in a fixed order: deterministic,
no atomics). Numerics: float32 throughout.
The pure-JAX reference is the VJP of queries_keys.head_queries_keys ∘ queries_keys.position_angles
(and of queries_keys.head_diagonal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_math import (angle_gradient, angle_rate_and_slope, reverse_cumsum, rotate_back,
                                                  rotation_of)
from pallas_kernels.mamba3_siso.config import ScanGeometry
from pallas_kernels.mamba3_siso.qk_gradients_transposed import kernel_outputs, query_key_gradients_transposed
from pallas_kernels.mamba3_siso.queries_keys import angles_operand


def query_key_gradients(geo: ScanGeometry, Q, K, Q_bias, K_bias, scale, angles, dt, theta, dq, dk, d_diagonal=None,
                        theta_entry=None, qk_position_major=False):
    """Args (kernel layout, config.py; Q, K, their biases and dQ, dK, dQ_bias, dK_bias in the op's d_state
    order instead with `geo.qk_op_order`):
      Q, K: [Bt, Tp, G, Np] activation dtype; Q_bias, K_bias: [H, Np] float32; scale: [Bt, Tp, H] float32;
      angles: [Bt, Tp, 1 or H, Sp], dt: [Bt, Tp, H] and theta: [Bt, Tp, H, Sp] float32 (the op's raw
        angles and DT, as for queries_keys.head_queries_keys_kernel, and the wrapped angle at every
        position, the forward kernel's or queries_keys.position_angles), or all None (no angles);
      dq, dk: [Bt, Tp, H, Np] gradients of q, k̃ (float32, or the dot operand dtype: read as float32).
      d_diagonal: [Bt, Tp, H] float32 gradient of ⟨q̄_h, k̄_h⟩ (queries_keys.head_diagonal), or None (no
        such term): adds d_diagonal·k̄_h to dx̄_h and d_diagonal·q̄_h to dȳ_h, hence to dQ, dK and the biases.
      qk_position_major: Q, K are given position-major, [Bt, G, Np, Tp] (the forward kernel's copies,
        config.qk_columns_from_forward; only for the position-major kernel).
      With config.qk_gradients_transposed (qk_gradients_transposed.py): dq, dk are [Bt, H, Np, Tp]
        (position-major), and θ may be None with theta_entry [Bt, nc, H, Sp] (θ recomputed there) or,
        with config.stored_theta, position-major [Bt, H, Sp, Tp].

    Returns:
      (dQ, dK [Bt, Tp, G, Np] float32 (Q's dtype from the position-major kernel when one program owns a
       group's heads, qk_head_splits), dQ_bias, dK_bias [H, Np] float32, d_scale [Bt, Tp, H] float32,
       d_angles (angles' shape), d_dt [Bt, Tp, H] and d_theta_entry [Bt, nc, H, Sp] float32, or all three
       None). With `geo.angle_pass` (config.angle_gradient_pass) d_angles is the in-chunk reverse sums of
       dθ, position-major [Bt, H, Sp, Tp], and d_dt is None: entry_angles.angle_gradients finishes them.
    """
    grid = layout.GroupGrid(geo, rows=geo.qk_grad_rows)
    pieces = geo.pieces
    rotated = angles is not None
    shared_angles = rotated and angles.shape[2] == 1
    with_diagonal = d_diagonal is not None
    biases_in_kernel = not geo.config.bias_gradients_by_xla

    def body(refs):
        def load(ref, name, head=None):
            _, start, width = next(x for x in pieces if x[0] == name)
            cols = pl.ds(start, width)
            return (ref[:, cols] if head is None else ref[:, head, cols]).astype(F32)

        def biased(rows, bias_ref, head):
            return {n: rows[n] + bias_ref[head, pl.ds(start, width)][None, :] for n, start, width in pieces}

        q_rows = {n: load(refs["Q"], n) for n, _, _ in pieces}
        k_rows = {n: load(refs["K"], n) for n, _, _ in pieces}
        shared = angle_rate_and_slope(refs["angles"][...]) if shared_angles else None          # 2 × [L, Sp]

        def head_step(j, sums):
            dq_sum, dk_sum, d_rate_sum = sums
            rotation = None
            if rotated:
                angle = refs["theta"][:, j, :]
                rotation = rotation_of(angle, geo, backward=True)
            s = refs["scale"][:, j]
            dq_h = {n: load(refs["dq"], n, j) for n, _, _ in pieces}
            dk_h = {n: load(refs["dk"], n, j) for n, _, _ in pieces}
            x, y = biased(q_rows, refs["Q_bias"], j), biased(k_rows, refs["K_bias"], j)
            gq, gk = rotate_back(dq_h, rotation), rotate_back(dk_h, rotation)
            d_scale = None
            dq_sum, dk_sum = dict(dq_sum), dict(dk_sum)
            c = refs["d_diagonal"][:, j][:, None] if with_diagonal else None
            for n, start, width in pieces:
                term = jnp.sum(y[n] * gk[n], axis=1)
                d_scale = term if d_scale is None else d_scale + term
                dk_bar = s[:, None] * gk[n]
                if with_diagonal:
                    gq[n] = gq[n] + c * y[n]
                    dk_bar = dk_bar + c * x[n]
                if biases_in_kernel:
                    refs["dqb"][j, pl.ds(start, width)] = jnp.sum(gq[n], axis=0)
                    refs["dkb"][j, pl.ds(start, width)] = jnp.sum(dk_bar, axis=0)
                dq_sum[n] = dq_sum[n] + gq[n]
                dk_sum[n] = dk_sum[n] + dk_bar
            refs["d_scale"][:, j] = d_scale
            if rotated:
                d_angle = angle_gradient(dq_h, x, rotation) + s[:, None] * angle_gradient(dk_h, y, rotation)
                block_total = jnp.sum(d_angle, axis=0)                                          # [Sp]
                d_inc = (reverse_cumsum(d_angle, axis=0, by_matmul=True) if geo.angle_sums_by_matmul
                         else block_total[None, :] - jnp.cumsum(d_angle, axis=0) + d_angle)    # [rows, Sp]
                dt_j = refs["dt"][:, j]
                rate_j, slope_j = shared if shared_angles else angle_rate_and_slope(refs["angles"][:, j, :])
                refs["d_dt"][:, j] = jnp.sum(d_inc * rate_j, axis=1)
                if shared_angles:
                    d_rate_sum = d_rate_sum + d_inc * dt_j[:, None]
                else:
                    refs["d_angles"][:, j, :] = d_inc * dt_j[:, None] * slope_j
                refs["d_theta_entry"][j, :] = block_total
            return dq_sum, dk_sum, d_rate_sum

        zeros = {n: jnp.zeros((grid.block_rows, w), F32) for n, _, w in pieces}
        rate_zeros = jnp.zeros((grid.block_rows, geo.angle_width), F32) if shared_angles else None
        dq_sum, dk_sum, d_rate_sum = jax.lax.fori_loop(0, grid.heads_per_slice, head_step,
                                                       (zeros, dict(zeros), rate_zeros))
        if shared_angles:
            refs["d_angles"][...] = d_rate_sum * shared[1]
        for n, start, width in pieces:
            refs["dQ"][:, pl.ds(start, width)] = dq_sum[n]
            refs["dK"][:, pl.ds(start, width)] = dk_sum[n]

    bsz, Tp, G, Np = geo.batch, geo.padded_seqlen, geo.groups, geo.padded_state
    H, Sp = geo.heads, geo.angle_width
    if qk_position_major and not geo.qk_grad_position_major:
        raise ValueError("query_key_gradients: Q, K position-major need the position-major kernel")
    nc, nb = geo.n_chunks, grid.blocks // geo.n_chunks

    if geo.qk_grad_position_major:
        out = query_key_gradients_transposed(geo, Q, K, Q_bias, K_bias, scale, angles, dt, theta, dq, dk, d_diagonal,
                                             theta_entry, qk_position_major=qk_position_major)
    else:
        slices = (G, grid.splits, grid.heads_per_slice)
        inputs = [("Q", Q, grid.group_rows()), ("K", K, grid.group_rows()),
                  ("Q_bias", Q_bias.reshape(slices + (Np,)), grid.biases()),
                  ("K_bias", K_bias.reshape(slices + (Np,)), grid.biases()),
                  ("scale", grid.per_head(scale), grid.head_scalars()),
                  ("dq", grid.per_head(dq), grid.head_rows(Np)), ("dk", grid.per_head(dk), grid.head_rows(Np)),
                  ("theta", None if theta is None else grid.per_head(theta), grid.head_rows(Sp)),
                  ("d_diagonal", None if d_diagonal is None else grid.per_head(d_diagonal.astype(F32)),
                   grid.head_scalars())]
        if rotated:
            inputs += [angles_operand(grid, angles), ("dt", grid.per_head(dt), grid.head_scalars())]
        outputs = kernel_outputs(grid, bsz, G, rotated=rotated, shared_angles=shared_angles, biases=biases_in_kernel)
        out = layout.launch(body, geo, grid, inputs, outputs, "mamba3_siso_bwd_query_key_gradients",
                            geo.config.num_warps_qk_grad)

    d_angles = d_dt = d_entry = None
    if rotated and geo.angle_pass:      # the in-chunk sums of dθ, [Bt, H, Sp, Tp]: entry_angles.angle_gradients
        d_angles = out["d_inc"].reshape(bsz, H, Sp, Tp)
        d_entry = out["d_theta_entry"].reshape(bsz, nc, H, Sp)
    elif rotated:
        d_angles = (out["d_angles"].sum(axis=(2, 3))[:, :, None] if shared_angles
                    else out["d_angles"].reshape(bsz, Tp, H, Sp))
        d_dt = out["d_dt"].reshape(bsz, Tp, H)
        totals = out["d_theta_entry"].reshape(bsz, nc, nb, H, Sp)          # Σ dθ over each block
        if nb > 1:
            d_angles, d_dt = _add_later_blocks(grid, totals, angles, dt, d_angles, d_dt)
        d_entry = totals.sum(axis=2)
    if biases_in_kernel:
        dQ_bias, dK_bias = out["dqb"].sum(axis=(0, 1)).reshape(H, Np), out["dkb"].sum(axis=(0, 1)).reshape(H, Np)
    else:
        dQ_bias, dK_bias = bias_gradients(geo, Q, K, Q_bias, K_bias, scale, theta, dq, dk, d_diagonal)
    # the partial group sums over the slices of a group's heads (one slice: the kernel's dQ, dK as they are)
    group_sum = (lambda x: x.reshape(bsz, Tp, G, Np)) if grid.splits == 1 else (lambda x: x.sum(axis=3))
    return (group_sum(out["dQ"]), group_sum(out["dK"]), dQ_bias, dK_bias,
            out["d_scale"].reshape(bsz, Tp, H), d_angles, d_dt, d_entry)


def bias_gradients(geo: ScanGeometry, Q, K, Q_bias, K_bias, scale, theta, dq, dk, d_diagonal=None):
    """(dQ_bias, dK_bias) [H, Np] float32 as XLA reductions over the batch rows and positions
    (config.bias_gradients_by_xla): dQ_bias[h] = Σ_{b,t} R(θ)ᵀ dq_h and dK_bias[h] = Σ_{b,t} s·R(θ)ᵀ dk̃_h,
    plus, with the skip term's gradient c_h = d_diagonal, Σ c_h·ȳ_h and Σ c_h·x̄_h (x̄, ȳ the biased
    rows of the head's group). The same sums as the kernel's per-block column sums added by XLA, in
    another order of the float32 additions; cos / sin are XLA's (libdevice's on a GPU), as the kernel
    forms them unless config.fast_rotation_backward. Arguments as for query_key_gradients."""
    group_of = lambda x: jnp.repeat(x.astype(F32), geo.heads_per_group, axis=2)     # [Bt, Tp, G, Np] -> H
    gq, gk = dq.astype(F32), dk.astype(F32) * scale[..., None]
    if theta is not None:
        Sp = geo.angle_width
        rotation = (jnp.cos(theta), jnp.sin(theta))                                  # [Bt, Tp, H, Sp]

        def summed_back(d):   # Σ_{b,t} R(θ)ᵀ d, piece by piece (no rotated [Bt, Tp, H, Np] array)
            back = rotate_back({"even": d[..., :Sp], "odd": d[..., Sp:2 * Sp]}, rotation)
            return jnp.concatenate([jnp.sum(back["even"], axis=(0, 1)), jnp.sum(back["odd"], axis=(0, 1)),
                                    jnp.sum(d[..., 2 * Sp:], axis=(0, 1))], axis=-1)
    else:
        summed_back = lambda d: jnp.sum(d, axis=(0, 1))
    dQ_bias, dK_bias = summed_back(gq), summed_back(gk)
    if d_diagonal is not None:
        cd = d_diagonal.astype(F32)[..., None]                                         # [Bt, Tp, H, 1]
        weight = jnp.sum(cd, axis=(0, 1))                                              # [H, 1]
        dQ_bias = dQ_bias + jnp.sum(cd * group_of(K), axis=(0, 1)) + weight * K_bias.astype(F32)
        dK_bias = dK_bias + jnp.sum(cd * group_of(Q), axis=(0, 1)) + weight * Q_bias.astype(F32)
    return dQ_bias, dK_bias


def _add_later_blocks(grid: layout.GroupGrid, totals, angles, dt, d_angles, d_dt):
    """With a chunk cut into blocks, the kernel's d inc at a position is the reverse sum within its
    block only; the blocks after it in the chunk add their totals ("later", [Bt, blocks, H, Sp]) to
    every position of it, hence to d DT = ⟨d inc, rate⟩ and d angles = π(1 − tanh² angles)·Σ d inc·DT
    (all float32, elementwise products and sums: no dot, so no TF32)."""
    bsz, nc, nb, H, Sp = totals.shape
    rows, Tp = grid.block_rows, nc * nb * grid.block_rows
    later = (jnp.cumsum(totals[:, :, ::-1], axis=2)[:, :, ::-1] - totals).reshape(bsz, nc * nb, 1, H, Sp)
    rate, slope = angle_rate_and_slope(angles)
    rate_b = rate.reshape(bsz, nc * nb, rows, angles.shape[2], Sp)
    dt_b = dt.reshape(bsz, nc * nb, rows, H, 1)
    d_dt = d_dt + jnp.sum(rate_b * later, axis=-1).reshape(bsz, Tp, H)
    if angles.shape[2] == 1:
        d_angles = d_angles + jnp.sum(later * dt_b, axis=3).reshape(bsz, Tp, 1, Sp) * slope
    else:
        d_angles = d_angles + (later * dt_b).reshape(bsz, Tp, H, Sp) * slope
    return d_angles, d_dt
