"""The RoPE angles across chunks: the angle entering each chunk, and (Mamba3ScanConfig.angle_gradient_pass)
the kernel that finishes the angles' and DT's gradients.

Per head h and angle a, with the increment inc_t = π·tanh(angles_t)·DT_t (docs/mamba3_siso.md §4.2):

    θ_t = (θ_{-1} + Σ_{r <= t} inc_r) mod 2π,   θ_entry[c] = θ at the last position before chunk c.

Backward: the query/key gradient kernel forms dθ_t at every position; since θ_t depends on every
increment up to t, d inc_t = Σ_{t' >= t} dθ_t' (+ d θ_final), i.e. the in-chunk reverse sum (the
kernel's) plus the sum over the later chunks (`later_chunk_sums`, from the kernel's per-chunk totals);
then d angles = d inc·DT·π(1 − tanh² angles) and d DT = Σ_a d inc·π·tanh(angles) (`angle_gradients`,
one Pallas launch with `angle_gradients_reference` beside it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.common.grid import FlatGrid
from pallas_kernels.common.launch import run_kernel
from pallas_kernels.common.sizes import next_power_of_2
from pallas_kernels.mamba3_siso.chunk_math import TWO_PI, angle_rate_and_slope, wrap_angle
from pallas_kernels.mamba3_siso.config import ScanGeometry

HI = jax.lax.Precision.HIGHEST


def chunk_entry_angles(geo: ScanGeometry, rate, dt, angle0):
    """(θ entering each chunk [Bt, nc, H, S], final θ [Bt, H, S]), wrapped into [0, 2π).

    rate [Bt, Tp, 1 or H, S] = π·tanh(angles), dt [Bt, Tp, H] (time-padded with zeros): the increments
    are rate·dt (XLA fuses the tanh into the chunk sums: the rate is not materialized).
    Each chunk's sum of increments (a contraction over the chunk's positions, float32
    Precision.HIGHEST: no [Bt, T, H, S] array) is wrapped first (so every term is in [0, 2π)), then one
    triangular matmul (float32, Precision.HIGHEST) forms the exclusive prefix sums over chunks, which
    are wrapped again: one small XLA kernel instead of a scan. The prefix sums stay below nc·2π, so
    the carried angle loses at most ~nc·2π·2^-24 rad (4e-5 rad at nc = 128) to rounding.
    """
    nc = geo.n_chunks
    sums = wrapped_chunk_sums(geo, rate, dt)                                                   # [Bt, nc, H, S]
    # [θ_{-1}, sum_0, ..., sum_{nc-1}]: row c of `before` adds θ_{-1} and the sums of the chunks before c
    terms = jnp.concatenate([angle0[:, None], sums], axis=1)                                      # [Bt, nc+1, H, S]
    before = np.tril(np.ones((nc + 1, nc + 1), np.float32))     # a constant of the program (no iota launches)
    running = jnp.mod(jnp.einsum("ck,bkhs->bchs", before, terms, precision=HI), TWO_PI)
    return running[:, :-1], running[:, -1]


def wrapped_chunk_sums(geo: ScanGeometry, rate, dt):
    """[Bt, nc, H, S] float32: each chunk's sum of the increments rate·dt, wrapped into [0, 2π) (a
    contraction over the chunk's positions, float32 Precision.HIGHEST; arguments as chunk_entry_angles)."""
    bsz, _, Hr, S = rate.shape
    H, nc, L = dt.shape[-1], geo.n_chunks, geo.chunk
    rate, dt = rate.reshape(bsz, nc, L, Hr, S), dt.reshape(bsz, nc, L, H)
    if Hr == 1:
        sums = jnp.einsum("bcls,bclh->bchs", rate[:, :, :, 0], dt, precision=HI)
    else:
        sums = jnp.sum(rate * dt[..., None], axis=2)
    return jnp.mod(sums, TWO_PI)


def entry_angle_prefix(geo: ScanGeometry, sums, angle0):
    """chunk_entry_angles' prefix over the chunks as one Pallas launch (config.entry_prefix_kernel):
    (θ entering each chunk [Bt, nc, H, Sp], final θ [Bt, H, Sp]) float32 from the wrapped chunk sums
    `sums` [Bt, nc, H, Sp] (wrapped_chunk_sums) and the entering angle angle0 [Bt, H, Sp].

    One program per (batch row, head): the [nc, Sp] column of chunk sums (when nc is not a power of two,
    XLA pads the sums with zero chunks first and the outputs are sliced back: Pallas' Triton lowering
    does not mask a block that overhangs the array, so an overhanging store would overwrite the next
    row's angles — seen on an H100, session 40), its inclusive prefix sum over the chunks minus each
    chunk's own term (the exclusive sum: the subtraction rounds at most half an ulp of the running sum, the same
    order as the prefix's own rounding, < nc·2π·2^-24 rad), plus angle0, wrapped (floor-mod, as the
    kernels wrap θ); the final angle from the column's total. Replaces XLA's pad, triangular matmul and
    slices of chunk_entry_angles (the same sums in another order of the float32 additions).
    """
    bsz, nc, H, Sp = sums.shape
    ncp = next_power_of_2(nc)
    flat = FlatGrid((bsz, H))
    sums = sums.astype(F32)
    if ncp != nc:
        sums = jnp.pad(sums, ((0, 0), (0, ncp - nc), (0, 0), (0, 0)))

    def body(refs):
        x = refs["sums"][...]                                                    # [ncp, Sp] (zero chunks past nc)
        a0 = refs["angle0"][...]                                                 # [Sp]
        refs["entry"][...] = wrap_angle(a0[None, :] + (jnp.cumsum(x, axis=0) - x))
        refs["final"][...] = wrap_angle(a0 + jnp.sum(x, axis=0))

    at = flat.coordinates                                                        # p -> (b, h)
    column = pl.BlockSpec((None, ncp, None, Sp), lambda p: (at(p)[0], 0, at(p)[1], 0))
    row = pl.BlockSpec((None, None, Sp), lambda p: at(p) + (0,))
    out = run_kernel(body, grid=flat.size, inputs=[("sums", sums, column), ("angle0", angle0.astype(F32), row)],
                     outputs=[("entry", jax.ShapeDtypeStruct((bsz, ncp, H, Sp), F32), column),
                              ("final", jax.ShapeDtypeStruct((bsz, H, Sp), F32), row)],
                     name="mamba3_siso_fwd_entry_angles", num_warps=1, num_stages=geo.config.num_stages,
                     interpret=geo.interpret)
    return out["entry"][:, :nc], out["final"]


