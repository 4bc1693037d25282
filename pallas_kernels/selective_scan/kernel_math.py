"""Scalar math shared by the selective-scan kernels, written with ops the Pallas-Triton lowering supports.

Every function here runs inside a kernel on float32 values (rows `[block_d]` or tiles
`[n, block_d]`), and also outside kernels in interpret mode, so only elementwise jnp ops are used.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

SOFTPLUS_THRESHOLD = 20.0
# The kernels receive A·log2(e) ("A2") and form ā = exp2(δ·A2): on CUDA exp2 is one `ex2.approx`
# instruction (max relative error ~2^-22), exp a longer libdevice routine (the official kernel does
# the same with exp2f).
LOG2_E = 1.0 / math.log(2.0)
LN_2 = math.log(2.0)


def softplus_thresholded(x):
    """`x if x > 20 else log1p(exp(x))` (torch `F.softplus`, the official CUDA kernel)."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def softplus_thresholded_grad(x):
    """d softplus_thr / dx: σ(x) at or below the threshold, exactly 1 above it."""
    return jnp.where(x > SOFTPLUS_THRESHOLD, 1.0, sigmoid(x))


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def time_step(raw, bias, softplus: bool):
    """δ = softplus_thr(raw + bias) (or raw + bias), float32. `bias` may be None."""
    x = raw.astype(jnp.float32)
    if bias is not None:
        x = x + bias
    return softplus_thresholded(x) if softplus else x


def decay(delta_row, A2_tile, keep):
    """ā = exp(δ·A) = exp2(δ·A2) as an [n, block_d] tile; `keep` (0 or 1, or None) zeroes it at a reset."""
    a = jnp.exp2(delta_row[None, :] * A2_tile)
    return a if keep is None else a * keep
