"""Query/key gradient kernel of the Mamba-3 SISO scan: from the per-head gradients of the chunk
kernels' operands q, k̃ back to Q, K, the biases, the trapezoid scale and the RoPE angles.

Why a kernel: per head h of group g, with x̄ = Q[g] + Q_bias[h] (likewise ȳ for keys), q = R(θ)x̄ and
k̃ = s·R(θ)ȳ (queries_keys.py), the backward is

    dx̄_h = R(θ)ᵀ dq_h                          dQ[g]  = Σ_{h in g} dx̄_h,     dQ_bias[h] = Σ_{b,t} dx̄_h
    dȳ_h = s·R(θ)ᵀ dk̃_h                        dK[g]  = Σ_{h in g} dȳ_h,     dK_bias[h] = Σ_{b,t} dȳ_h
    ds_h = ⟨ȳ_h, R(θ)ᵀ dk̃_h⟩                   dθ_h   = ∂θ⟨dq_h, R(θ)x̄_h⟩ + s·∂θ⟨dk̃_h, R(θ)ȳ_h⟩

Done by XLA's autodiff this took ~1.25 ms at the PERF.md shape (several passes over the float32
per-head gradients, 400 MB). Here one program per (batch row, block of positions, group) reads each
per-head gradient once, walks the heads of its group with a loop (dynamic head index into its refs)
and keeps the group sums in registers; the rotation is elementwise between the even and odd pieces
of the kernel layout, loaded as column blocks of the refs (config.py).

Outputs per program: dQ, dK rows (float32), ds and dθ per head, and the block's share of the bias
gradients (summed over blocks by XLA in a fixed order: deterministic, no atomics).
Numerics: float32 throughout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.mamba3_siso.config import ScanGeometry

F32 = jnp.float32


def query_key_gradients(geo: ScanGeometry, Q, K, Q_bias, K_bias, scale, theta, dq, dk):
    """Args (kernel layout, config.py):
      Q, K: [Bt, Tp, G, Np] activation dtype; Q_bias, K_bias: [H, Np] float32; scale: [Bt, Tp, H] float32;
      theta: [Bt, Tp, H, Sp] float32 or None; dq, dk: [Bt, Tp, H, Np] float32 gradients of q, k̃.

    Returns:
      (dQ, dK [Bt, Tp, G, Np] float32, dQ_bias, dK_bias [H, Np] float32, d_scale [Bt, Tp, H] float32,
       d_theta [Bt, Tp, H, Sp] float32 or None).
    """
    bsz, Tp, G, Np = Q.shape
    H = geo.heads
    hpg = H // G
    rows = geo.qk_rows
    blocks = Tp // rows
    Sp = geo.angle_width
    pieces = geo.pieces
    rotated = theta is not None

    def index(p):                                   # program p -> (batch row, block, group)
        return p // (blocks * G), (p // G) % blocks, p % G

    def group_block(p):
        b, t, g = index(p)
        return b, t, g, 0

    def head_block(p):
        b, t, g = index(p)
        return b, t, g, 0, 0

    def kernel(*refs):
        r = dict(zip(names, refs))

        def piece(ref, head, name):
            _, start, width = next(x for x in pieces if x[0] == name)
            if head is None:
                return ref[:, pl.ds(start, width)].astype(F32)
            return ref[:, head, pl.ds(start, width)].astype(F32)

        def bias(ref, head, name):
            _, start, width = next(x for x in pieces if x[0] == name)
            return ref[head, pl.ds(start, width)][None, :]

        q_rows = {n: piece(r["Q"], None, n) for n, _, _ in pieces}
        k_rows = {n: piece(r["K"], None, n) for n, _, _ in pieces}

        def rotate_back(d, rotation):
            """R(θ)ᵀ applied to the pieces of d."""
            if rotation is None:
                return dict(d)
            c, s = rotation
            out = dict(d)
            out["even"] = c * d["even"] + s * d["odd"]
            out["odd"] = c * d["odd"] - s * d["even"]
            return out

        def angle_gradient(d, x, rotation):
            """∂θ_a⟨d, R(θ)x⟩ = d_e·(−x_e sinθ − x_o cosθ) + d_o·(x_e cosθ − x_o sinθ)."""
            c, s = rotation
            return d["even"] * (-x["even"] * s - x["odd"] * c) + d["odd"] * (x["even"] * c - x["odd"] * s)

        def head_step(j, sums):
            dq_sum, dk_sum = sums
            rotation = None
            if rotated:
                angle = r["theta"][:, j, :]
                rotation = (jnp.cos(angle), jnp.sin(angle))
            s = r["scale"][:, j]
            dq_h = {n: piece(r["dq"], j, n) for n, _, _ in pieces}
            dk_h = {n: piece(r["dk"], j, n) for n, _, _ in pieces}
            x = {n: q_rows[n] + bias(r["Q_bias"], j, n) for n, _, _ in pieces}
            y = {n: k_rows[n] + bias(r["K_bias"], j, n) for n, _, _ in pieces}
            gq = rotate_back(dq_h, rotation)
            gk = rotate_back(dk_h, rotation)
            d_scale = None
            for n, start, width in pieces:
                term = jnp.sum(y[n] * gk[n], axis=1)
                d_scale = term if d_scale is None else d_scale + term
                dk_bar = s[:, None] * gk[n]
                r["dqb"][j, pl.ds(start, width)] = jnp.sum(gq[n], axis=0)
                r["dkb"][j, pl.ds(start, width)] = jnp.sum(dk_bar, axis=0)
                dq_sum[n] = dq_sum[n] + gq[n]
                dk_sum[n] = dk_sum[n] + dk_bar
            r["d_scale"][:, j] = d_scale
            if rotated:
                r["d_theta"][:, j, :] = (angle_gradient(dq_h, x, rotation)
                                         + s[:, None] * angle_gradient(dk_h, y, rotation))
            return dq_sum, dk_sum

        zeros = {n: jnp.zeros((rows, w), F32) for n, _, w in pieces}
        dq_sum, dk_sum = jax.lax.fori_loop(0, hpg, head_step, (dict(zeros), dict(zeros)))
        for n, start, width in pieces:
            r["dQ"][:, pl.ds(start, width)] = dq_sum[n]
            r["dK"][:, pl.ds(start, width)] = dk_sum[n]

    per_head = lambda x: x.reshape((bsz, Tp, G, hpg) + x.shape[3:])    # [Bt, Tp, H, ...] -> [Bt, Tp, G, H/G, ...]
    grid_rows = pl.BlockSpec((None, rows, None, Np), group_block)
    head_rows = pl.BlockSpec((None, rows, None, hpg, Np), head_block)
    inputs = [("Q", Q, grid_rows), ("K", K, grid_rows),
              ("Q_bias", Q_bias.reshape(G, hpg, Np), pl.BlockSpec((None, hpg, Np), lambda p: (index(p)[2], 0, 0))),
              ("K_bias", K_bias.reshape(G, hpg, Np), pl.BlockSpec((None, hpg, Np), lambda p: (index(p)[2], 0, 0))),
              ("scale", per_head(scale), pl.BlockSpec((None, rows, None, hpg), group_block)),
              ("dq", per_head(dq), head_rows), ("dk", per_head(dk), head_rows)]
    if rotated:
        inputs.append(("theta", per_head(theta), pl.BlockSpec((None, rows, None, hpg, Sp), head_block)))
    partial_bias = jax.ShapeDtypeStruct((bsz, blocks, G, hpg, Np), F32)
    outputs = [("dQ", jax.ShapeDtypeStruct((bsz, Tp, G, Np), F32), grid_rows),
               ("dK", jax.ShapeDtypeStruct((bsz, Tp, G, Np), F32), grid_rows),
               ("dqb", partial_bias, pl.BlockSpec((None, None, None, hpg, Np), head_block)),
               ("dkb", partial_bias, pl.BlockSpec((None, None, None, hpg, Np), head_block)),
               ("d_scale", jax.ShapeDtypeStruct((bsz, Tp, G, hpg), F32),
                pl.BlockSpec((None, rows, None, hpg), group_block))]
    if rotated:
        outputs.append(("d_theta", jax.ShapeDtypeStruct((bsz, Tp, G, hpg, Sp), F32),
                        pl.BlockSpec((None, rows, None, hpg, Sp), head_block)))
    names = [n for n, _, _ in inputs] + [n for n, _, _ in outputs]
    results = pl.pallas_call(
        kernel,
        out_shape=[s for _, s, _ in outputs],
        grid=(bsz * blocks * G,),
        in_specs=[s for _, _, s in inputs],
        out_specs=[s for _, _, s in outputs],
        compiler_params=plt.CompilerParams(num_warps=geo.config.num_warps_qk, num_stages=geo.config.num_stages),
        interpret=geo.interpret,
        name="mamba3_siso_bwd_query_key_gradients",
    )(*[a for _, a, _ in inputs])
    out = dict(zip([n for n, _, _ in outputs], results))
    d_theta = out["d_theta"].reshape(bsz, Tp, H, Sp) if rotated else None
    return (out["dQ"], out["dK"], out["dqb"].sum(axis=(0, 1)).reshape(H, Np), out["dkb"].sum(axis=(0, 1)).reshape(H, Np),
            out["d_scale"].reshape(bsz, Tp, H), d_theta)
