"""Reference selective scan: a float32 `lax.scan` over time (the oracle every other path is tested against).

Numerics: all inputs are cast to float32 first (float64 stays float64, for gradient checks); the
state `h [B, d, n]` and every product are f32; the output is cast back to `u.dtype` at the very end (as the official `selective_scan_ref`).
Memory: O(B·d·n) live state; autodiff through `lax.scan` stores one state per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.ops.selective_scan.common import expand_groups, prepare_delta


def selective_scan_reference(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, *, delta_softplus,
                             tuning=None):
    """Sequential selective scan.

    Args:
      u, delta: [Bt, T, d]. A: [d, n]. B, C: [Bt, T, g, n]. D, delta_bias: [d] or None.
      z: [Bt, T, d] or None. initial_state: [Bt, d, n] or None. reset: [Bt, T] bool or None
      (True zeroes the state entering position t).
      delta_softplus: apply the thresholded softplus to `delta + delta_bias`.
      tuning: accepted for the common signature and ignored.

    Returns:
      (y [Bt, T, d] in u.dtype, final_state [Bt, d, n] float32).
    """
    del tuning
    bsz, _, d = u.shape
    n = A.shape[-1]
    f32 = accum_dtype(u.dtype, A.dtype)
    dl = prepare_delta(delta, delta_bias, delta_softplus, f32)
    uf = u.astype(f32)
    Af = A.astype(f32)
    h0 = jnp.zeros((bsz, d, n), f32) if initial_state is None else initial_state.astype(f32)
    rs = jnp.zeros(u.shape[:2], bool) if reset is None else reset

    def step(h, xs):
        u_t, d_t, b_t, c_t, r_t = xs
        h = jnp.where(r_t[:, None, None], 0.0, h)
        a = jnp.exp(d_t[:, :, None] * Af)
        h = a * h + (d_t * u_t)[:, :, None] * expand_groups(b_t.astype(f32), d)
        y = jnp.sum(h * expand_groups(c_t.astype(f32), d), axis=-1)
        return h, y

    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (uf, dl, B, C, rs))
    h_last, ys = jax.lax.scan(step, h0, xs)
    y = jnp.swapaxes(ys, 0, 1)
    if D is not None:
        y = y + D.astype(f32) * uf
    if z is not None:
        y = y * jax.nn.silu(z.astype(f32))
    return y.astype(u.dtype), h_last
