"""Pieces shared by every selective-scan implementation (pure JAX, float32)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.dtypes import accum_dtype
SOFTPLUS_THRESHOLD = 20.0


def softplus_thresholded(x):
    """`x if x > 20 else log1p(exp(x))` (torch `F.softplus`, the official CUDA kernel and mamba-rs).

    Its derivative is σ(x) below the threshold and exactly 1 above it.
    """
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def prepare_delta(delta, delta_bias, delta_softplus, acc=None):
    """`softplus_thr(delta + delta_bias)` (or without softplus) in `acc` (default float32), [Bt, T, d]."""
    acc = acc or accum_dtype(delta.dtype)
    dl = delta.astype(acc)
    if delta_bias is not None:
        dl = dl + delta_bias.astype(acc)
    if delta_softplus:
        dl = softplus_thresholded(dl)
    return dl


def expand_groups(x, d):
    """[..., g, n] -> [..., d, n]: channel e reads group e // (d // g) (official grouping)."""
    g = x.shape[-2]
    return jnp.repeat(x, d // g, axis=-2)


def reset_from_row_mask(reset, bsz, seqlen):
    """Normalizes a `[Bt]` or `[Bt, T]` reset mask to `[Bt, T]` bool (a row mask resets at t=0)."""
    if reset is None:
        return None
    reset = jnp.asarray(reset, bool)
    if reset.ndim == 1:
        return jnp.zeros((bsz, seqlen), bool).at[:, 0].set(reset)
    return reset
