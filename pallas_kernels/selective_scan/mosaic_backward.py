"""A Mosaic GPU backward of the Mamba-1 selective scan (thread per channel, no cross-lane sums in the walk):
a prototype.

Status as mosaic_forward.py: verified on CPU only (the Mosaic GPU interpreter against JAX's VJP of the
reference; the CUDA lowering on an abstract sm_90), not yet compiled, run or timed on an H200.
`ScanBlockConfig(bwd_mosaic=True)` makes the Pallas scan's backward use it where it applies (scan.py).

Two launches:
  1. `mosaic_forward` again with chunk SUB (8): the state entering every 8 steps, [Bt, T/8, d, n] f32
     (written and read once: 200 MB at B=8 T=2048 d=1536 n=16; the forward keeps no residual for it).
  2. The reverse kernel: one warpgroup per (batch row, 128 channels), thread i = channel i, walking the
     8-step chunks right to left with the adjoint λ [128, n] in registers. Per chunk: TMA the rows (u,
     raw δ, z, d_out [8, 128]; B, C [8, n]) and the entry state; recompute the chunk's 8 states into
     shared memory (hs[0] = entry, hs[t + 1] = h_t) while writing the products h_t·gy_t for dC; then
     the 8 steps backwards (unrolled), in-thread:
         gy = d_out·silu(z),  dh = gy·C_t + λ,  hb = Σ_n dh·B_t,  du = δ·hb + D·gy,
         x = dh·ā_t·h_{t-1},  dδ = u·hb + Σ_n A·x (through the softplus),  dA += δ·x,  λ = ā_t·dh,
     writing the products dh·δu for dB. The two channel sums per step (dB_t, dC_t over 128 threads) are
     done after the chunk from shared memory, thread j summing column j of a [128, 8·n] product table
     over its rows: no shuffles or barriers inside the walk. Each program's dB, dC rows are partials
     [d/128, Bt, T, n] and dA, dD, d bias partials per batch row; XLA sums them in a fixed order
     (deterministic, no atomics).

Numerics: float32 throughout, ā recomputed (exp2 of δ·A·log2 e) as in the forward; du, dδ, dz rounded
once to their inputs' dtypes. Limits: those of mosaic_forward (one group, no reset, d % 128 == 0,
T % 8 == 0, n a multiple of 4 with 8·n ≤ 256 for the product rows).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.selective_scan.kernel_math import sigmoid, softplus_thresholded_grad
from pallas_kernels.selective_scan.mosaic_forward import (
    CHANNEL_ROW, CHANNELS, LOG2_E, ROWS, STATE_ROW, check_supported, mosaic_forward, softplus_thresholded)

F32 = jnp.float32
SUB = 8                      # steps per reverse chunk (shared memory: (SUB + 1) states + the product table)
LN_2 = math.log(2.0)


def check_backward_supported(u, B):
    reason = check_supported(u, B, chunk=SUB)
    if reason is None and SUB * B.shape[-1] > 256:
        reason = f"d_state {B.shape[-1]} too large for the reverse kernel's product rows (8·n <= 256)"
    return reason


def mosaic_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, d_out, d_final, *, softplus=True,
                    z_channel_offset=0, interpret=False):
    """Cotangents of `mosaic_forward`'s (out, final state).

    Args: mosaic_forward's (u, delta, A [d, n], B, C [Bt, T, n], D, z, delta_bias, initial_state), then
      d_out [Bt, T, d] and d_final [Bt, d, n] (or None: zeros).

    Returns:
      (du, d_delta (of the raw delta), dA [d, n] f32, dB, dC [Bt, T, n] f32, dD [d] f32 or None,
       dz (like the gate, [Bt, T, d]) or None, d_delta_bias [d] f32 or None, d_initial_state [Bt, d, n] f32).
    """
    reason = check_backward_supported(u, B)
    if reason:
        raise ValueError(f"mosaic_backward: {reason}")
    bsz, T, d = u.shape
    n = B.shape[-1]
    nc, L, nblk = T // SUB, SUB, d // CHANNELS
    has_z, has_D, has_bias = z is not None, D is not None, delta_bias is not None
    _, _, entry, _ = mosaic_forward(u, delta, A, B, C, D, z, delta_bias, initial_state, softplus=softplus,
                                    chunk=SUB, z_channel_offset=z_channel_offset, interpret=interpret)
    A2 = A.astype(F32) * LOG2_E
    B, C = B.astype(F32), C.astype(F32)
    d_final = jnp.zeros((bsz, d, n), F32) if d_final is None else d_final.astype(F32)
    channel_vectors = jnp.stack([(D if has_D else jnp.zeros((d,), F32)).astype(F32),
                                 (delta_bias if has_bias else jnp.zeros((d,), F32)).astype(F32)])
    zoff = z_channel_offset
    width = L * n
    sums_layout = plgpu.Layout.WG_STRIDED((width,), max(width // CHANNELS, 1))

    def body(u_g, dl_g, z_g, do_g, a_g, b_g, c_g, v_g, entry_g, dfin_g,
             du_g, dd_g, dz_g, db_g, dc_g, da_g, dv_g, dh0_g,
             u_s, dl_s, z_s, do_s, a_s, b_s, c_s, v_s, hs, p_s, r_s, du_s, dd_s, dz_s, st_s, vo_s, bars):
        bi = lax.axis_index("b")
        blk = lax.axis_index("d")
        d0 = pl.multiple_of(blk * CHANNELS, CHANNELS)
        plgpu.copy_gmem_to_smem(a_g.at[pl.ds(d0, CHANNELS)], a_s, bars.at[7])
        plgpu.copy_gmem_to_smem(v_g.at[:, pl.ds(d0, CHANNELS)], v_s, bars.at[8])
        plgpu.copy_gmem_to_smem(dfin_g.at[bi, pl.ds(d0, CHANNELS)], st_s, bars.at[9])
        for k in (7, 8, 9):
            plgpu.barrier_wait(bars.at[k])
        a2 = plgpu.load(a_s, layout=ROWS, optimized=False)
        d_skip = plgpu.load(v_s.at[0], layout=CHANNEL_ROW, optimized=False)
        bias = plgpu.load(v_s.at[1], layout=CHANNEL_ROW, optimized=False)
        lam0 = plgpu.load(st_s, layout=ROWS, optimized=False)

        def row(ref, t):
            return plgpu.load(ref.at[t], layout=CHANNEL_ROW, optimized=False).astype(F32)

        def step_inputs(t):
            raw = row(dl_s, t) + bias
            dl = softplus_thresholded(raw) if softplus else raw
            gy, zt, sz = row(do_s, t), None, None
            if has_z:
                zt = row(z_s, t)
                sz = sigmoid(zt)
                gy = gy * zt * sz
            return raw, dl, gy, zt, sz

        def channel_sums(t0, out_g):
            """Column sums of the [128, L·n] product table (rows = channels) -> out_g rows [t0, t0 + L)."""
            plgpu.commit_smem()

            def add(ch, acc):
                return acc + plgpu.load(p_s.at[ch], layout=sums_layout, optimized=False)

            acc = lax.fori_loop(0, CHANNELS, add, plgpu.layout_cast(jnp.zeros((width,), F32), sums_layout))
            r_s[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(r_s, out_g.at[blk, bi, pl.ds(t0 * n, width)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def one_chunk(k, carry):
            lam, dA, dD, dbias = carry
            ci = nc - 1 - k
            t0 = pl.multiple_of(ci * L, L)
            rows = pl.ds(t0, L)
            copies = [(u_g.at[bi, rows, pl.ds(d0, CHANNELS)], u_s), (dl_g.at[bi, rows, pl.ds(d0, CHANNELS)], dl_s),
                      (do_g.at[bi, rows, pl.ds(d0, CHANNELS)], do_s), (b_g.at[bi, rows], b_s),
                      (c_g.at[bi, rows], c_s), (entry_g.at[bi, ci, pl.ds(d0, CHANNELS)], hs.at[0])]
            if has_z:
                copies.append((z_g.at[bi, rows, pl.ds(zoff + d0, CHANNELS)], z_s))
            for j, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, bars.at[j])
            for j in range(len(copies)):
                plgpu.barrier_wait(bars.at[j])

            # forward over the chunk: its states, and the products h_t·gy_t for dC
            h = plgpu.load(hs.at[0], layout=ROWS, optimized=False)
            for t in range(L):
                _, dl, gy, _, _ = step_inputs(t)
                b_t = plgpu.load(b_s.at[t], layout=STATE_ROW, optimized=False)
                h = jnp.exp2(dl[:, None] * a2) * h + (dl * row(u_s, t))[:, None] * b_t[None, :]
                hs[t + 1] = h
                p_s[:, t * n:(t + 1) * n] = h * gy[:, None]
            channel_sums(t0, dc_g)

            # backwards over the chunk
            for t in reversed(range(L)):
                raw, dl, gy, zt, sz = step_inputs(t)
                u_t = row(u_s, t)
                b_t = plgpu.load(b_s.at[t], layout=STATE_ROW, optimized=False)
                c_t = plgpu.load(c_s.at[t], layout=STATE_ROW, optimized=False)
                h_t = plgpu.load(hs.at[t + 1], layout=ROWS, optimized=False)
                h_prev = plgpu.load(hs.at[t], layout=ROWS, optimized=False)
                decay = jnp.exp2(dl[:, None] * a2)
                dh = gy[:, None] * c_t[None, :] + lam
                hb = jnp.sum(dh * b_t[None, :], axis=1)
                x = dh * decay * h_prev
                d_dl = u_t * hb + LN_2 * jnp.sum(a2 * x, axis=1)
                d_raw = d_dl * softplus_thresholded_grad(raw) if softplus else d_dl
                du_s[t] = (dl * hb + d_skip * gy).astype(du_s.dtype)
                dd_s[t] = d_raw.astype(dd_s.dtype)
                if has_z:
                    y = jnp.sum(h_t * c_t[None, :], axis=1) + d_skip * u_t
                    dz_s[t] = (row(do_s, t) * y * (sz * (1.0 + zt * (1.0 - sz)))).astype(dz_s.dtype)
                dA = dA + dl[:, None] * x
                dD = dD + gy * u_t
                dbias = dbias + d_raw
                lam = decay * dh
                p_s[:, t * n:(t + 1) * n] = dh * (dl * u_t)[:, None]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(du_s, du_g.at[bi, rows, pl.ds(d0, CHANNELS)])
            plgpu.copy_smem_to_gmem(dd_s, dd_g.at[bi, rows, pl.ds(d0, CHANNELS)])
            if has_z:
                plgpu.copy_smem_to_gmem(dz_s, dz_g.at[bi, rows, pl.ds(d0, CHANNELS)])
            channel_sums(t0, db_g)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return lam, dA, dD, dbias

        zero_rows = plgpu.layout_cast(jnp.zeros((CHANNELS, n), F32), ROWS)
        zero_row = plgpu.layout_cast(jnp.zeros((CHANNELS,), F32), CHANNEL_ROW)
        lam, dA, dD, dbias = lax.fori_loop(0, nc, one_chunk, (lam0, zero_rows, zero_row, zero_row))
        st_s[...] = lam
        vo_s[0] = dD
        vo_s[1] = dbias
        hs[0] = dA
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_s, dh0_g.at[bi, pl.ds(d0, CHANNELS)])
        plgpu.copy_smem_to_gmem(hs.at[0], da_g.at[bi, pl.ds(d0, CHANNELS)])
        plgpu.copy_smem_to_gmem(vo_s, dv_g.at[bi, :, pl.ds(d0, CHANNELS)])
        plgpu.wait_smem_to_gmem(0)

    row_grad = lambda dt: jax.ShapeDtypeStruct((bsz, T, d), dt)
    zdt = z.dtype if has_z else u.dtype
    kernel = plgpu.kernel(
        body,
        out_type=(row_grad(u.dtype), row_grad(delta.dtype), row_grad(zdt),
                  jax.ShapeDtypeStruct((nblk, bsz, T * n), F32), jax.ShapeDtypeStruct((nblk, bsz, T * n), F32),
                  jax.ShapeDtypeStruct((bsz, d, n), F32), jax.ShapeDtypeStruct((bsz, 2, d), F32),
                  jax.ShapeDtypeStruct((bsz, d, n), F32)),
        grid=(bsz, nblk), grid_names=("b", "d"),
        scratch_types=[
            plgpu.SMEM((L, CHANNELS), u.dtype), plgpu.SMEM((L, CHANNELS), delta.dtype),
            plgpu.SMEM((L, CHANNELS), zdt), plgpu.SMEM((L, CHANNELS), d_out.dtype),
            plgpu.SMEM((CHANNELS, n), F32), plgpu.SMEM((L, n), F32), plgpu.SMEM((L, n), F32),
            plgpu.SMEM((2, CHANNELS), F32),
            plgpu.SMEM((L + 1, CHANNELS, n), F32),             # the chunk's states (and dA at the end)
            plgpu.SMEM((CHANNELS, width), F32),                # products for one channel sum
            plgpu.SMEM((width,), F32),                         # a chunk's dB or dC rows on their way out
            plgpu.SMEM((L, CHANNELS), u.dtype), plgpu.SMEM((L, CHANNELS), delta.dtype),
            plgpu.SMEM((L, CHANNELS), zdt),
            plgpu.SMEM((CHANNELS, n), F32),                    # d_final in, d_initial_state out
            plgpu.SMEM((2, CHANNELS), F32),                    # dD, d bias out
            plgpu.Barrier(num_barriers=10),
        ],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    du, dd, dz, db, dc, dA, dv, dh0 = kernel(u, delta, z if has_z else u, d_out, A2, B, C, channel_vectors, entry,
                                             d_final)
    dB = db.sum(axis=0).reshape(bsz, T, n)
    dC = dc.sum(axis=0).reshape(bsz, T, n)
    dv = dv.sum(axis=0)
    return (du, dd, dA.sum(axis=0), dB, dC, dv[0] if has_D else None, dz if has_z else None,
            dv[1] if has_bias else None, dh0)
