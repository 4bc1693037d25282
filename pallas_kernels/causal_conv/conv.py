"""Launches of the causal-conv kernels: padding, the halo block specs, the partial-sum reductions.

Shapes: src [Bt, T, C] holds x in its channels [0, E) (C = E, or C = 2E for in_proj's packed x | z
output, read in place); conv_state [Bt, K-1, E]; kernel [K, E]; bias [E] or None; reset [Bt, T]
bool or None. E must be a multiple of the channel block (the largest power of two dividing E, at
most `config.block_e`), which always holds, so the packed z half starts on a block boundary.

A program's halo rows come from extra block specs on the same arrays (blocks of H rows just before
and just after its block, clamped inside the array; the clamped ones are never used unmasked), so
nothing is copied to build them. T is padded to whole blocks only when it is not a multiple of
`block_t` (a copy of the operands; the benchmark shapes need none).

Numerics: float32 throughout (see kernels.py); u and the cotangents are rounded once to their
arrays' dtypes; the dw / db partials ([Bt, T/block_t, ...] float32) are summed by XLA in a fixed
order (deterministic).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.causal_conv import kernels, rows_loop
from pallas_kernels.causal_conv.config import DEFAULT_CONV_CONFIG, ConvBlockConfig
from pallas_kernels.common.dtypes import F32, I32
from pallas_kernels.common.launch import run_kernel
from pallas_kernels.common.padding import pad_axis_to
from pallas_kernels.common.sizes import largest_power_of_2_dividing, next_power_of_2, round_up
from pallas_kernels.selective_scan.kernel_math import KernelMath


class _Tiling:
    """Block sizes and the block specs of one call."""

    def __init__(self, src, kernel, config: ConvBlockConfig | None, interpret: bool):
        cfg = (config or DEFAULT_CONV_CONFIG).validate()
        self.km = KernelMath(fast=cfg.fast_math, fused=cfg.fused_multiply_add, gpu=not interpret)
        self.bodies = rows_loop if cfg.loop_rows else kernels     # forward_body / backward_body
        self.bt, self.seqlen, self.channels = src.shape
        self.k_size, self.e = kernel.shape
        self.halo = next_power_of_2(max(self.k_size - 1, 1))
        self.block_t = max(cfg.block_t, self.halo)
        self.block_e = min(cfg.block_e, largest_power_of_2_dividing(self.e))
        self.num_warps = cfg.num_warps
        self.t_pad = round_up(max(self.seqlen, 1), self.block_t)
        self.n_t, self.n_e = self.t_pad // self.block_t, self.e // self.block_e
        self.k_pad = next_power_of_2(self.k_size)
        self.per = self.block_t // self.halo        # halo blocks per block
        self.last_halo = self.t_pad // self.halo - 1

    def grid(self, channel_blocks):
        return (self.bt, self.n_t, channel_blocks)

    def _e(self, e):
        return jnp.minimum(e, self.n_e - 1)

    def rows(self, offset_blocks=0):
        """[block_t, block_e] blocks; `offset_blocks` shifts the channel block (the packed z half)."""
        if offset_blocks:
            return pl.BlockSpec((None, self.block_t, self.block_e),
                                lambda b, t, e: (b, t, jnp.maximum(e - offset_blocks, 0)))
        return pl.BlockSpec((None, self.block_t, self.block_e), lambda b, t, e: (b, t, self._e(e)))

    def out_rows(self):
        return pl.BlockSpec((None, self.block_t, self.block_e), lambda b, t, e: (b, t, e))

    def past(self):
        return pl.BlockSpec((None, self.halo, self.block_e),
                            lambda b, t, e: (b, jnp.maximum(t * self.per - 1, 0), self._e(e)))

    def future(self):
        return pl.BlockSpec((None, self.halo, self.block_e),
                            lambda b, t, e: (b, jnp.minimum((t + 1) * self.per, self.last_halo), self._e(e)))

    def per_batch(self):
        return pl.BlockSpec((None, self.halo, self.block_e), lambda b, t, e: (b, 0, self._e(e)))

    def weights(self):
        return pl.BlockSpec((self.k_pad, self.block_e), lambda b, t, e: (0, self._e(e)))

    def channel_vector(self):
        return pl.BlockSpec((self.block_e,), lambda b, t, e: (self._e(e),))

    def dist(self):
        return pl.BlockSpec((None, self.block_t), lambda b, t, e: (b, t))

    def dist_future(self):
        return pl.BlockSpec((None, self.halo), lambda b, t, e: (b, jnp.minimum((t + 1) * self.per, self.last_halo)))

    def partial_rows(self, rows):
        return pl.BlockSpec((None, None, rows, self.block_e), lambda b, t, e: (b, t, 0, self._e(e)))

    def partial_vector(self):
        return pl.BlockSpec((None, None, self.block_e), lambda b, t, e: (b, t, self._e(e)))


def reset_distance(reset, k_size):
    """[Bt, T] int32: positions since the latest reset at or before t, capped at K (K = never within
    reach of any tap). Tap k (look-back j = K-1-k) reads x̃[t - j] iff j <= distance."""
    t = reset.shape[1]
    pos = jnp.arange(t, dtype=I32)
    latest = jax.lax.cummax(jnp.where(reset, pos[None, :], -k_size), axis=1)
    return jnp.minimum(pos[None, :] - latest, k_size).astype(I32)


def _common_operands(tiling, src, conv_state, kernel, bias, reset):
    t = tiling
    src = pad_axis_to(src, 1, t.t_pad)
    state = jnp.pad(conv_state.astype(F32), ((0, 0), (t.halo - (t.k_size - 1), 0), (0, 0)))
    w = pad_axis_to(kernel.astype(F32), 0, t.k_pad)
    b = jnp.zeros((t.e,), F32) if bias is None else bias.astype(F32)
    dist = None if reset is None else pad_axis_to(reset_distance(reset, t.k_size), 1, t.t_pad, t.k_size)
    return src, state, w, b, dist


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def conv_silu_forward(src, conv_state, kernel, bias, reset, *, config=None, interpret=False):
    """u = silu(causal_conv(x̃) + bias) [Bt, T, E] in src.dtype (x = src[..., :E]; module docstring)."""
    t = _Tiling(src, kernel, config, interpret)
    src_p, state, w, b, dist = _common_operands(t, src, conv_state, kernel, bias, reset)
    inputs = [("x", src_p, t.rows()), ("past", src_p, t.past()), ("state", state, t.per_batch()),
              ("w", w, t.weights()), ("bias", b, t.channel_vector()), ("dist", dist, t.dist())]
    out = run_kernel(
        functools.partial(t.bodies.forward_body, k_size=t.k_size, halo=t.halo, block_t=t.block_t,
                          has_reset=reset is not None, km=t.km),
        grid=t.grid(t.n_e), inputs=inputs,
        outputs=[("u", jax.ShapeDtypeStruct((t.bt, t.t_pad, t.e), src.dtype), t.out_rows())],
        name="causal_conv_silu_forward", num_warps=t.num_warps, num_stages=1, interpret=interpret)
    return out["u"][:, :t.seqlen]


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def conv_silu_backward(src, conv_state, kernel, bias, reset, du_a, du_b, dz, d_new=None, *, config=None,
                       interpret=False):
    """Cotangents of `conv_silu_forward` for du = du_a + du_b (each [Bt, T, E], any float dtype).

    dz: None for src = x ([Bt, T, E]); for the packed src [Bt, T, 2E], the gate's cotangent
    [Bt, T, E], written into the second half of the returned d_src.
    d_new: None, or [Bt, K-1, E]: the cotangent of the new conv state when that state is x's last
      K-1 rows (T >= K-1; the caller has zeroed the rows a reset drops); added to dx there.

    Returns:
      (d_src [Bt, T, C] src.dtype, d_state [Bt, K-1, E] float32, dkernel [K, E] float32,
       dbias [E] float32).
    """
    t = _Tiling(src, kernel, config, interpret)
    if d_new is not None and (t.seqlen < t.k_size - 1 or d_new.shape != (t.bt, t.k_size - 1, t.e)):
        raise ValueError(f"d_new must be [Bt, K-1, E] = {(t.bt, t.k_size - 1, t.e)} with T >= K-1, got "
                         f"{d_new.shape} with T = {t.seqlen}")
    if d_new is not None and t.k_size == 1:
        d_new = None
    packed = t.channels != t.e
    if packed != (dz is not None):
        raise ValueError(f"dz must be given exactly when src is the packed [Bt, T, 2E] array "
                         f"(src has {t.channels} channels, the kernel {t.e})")
    src_p, state, w, b, dist = _common_operands(t, src, conv_state, kernel, bias, reset)
    du_a, du_b = pad_axis_to(du_a, 1, t.t_pad), pad_axis_to(du_b, 1, t.t_pad)
    channel_blocks = t.channels // t.block_e
    inputs = [("x", src_p, t.rows()), ("past", src_p, t.past()), ("future", src_p, t.future()),
              ("state", state, t.per_batch()), ("w", w, t.weights()), ("bias", b, t.channel_vector()),
              ("dist", dist, t.dist()), ("dist_future", dist, t.dist_future() if dist is not None else None),
              ("du_a", du_a, t.rows()), ("du_a_future", du_a, t.future()),
              ("du_b", du_b, t.rows()), ("du_b_future", du_b, t.future()),
              ("dz", None if dz is None else pad_axis_to(dz, 1, t.t_pad), t.rows(offset_blocks=t.n_e)),
              ("d_new", None if d_new is None else pad_axis_to(d_new.astype(F32), 1, t.halo), t.per_batch())]
    outputs = [("dx", jax.ShapeDtypeStruct((t.bt, t.t_pad, t.channels), src.dtype), t.out_rows()),
               ("dw", jax.ShapeDtypeStruct((t.bt, t.n_t, t.k_pad, t.e), F32), t.partial_rows(t.k_pad)),
               ("db", jax.ShapeDtypeStruct((t.bt, t.n_t, t.e), F32), t.partial_vector()),
               ("d_state", jax.ShapeDtypeStruct((t.bt, t.halo, t.e), F32), t.per_batch())]
    out = run_kernel(
        functools.partial(t.bodies.backward_body, k_size=t.k_size, halo=t.halo, block_t=t.block_t,
                          seqlen=t.seqlen, has_reset=reset is not None, conv_blocks=t.n_e, km=t.km),
        grid=t.grid(channel_blocks), inputs=inputs, outputs=outputs,
        name="causal_conv_silu_backward", num_warps=t.num_warps, num_stages=1, interpret=interpret)
    d_src = out["dx"][:, :t.seqlen]
    dkernel = jnp.sum(out["dw"], axis=(0, 1))[:t.k_size]
    dbias = jnp.sum(out["db"], axis=(0, 1))
    d_state = out["d_state"][:, t.halo - (t.k_size - 1):]
    return d_src, d_state, dkernel, dbias
