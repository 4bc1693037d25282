"""The "reference" log-sum-exp: the textbook two passes (the row max, then log Σ exp(x − max))."""

from __future__ import annotations

import jax.numpy as jnp

F32 = jnp.float32


def log_sum_exp_two_pass(x, *, tuning=None):
    """m + log Σ_v exp(x_v − m) with m = max_v x_v, float32 ([..., V] -> [...]): two reductions over x.
    Rows of −inf give NaN (−inf − −inf); a NaN or +inf in the row gives a non-finite result."""
    x = x.astype(F32)
    m = jnp.max(x, axis=-1, keepdims=True)
    return (m + jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)))[..., 0]
