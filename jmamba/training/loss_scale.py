"""Dynamic loss scaling for float16 training (mamba-rs / torch.cuda.amp.GradScaler constants).

The loss (or the caller's d_out) is multiplied by `scale` before the backward pass so that small
float16 cotangents do not flush to zero; gradients are divided by it afterwards. A step whose
gradients hold inf/NaN is skipped entirely and the scale halves; after `GROWTH_INTERVAL` consecutive
finite steps the scale doubles. The scale stays within [MIN_SCALE, MAX_SCALE].
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jmamba.training.guard import all_finite  # noqa: F401  (re-exported: the f16 overflow check)

INITIAL_SCALE = 2.0 ** 16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000
MIN_SCALE = 1.0
MAX_SCALE = 2.0 ** 24


class DynamicLossScale(NamedTuple):
    """State of the scaler.

    Attributes:
      scale: float32 scalar, the current loss scale.
      good_steps: int32 scalar, consecutive finite steps since the last change.
    """

    scale: jax.Array
    good_steps: jax.Array

    @classmethod
    def create(cls, initial_scale: float = INITIAL_SCALE) -> "DynamicLossScale":
        if not MIN_SCALE <= initial_scale <= MAX_SCALE:
            raise ValueError(f"initial_scale must be in [{MIN_SCALE}, {MAX_SCALE}], got {initial_scale}")
        return cls(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32))


def update_loss_scale(ls: DynamicLossScale, finite: jax.Array) -> DynamicLossScale:
    """Backoff on overflow, growth after GROWTH_INTERVAL finite steps, clamped to [MIN, MAX]."""
    good = jnp.where(finite, ls.good_steps + 1, 0)
    grow = finite & (good >= GROWTH_INTERVAL)
    scale = jnp.where(finite, jnp.where(grow, ls.scale * GROWTH_FACTOR, ls.scale), ls.scale * BACKOFF_FACTOR)
    scale = jnp.clip(scale, MIN_SCALE, MAX_SCALE)
    return DynamicLossScale(scale.astype(jnp.float32), jnp.where(grow, 0, good).astype(jnp.int32))


def scale_cotangent(d_out, ls: DynamicLossScale | None):
    """d_out · scale before the backward pass (unchanged without a loss scale)."""
    return d_out if ls is None else d_out * ls.scale


def unscale_factor(ls: DynamicLossScale | None):
    """1 / scale (exact: scales are powers of two), or None without a loss scale."""
    return None if ls is None else 1.0 / ls.scale
