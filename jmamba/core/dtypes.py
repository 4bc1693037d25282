"""dtype helpers. jmamba accumulates in float32 unless the inputs are float64 (x64 gradient checks)."""

from __future__ import annotations

import jax.numpy as jnp


def accum_dtype(*dtypes):
    """float32 for bf16/f16/f32 inputs, float64 when any input is float64."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)