def later_chunk_sums(d_entry, d_final):
    """(Σ_{c' > c} d_entry[c'] + d_final [Bt, nc, H, Sp], d θ_{-1} [Bt, H, Sp]) float32: the transpose of
    chunk_entry_angles' prefix sums (the wraps pass cotangents through), from the per-chunk totals of dθ
    d_entry [Bt, nc, H, Sp] and the final angle's cotangent d_final [Bt, H, Sp]. Summed in a fixed order
    (a triangular matmul, float32 Precision.HIGHEST)."""
    nc = d_entry.shape[1]
    strictly_after = np.triu(np.ones((nc, nc), np.float32), k=1)            # [c, c']: c' > c; a constant
    later = jnp.einsum("ck,bkhs->bchs", strictly_after, d_entry, precision=HI) + d_final[:, None]
    return later, later[:, 0] + d_entry[:, 0]


def angle_gradients_reference(geo: ScanGeometry, d_inc, later, angles, dt):
    """Pure-JAX `angle_gradients`: (d angles [Bt, Tp, H, Sp], d DT [Bt, Tp, H]) float32."""
    bsz, Tp, H, Sp = angles.shape
    nc, L = geo.n_chunks, geo.chunk
    total = jnp.moveaxis(d_inc, 3, 1).reshape(bsz, nc, L, H, Sp) + later[:, :, None]          # [Bt, nc, L, H, Sp]
    total = total.reshape(bsz, Tp, H, Sp)
    rate, slope = angle_rate_and_slope(angles)
    return total * dt[..., None] * slope, jnp.sum(total * rate, axis=-1)


def angle_gradients(geo: ScanGeometry, d_inc, later, angles, dt):
    """The angles' and DT's gradients from the in-chunk increment gradients (config.angle_gradient_pass).

    Args:
      d_inc: [Bt, H, Sp, Tp] float32, position-major: Σ_{t' >= t in t's chunk} dθ_t' (the position-major
        query/key gradient kernel's output);
      later: [Bt, nc, H, Sp] float32, later_chunk_sums' first output;
      angles: [Bt, Tp, H, Sp] float32 the raw per-head angles; dt: [Bt, Tp, H] float32 DT.

    Returns:
      (d angles [Bt, Tp, H, Sp], d DT [Bt, Tp, H]) float32, as angle_gradients_reference: with
      total = d_inc + later (of t's chunk), d angles = total·DT·π(1 − tanh² angles), d DT = Σ_a total·π·tanh(angles).

    One program per (batch row, chunk, head): the [Sp, L] tile of d_inc is transposed in registers
    (the only layout change), the rest is elementwise and one sum over the Sp angles per position.
    """
    bsz, Tp, H, Sp = angles.shape
    nc, L = geo.n_chunks, geo.chunk
    flat = FlatGrid((bsz, nc, H))

    def body(refs):
        total = refs["d_inc"][...].T + refs["later"][...][None, :]                                # [L, Sp]
        rate, slope = angle_rate_and_slope(refs["angles"][...])
        dt_col = refs["dt"][...][:, None]
        refs["d_angles"][...] = total * dt_col * slope
        refs["d_dt"][...] = jnp.sum(total * rate, axis=1)

    at = flat.coordinates                                                 # p -> (b, c, h)
    rows = pl.BlockSpec((None, L, None, Sp), lambda p: at(p) + (0,))      # [Bt, Tp, H, Sp]: the chunk's [L, Sp]
    column = pl.BlockSpec((None, L, None), at)                            # [Bt, Tp, H]: the chunk's [L]
    inputs = [("d_inc", d_inc, pl.BlockSpec((None, None, Sp, L), lambda p: (at(p)[0], at(p)[2], 0, at(p)[1]))),
              ("later", later, pl.BlockSpec((None, None, None, Sp), lambda p: at(p) + (0,))),
              ("angles", angles, rows), ("dt", dt, column)]
    outputs = [("d_angles", jax.ShapeDtypeStruct((bsz, Tp, H, Sp), F32), rows),
               ("d_dt", jax.ShapeDtypeStruct((bsz, Tp, H), F32), column)]
    out = run_kernel(body, grid=flat.size, inputs=inputs, outputs=outputs, name="mamba3_siso_bwd_angle_gradients",
                     num_warps=geo.config.num_warps_angle_pass, num_stages=geo.config.num_stages,
                     interpret=geo.interpret)
    return out["d_angles"], out["d_dt"]
