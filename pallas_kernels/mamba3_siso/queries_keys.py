"""The kernels' per-head query and key operands: bias, RoPE rotation and (keys) the trapezoid scale,
in the kernel layout of d_state (config.py: even | odd | rest pieces).

    q_t = R(θ_t)(Q_t[g] + Q_bias[h]),    k̃_t = s_t·R(θ_t)(K_t[g] + K_bias[h])       per head h in group g

Why a separate step: formed once here and rounded once to the dot operand dtype, they let every
chunk kernel do each product as one dot over the whole d_state. In the kernel layout the rotation is
elementwise between the contiguous even and odd pieces. `head_queries_keys_kernel` is the Pallas
kernel the core runs (one program per (batch row, chunk, group, slice of the group's heads),
layout.GroupGrid: it
reads Q, K once, forms each head's angles θ_t = (θ_entry + Σ_{r <= t in the chunk} inc_r) mod 2π from
the increments, and writes each head's q, k̃ piece by piece); `head_queries_keys` with
`position_angles` is its pure-JAX reference (XLA took ~0.4 ms for the two at the benchmark shape (docs/performance.md); JAX
differentiates them in tests). The backward is the query/key gradient kernel (qk_gradients.py).

Numerics: float32 throughout; q, k̃ rounded once to the dot operand dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.common.padding import pad_axis_to
from pallas_kernels.mamba3_siso import layout
from pallas_kernels.mamba3_siso.chunk_math import angle_rate, chunk_angles, rotate, rotation_of
from pallas_kernels.mamba3_siso.config import ScanGeometry


def rotate_pairs(x, theta):
    """Rotates adjacent pairs (2a, 2a+1) of x [..., N] by +θ_a ([..., S], broadcast); dims 2S.. pass through."""
    S = theta.shape[-1]
    if S == 0:
        return x
    pairs = x[..., :2 * S].reshape(x.shape[:-1] + (S, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = jnp.cos(theta), jnp.sin(theta)
    rotated = jnp.stack([c * x0 - s * x1, s * x0 + c * x1], axis=-1).reshape(x.shape[:-1] + (2 * S,))
    return rotated if 2 * S == x.shape[-1] else jnp.concatenate([rotated, x[..., 2 * S:]], axis=-1)


def to_kernel_layout(geo: ScanGeometry, x):
    """[..., N] -> [..., Np]: the even, odd and rest pieces of d_state, each zero-padded (config.py)."""
    S = geo.num_angles
    pieces = []
    if geo.angle_width:
        pieces += [pad_axis_to(x[..., 0:2 * S:2], -1, geo.angle_width),
                   pad_axis_to(x[..., 1:2 * S:2], -1, geo.angle_width)]
    pieces.append(pad_axis_to(x[..., 2 * S:], -1, geo.rest_width))
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)


def from_kernel_layout(geo: ScanGeometry, y):
    """Inverse of to_kernel_layout: [..., Np] -> [..., N]."""
    S, N, Sp = geo.num_angles, geo.d_state, geo.angle_width
    pieces = []
    if Sp:
        even, odd = y[..., :S], y[..., Sp:Sp + S]
        pieces.append(jnp.stack([even, odd], axis=-1).reshape(even.shape[:-1] + (2 * S,)))
    if N > 2 * S:
        pieces.append(y[..., 2 * Sp:2 * Sp + N - 2 * S])
    return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=-1)


def position_angles(geo: ScanGeometry, inc, theta_entry):
    """[Bt, Tp, H, Sp] θ_t = (θ entering t's chunk + Σ_{r <= t in the chunk} inc_r) mod 2π (float32).

    inc: [Bt, Tp, H, Sp]; theta_entry: [Bt, nc, H, Sp] wrapped angles entering each chunk.
    """
    bsz, Tp, H, Sp = inc.shape
    within = jnp.cumsum(inc.reshape(bsz, geo.n_chunks, geo.chunk, H, Sp), axis=2)
    return jnp.mod(theta_entry[:, :, None] + within, 2.0 * jnp.pi).reshape(bsz, Tp, H, Sp)


def head_queries_keys(geo: ScanGeometry, Q, K, Q_bias, K_bias, scale, theta):
    """(q, k̃) per head, float32 [Bt, Tp, H, Np], kernel layout.

    Args:
      Q, K: [Bt, Tp, G, Np] kernel layout, any float dtype; Q_bias, K_bias: [H, Np] float32 kernel layout;
      scale: [Bt, Tp, H] s = γ + σ̂; theta: [Bt, Tp, H, Sp] angle at each position (wrapped, zero-padded),
      or None (no rotation).
    """
    G = Q.shape[2]
    Sp = geo.angle_width

    def per_head(x, bias):
        x = jnp.repeat(x.astype(F32), geo.heads // G, axis=2) + bias                # [Bt, Tp, H, Np]
        if theta is None:
            return x
        c, s = jnp.cos(theta), jnp.sin(theta)
        even, odd, rest = x[..., :Sp], x[..., Sp:2 * Sp], x[..., 2 * Sp:]
        return jnp.concatenate([c * even - s * odd, s * even + c * odd, rest], axis=-1)

    return per_head(Q, Q_bias), per_head(K, K_bias) * scale[..., None]


def angles_operand(grid: layout.GroupGrid, angles):
    """("angles", array, BlockSpec): raw angles shared by the heads [Bt, Tp, 1, Sp] as one [L, Sp] block
    per program, per-head angles [Bt, Tp, H, Sp] as the slice's [L, heads per slice, Sp] block."""
    if angles.shape[2] == 1:
        return "angles", angles[:, :, 0], grid.shared_rows(angles.shape[-1])
    return "angles", grid.per_head(angles), grid.head_rows(angles.shape[-1])


def head_diagonal(geo: ScanGeometry, Q, K, Q_bias, K_bias):
    """⟨q̄_h, k̄_h⟩ [Bt, Tp, H] float32, q̄_h = Q[g] + Q_bias[h], k̄_h = K[g] + K_bias[h] (kernel layout; the
    zero padding adds nothing; the rotation would not change it): the inner product in the skip term
    D + γ⟨q̄, k̄⟩, formed per head from the group rows (pure-JAX reference of the kernel's `diagonal`)."""
    G = Q.shape[2]
    q = jnp.repeat(Q.astype(F32), geo.heads // G, axis=2) + Q_bias
    k = jnp.repeat(K.astype(F32), geo.heads // G, axis=2) + K_bias
    return jnp.sum(q * k, axis=-1)


def head_queries_keys_kernel(geo: ScanGeometry, Q, K, Q_bias, K_bias, scale, angles, dt, theta_entry, *,
                             keep_theta: bool = True, keep_columns: bool = False):
    """Pallas version of `head_queries_keys` at θ = `position_angles(π·tanh(angles)·dt, theta_entry)`, rounded to
    the dot operand dtype, and of `head_diagonal`: (q, k̃ [Bt, Tp, H, Np], θ [Bt, Tp, H, Sp] float32 or
    None, ⟨q̄, k̄⟩ [Bt, Tp, H] float32 — the skip term's inner product, from the biased rows the kernel
    forms anyway, so the op's glue needs no [Bt, T, G, N] × [H, N] products of its own).

    angles: [Bt, Tp, 1 or H, Sp] the op's raw angles (1: shared by the heads), dt: [Bt, Tp, H] DT (the
    increment of head h is π·tanh(angles)·DT_h, formed here: no rate array is materialized between
    XLA and the kernel) and theta_entry: [Bt, nc, H, Sp] angles entering
    each chunk (float32, zero-padded from S to Sp), or all None (no angles); the other arguments as
    for `head_queries_keys`. θ, the wrapped angle at every position, is written for the backward
    (qk_gradients.py), which then needs no in-chunk prefix sum of its own; with keep_theta=False it is
    not written (None is returned: the forward alone, or a backward that forms θ itself,
    qk_gradients_transposed.py). With `geo.theta_position_major` θ is written position-major,
    [Bt, H, Sp, Tp] (each head's tile transposed before its store), for that kernel to load.
    With keep_columns (config.qk_columns_from_forward; one program per group) Q and K are also written
    position-major, [Bt, G, Np, Tp] in their dtype and order, and returned fifth and sixth (else None).
    """
    grid = layout.GroupGrid(geo)
    pieces = geo.pieces
    mm = jnp.dtype(geo.matmul_dtype)

    rotated = angles is not None
    shared_angles = rotated and angles.shape[2] == 1
    keep_theta = keep_theta and rotated
    theta_cols = geo.theta_position_major

    def body(refs):
        cols = lambda start, width: layout.piece_columns(geo, start, width)      # the op's order or the kernel layout
        rows = {p: {n: refs[p][:, cols(start, width)].astype(F32) for n, start, width in pieces} for p in "QK"}
        shared = angle_rate(refs["angles"][...]) if shared_angles else None                     # [L, Sp]

        def head_step(j, carry):
            rotation = None
            if rotated:
                rate_j = shared if shared_angles else angle_rate(refs["angles"][:, j, :])
                angle = chunk_angles(rate_j * refs["dt"][:, j][:, None], refs["theta_entry"][j, :],
                                     by_matmul=geo.angle_sums_by_matmul)
                if keep_theta:
                    if theta_cols:
                        refs["theta"][j] = angle.T
                    else:
                        refs["theta"][:, j, :] = angle
                rotation = rotation_of(angle, geo)
            s = refs["scale"][:, j]
            biased = {p: {n: rows[p][n] + refs[f"{p}_bias"][j, cols(start, width)][None, :]
                          for n, start, width in pieces} for p in "QK"}
            diagonal = None
            for n, _, _ in pieces:
                term = jnp.sum(biased["Q"][n] * biased["K"][n], axis=1)
                diagonal = term if diagonal is None else diagonal + term
            refs["diagonal"][:, j] = diagonal
            for p, out in (("Q", "q"), ("K", "k")):
                turned = rotate(biased[p], rotation)
                for n, start, width in pieces:
                    x = turned[n]
                    refs[out][:, j, pl.ds(start, width)] = (x if p == "Q" else s[:, None] * x).astype(mm)
            return carry

        if keep_columns:     # Q, K position-major for the gradient kernel: one transpose per program
            for p in "QK":
                refs[f"{p}_cols"][...] = refs[p][...].T
        jax.lax.fori_loop(0, grid.heads_per_slice, head_step, 0)

    bsz, Tp, G, Np = Q.shape
    slices = (G, grid.splits, grid.heads_per_slice, Np)
    inputs = [("Q", Q, grid.group_rows()), ("K", K, grid.group_rows()),
              ("Q_bias", Q_bias.reshape(slices), grid.biases()), ("K_bias", K_bias.reshape(slices), grid.biases()),
              ("scale", grid.per_head(scale), grid.head_scalars()),
              ("theta_entry", None if not rotated else grid.per_head(theta_entry), grid.per_chunk(geo.angle_width))]
    if rotated:
        inputs += [angles_operand(grid, angles), ("dt", grid.per_head(dt), grid.head_scalars())]
    per_head = jax.ShapeDtypeStruct((bsz, Tp) + slices, mm)
    outputs = [("q", per_head, grid.head_rows(Np)), ("k", per_head, grid.head_rows(Np)),
               ("diagonal", jax.ShapeDtypeStruct((bsz, Tp) + slices[:-1], F32), grid.head_scalars())]
    Sp = geo.angle_width
    if keep_theta and theta_cols:
        outputs.append(("theta", jax.ShapeDtypeStruct((bsz,) + slices[:-1] + (Sp, Tp), F32), grid.head_cols(Sp)))
    elif keep_theta:
        outputs.append(("theta", jax.ShapeDtypeStruct((bsz, Tp) + slices[:-1] + (Sp,), F32), grid.head_rows(Sp)))
    if keep_columns:
        if grid.splits != 1:
            raise ValueError("head_queries_keys_kernel: keep_columns needs one program per group (qk_head_splits 1)")
        columns = pl.BlockSpec((None, None, Np, geo.chunk), lambda p: (grid.index(p)[0], grid.index(p)[2], 0,
                                                                        grid.index(p)[1]))
        outputs += [(f"{p}_cols", jax.ShapeDtypeStruct((bsz, G, Np, Tp), x.dtype), columns)
                    for p, x in (("Q", Q), ("K", K))]
    out = layout.launch(body, geo, grid, inputs, outputs, "mamba3_siso_fwd_queries_keys", geo.config.num_warps_qk)
    H = geo.heads
    theta = None
    if keep_theta:
        theta = out["theta"].reshape((bsz, H, Sp, Tp) if theta_cols else (bsz, Tp, H, Sp))
    return (out["q"].reshape(bsz, Tp, H, Np), out["k"].reshape(bsz, Tp, H, Np), theta,
            out["diagonal"].reshape(bsz, Tp, H), out.get("Q_cols"), out.get("K_cols"))
