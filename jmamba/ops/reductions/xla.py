"""The "xla" log-sum-exp: one variadic XLA reduction (the running max and the rescaled sum in one
pass over the row), the automatic choice."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def log_sum_exp_one_pass(x, *, tuning=None):
    """log Σ_v exp(x_v) over the last axis in float32, in one pass over x ([..., V] -> [...]).

    One variadic reduction carries (running max m, Σ exp(x − m)) and rescales the sum when the max
    grows, instead of a max pass and an exp-sum pass over the (bf16, [B, T, V]) logits. Two partial
    pairs combine as (M, s_hi + s_lo·exp(m_lo − M)) with M = max(m_hi, m_lo): one exp per element,
    finite rows exact up to float32 rounding of that order; an empty part (−inf, 0) adds nothing; a
    NaN or +inf in the row gives a non-finite result.
    """
    def combine(a, b):
        (m1, s1), (m2, s2) = a, b
        first = m1 >= m2
        hi, lo = jnp.where(first, m1, m2), jnp.where(first, m2, m1)
        s_hi, s_lo = jnp.where(first, s1, s2), jnp.where(first, s2, s1)
        # equal maxima (also −inf with −inf, +inf with +inf) rescale by 1, never exp(nan)
        return hi, s_hi + s_lo * jnp.exp(jnp.where(hi == lo, 0.0, lo - hi))

    x = x.astype(F32)
    init = (jnp.array(-jnp.inf, F32), jnp.array(0.0, F32))
    m, s = jax.lax.reduce((x, jnp.ones_like(x)), init, combine, (x.ndim - 1,))
    return m + jnp.log(s)
