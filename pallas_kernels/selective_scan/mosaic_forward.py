"""A Mosaic GPU forward of the Mamba-1 selective scan (Hopper: TMA, one warpgroup per program): a prototype.

Status: verified on CPU only — values in the Mosaic GPU interpreter against the op's reference, and the
real Pallas -> Mosaic GPU lowering for CUDA (layout inference, TMA shape rules, the shared-memory
budget) on an abstract sm_90 — not yet compiled by ptxas, run or timed on an H200. It runs only when
asked for (`ScanBlockConfig(fwd_mosaic=True)`, below); `benchmarks/bench_mosaic_forward.py` times it
beside the Triton forward, and tests/test_selective_scan_mosaic.py holds its GPU tests. Why it exists: the Triton kernels walk each
(channel block, chunk) with a 1-warp program whose layout Triton chooses; here the layout is chosen
(benchmarks/notes_training_step.md, "after session 14", item 1).

Design: one program (a CTA of one warpgroup, 128 threads) per (batch row, block of 128 channels); thread
i owns channel i and keeps its n states in registers (layout TCGEN05_TMEM_NATIVE: row i of a [128, n]
array lives in thread i, so y_t = Σ_n h·C_t and the decay never leave the thread). The program walks the
whole sequence one chunk of L steps at a time: TMA copies of the chunk's [L, 128] rows of u, δ (and z)
and its [L, n] rows of B, C into shared memory, L steps, a TMA store of the [L, 128] output rows. The
state entering every chunk is stored as well (the Triton backward's chunk start states, transposed).

Per step, float32: δ = softplus_thr(raw + bias) (or raw + bias), ā = exp2(δ·A·log2 e), h = ā·h + δ·u·B_t,
y = Σ_n h·C_t + D·u, out = y·z·σ(z) rounded once to u.dtype.

Limits of the prototype (the op's other cases stay on the Triton kernels): one B/C group, no reset mask,
d a multiple of 128, T a multiple of the chunk, n a multiple of 4 (16-byte TMA rows).
`ScanBlockConfig(fwd_mosaic=True)` makes the Pallas scan's forward use it where these hold (scan.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.selective_scan.kernel_math import SOFTPLUS_THRESHOLD, sigmoid

F32 = jnp.float32
CHANNELS = 128                                    # one warpgroup, one channel per thread
ROWS = plgpu.Layout.TCGEN05_TMEM_NATIVE           # [128, n]: thread i holds row i
CHANNEL_ROW = ROWS.reduce(1)                      # [128]: one element per thread
STATE_ROW = ROWS.reduce(0)                        # [n]: every thread holds all of it
LOG2_E = 1.0 / math.log(2.0)


def log1p(y):
    """log(1 + y) to a few ulps without a log1p instruction (the Mosaic GPU lowering has none):
    log(u)·y/(u − 1) with u = 1 + y rounded (Goldberg), y itself where u rounds to 1."""
    u = 1.0 + y
    return jnp.where(u == 1.0, y, jnp.log(u) * (y / (u - 1.0)))


def softplus_thresholded(x):
    """`x if x > 20 else log1p(exp(x))`, as kernel_math.softplus_thresholded (the Triton kernels')."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def check_supported(u, B, *, chunk):
    """None when the prototype handles these shapes, else the reason in words."""
    bsz, T, d = u.shape
    if B.ndim != 3:
        return f"B must be [batch, seqlen, d_state] (one group), got shape {B.shape}"
    n = B.shape[-1]
    if d % CHANNELS:
        return f"d_inner {d} is not a multiple of {CHANNELS}"
    if T % chunk or chunk > 256 or chunk < 1:
        return f"seqlen {T} is not a multiple of the chunk {chunk} (at most 256)"
    if n % 4 or n > 256:
        return f"d_state {n} must be a multiple of 4 and at most 256 (16-byte TMA rows)"
    return None


def mosaic_forward(u, delta, A, B, C, D=None, z=None, delta_bias=None, initial_state=None, *, softplus=True,
                   chunk=64, z_channel_offset=0, interpret=False):
    """The selective scan's forward on one H200 (or the Mosaic GPU interpreter).

    Args:
      u, delta: [Bt, T, d] (bf16, f16 or f32; delta raw, before bias and softplus).
      z: [Bt, T, d] gate, or a wider [Bt, T, C] array whose channels [z_channel_offset, + d) are the
        gate (read in place: in_proj's packed x | z), or None.
      A: [d, n] float32 (negative); B, C: [Bt, T, n] (one group; any float dtype, read as float32).
      D, delta_bias: [d] or None. initial_state: [Bt, d, n] or None (zeros).
      softplus: apply the thresholded softplus to delta + delta_bias.
      chunk: time steps per TMA tile (T must be a multiple).
      interpret: run in the Mosaic GPU interpreter (CPU tests).

    Returns:
      (out [Bt, T, d] in u.dtype, final state [Bt, d, n] float32, chunk states [Bt, T/chunk, d, n]
      float32: the state entering each chunk, δ sums [Bt, T/chunk, d] float32: Σ δ over each chunk).
    """
    reason = check_supported(u, B, chunk=chunk)
    if reason:
        raise ValueError(f"mosaic_forward: {reason}")
    bsz, T, d = u.shape
    n = B.shape[-1]
    nc, L = T // chunk, chunk
    has_z, has_D, has_bias = z is not None, D is not None, delta_bias is not None
    if has_z and (z.shape[:2] != (bsz, T) or z.shape[-1] < z_channel_offset + d
                  or z_channel_offset % CHANNELS):
        raise ValueError(f"mosaic_forward: z of shape {z.shape} has no channels [{z_channel_offset}, "
                         f"{z_channel_offset + d}) at a multiple of {CHANNELS} for u of shape {u.shape}")
    h0 = jnp.zeros((bsz, d, n), F32) if initial_state is None else initial_state.astype(F32)
    A2 = (A.astype(F32) * LOG2_E)
    B, C = B.astype(F32), C.astype(F32)
    channel_vectors = jnp.stack([(D if has_D else jnp.zeros((d,), F32)).astype(F32),
                                 (delta_bias if has_bias else jnp.zeros((d,), F32)).astype(F32)])   # [2, d]

    def body(u_g, dl_g, z_g, a_g, b_g, c_g, v_g, h0_g, out_g, final_g, states_g, sums_g,
             u_s, dl_s, z_s, a_s, b_s, c_s, v_s, y_s, h_s, s_s, bars):
        bi = lax.axis_index("b")
        d0 = pl.multiple_of(lax.axis_index("d") * CHANNELS, CHANNELS)
        plgpu.copy_gmem_to_smem(a_g.at[pl.ds(d0, CHANNELS)], a_s, bars.at[5])
        plgpu.copy_gmem_to_smem(v_g.at[:, pl.ds(d0, CHANNELS)], v_s, bars.at[6])
        plgpu.copy_gmem_to_smem(h0_g.at[bi, pl.ds(d0, CHANNELS)], h_s, bars.at[7])
        for k in (5, 6, 7):
            plgpu.barrier_wait(bars.at[k])
        a2 = plgpu.load(a_s, layout=ROWS, optimized=False)                            # [128, n]
        d_skip = plgpu.load(v_s.at[0], layout=CHANNEL_ROW, optimized=False)
        bias = plgpu.load(v_s.at[1], layout=CHANNEL_ROW, optimized=False)

        def one_chunk(ci, h):
            t0 = pl.multiple_of(ci * L, L)
            rows = pl.ds(t0, L)
            plgpu.copy_gmem_to_smem(u_g.at[bi, rows, pl.ds(d0, CHANNELS)], u_s, bars.at[0])
            plgpu.copy_gmem_to_smem(dl_g.at[bi, rows, pl.ds(d0, CHANNELS)], dl_s, bars.at[1])
            plgpu.copy_gmem_to_smem(b_g.at[bi, rows], b_s, bars.at[2])
            plgpu.copy_gmem_to_smem(c_g.at[bi, rows], c_s, bars.at[3])
            if has_z:
                plgpu.copy_gmem_to_smem(z_g.at[bi, rows, pl.ds(z_channel_offset + d0, CHANNELS)], z_s, bars.at[4])
            # the state entering this chunk: registers -> shared memory -> HBM
            h_s[...] = h
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(h_s, states_g.at[bi, ci, pl.ds(d0, CHANNELS)])
            for k in range(5 if has_z else 4):
                plgpu.barrier_wait(bars.at[k])

            def step(t, carry):
                h, dsum = carry
                u_t = plgpu.load(u_s.at[t], layout=CHANNEL_ROW, optimized=False).astype(F32)
                x = plgpu.load(dl_s.at[t], layout=CHANNEL_ROW, optimized=False).astype(F32) + bias
                if softplus:
                    x = softplus_thresholded(x)
                b_t = plgpu.load(b_s.at[t], layout=STATE_ROW, optimized=False)
                c_t = plgpu.load(c_s.at[t], layout=STATE_ROW, optimized=False)
                h = jnp.exp2(x[:, None] * a2) * h + (x * u_t)[:, None] * b_t[None, :]
                y = jnp.sum(h * c_t[None, :], axis=1) + d_skip * u_t
                if has_z:
                    zt = plgpu.load(z_s.at[t], layout=CHANNEL_ROW, optimized=False).astype(F32)
                    y = y * (zt * sigmoid(zt))
                y_s[t] = y.astype(y_s.dtype)
                return h, dsum + x

            zero = plgpu.layout_cast(jnp.zeros((CHANNELS,), F32), CHANNEL_ROW)
            h, dsum = lax.fori_loop(0, L, step, (h, zero))
            s_s[0] = dsum
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_s, out_g.at[bi, rows, pl.ds(d0, CHANNELS)])
            plgpu.copy_smem_to_gmem(s_s, sums_g.at[bi, pl.ds(ci, 1), pl.ds(d0, CHANNELS)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)          # y_s, h_s and s_s reusable
            return h

        h = lax.fori_loop(0, nc, one_chunk, plgpu.load(h_s, layout=ROWS, optimized=False))
        h_s[...] = h
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(h_s, final_g.at[bi, pl.ds(d0, CHANNELS)])
        plgpu.wait_smem_to_gmem(0)

    io = u.dtype
    kernel = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct((bsz, T, d), io), jax.ShapeDtypeStruct((bsz, d, n), F32),
                  jax.ShapeDtypeStruct((bsz, nc, d, n), F32), jax.ShapeDtypeStruct((bsz, nc, d), F32)),
        grid=(bsz, d // CHANNELS), grid_names=("b", "d"),
        scratch_types=[
            plgpu.SMEM((L, CHANNELS), u.dtype),                     # u rows
            plgpu.SMEM((L, CHANNELS), delta.dtype),                 # raw delta rows
            plgpu.SMEM((L, CHANNELS), z.dtype if has_z else u.dtype),   # z rows (unused without z)
            plgpu.SMEM((CHANNELS, n), F32),                         # A·log2 e
            plgpu.SMEM((L, n), F32),                                # B rows
            plgpu.SMEM((L, n), F32),                                # C rows
            plgpu.SMEM((2, CHANNELS), F32),                         # D, delta_bias
            plgpu.SMEM((L, CHANNELS), io),                          # output rows
            plgpu.SMEM((CHANNELS, n), F32),                         # a state on its way to / from HBM
            plgpu.SMEM((1, CHANNELS), F32),                         # a chunk's δ sums on their way to HBM
            plgpu.Barrier(num_barriers=8),
        ],
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(u, delta, z if has_z else u, A2, B, C, channel_vectors, h0)
