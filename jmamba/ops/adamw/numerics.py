"""AdamW numerics shared by every implementation of `adamw_update`: the per-step scalars.

torch.optim.AdamW (decoupled weight decay on the old parameter, eps after the square root):

    t   = step count after this update (1 on the first step)
    m'  = b1 · m + (1 − b1) · g
    v'  = b2 · v + (1 − b2) · g²
    bc1 = 1 − b1^t,  bc2 = 1 − b2^t
    p'  = p − lr·wd·p − (lr / bc1) · m' / (√v' / √bc2 + eps)

Bias corrections without float64 on the device. torch computes 1 − b^t in float64 on the host.
Inside `jit` the step count is a traced int32 and float64 is off, and the naive float32
`1 − b**t` is poor: b is rounded to float32 (0.999 → 0.99900001) and 1 − b^t cancels, giving up to
2e-5 relative error at b = 0.999 and 2e-4 at b = 0.9999 (this is what optax does). Instead

    1 − b^t = −expm1(t · log b),

with log b computed in float64 on the host (b is a Python float) and rounded once to float32.
The map x ↦ −expm1(x) has relative condition number |x·eˣ/(eˣ − 1)| ≤ 1 for x < 0, so the
relative error of the result is the ~1e-7 error of the float32 product t·log b plus one ulp for
expm1: measured ≤ 3.3e-7 for b ∈ {0.9, …, 0.9999}, t ≤ 2·10⁵ (tests/test_fused_adamw.py
checks it against float64). t itself is exact in float32 up to 2^24 steps; beyond, b^t has
underflowed to 0 for any b < 1 − 1e-6 and the correction is exactly 1. No host callback, no
recompilation: the scalars are traced values.

If a beta is itself traced (e.g. `optax.inject_hyperparams` without `static_args=("b1", "b2")`),
log b is taken in float32 from the rounded beta; pass the betas as static floats to keep the
accuracy above.

The per-leaf update itself is in `reference.py` (plain JAX) and `pallas_kernels/fused_adamw` (the
kernel); both take the `AdamWStepScalars` built here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jmamba.core.validation import is_static_number
from pallas_kernels.fused_adamw import AdamWStepScalars

f32 = jnp.float32


def log_beta(beta, name: str) -> jax.Array:
    """log(beta) as float32: float64 on the host when `beta` is static, else float32 on the device."""
    if is_static_number(beta):
        b = float(beta)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b}")
        return jnp.asarray(-np.inf if b == 0.0 else math.log(b), f32)
    return jnp.log(jnp.asarray(beta, f32))


def one_minus(beta) -> jax.Array:
    """1 − beta as float32 (computed in float64 when `beta` is static)."""
    if is_static_number(beta):
        return jnp.asarray(1.0 - float(beta), f32)
    return 1.0 - jnp.asarray(beta, f32)


def bias_correction(beta, step) -> jax.Array:
    """1 − beta^step in float32, accurate to a few ulp (see the module docstring).

    Args:
      beta: the decay rate, a Python float (preferred) or a float32 scalar.
      step: the 1-based step count, an integer scalar (traced is fine).

    Returns:
      float32 scalar.
    """
    t = jnp.asarray(step).astype(f32)
    lb = log_beta(beta, "beta")
    # beta == 0: log b = −inf and t ≥ 1, so −expm1(−inf) = 1 exactly.
    return -jnp.expm1(t * lb)


def step_scalars(*, learning_rate, b1, b2, eps, weight_decay, step, grad_scale=None,
                 skip=None) -> AdamWStepScalars:
    """The float32 scalars of AdamW step number `step` (1-based).

    Args:
      learning_rate: float32 scalar (possibly traced, e.g. a schedule's value).
      b1, b2, eps, weight_decay: hyperparameters (Python floats or float32 scalars).
      step: int scalar, the count after this update.
      grad_scale: optional multiplier of the gradient (None = 1).
      skip: optional bool scalar; True leaves everything unchanged.
    """
    lr = jnp.asarray(learning_rate, f32)
    bc1 = bias_correction(b1, step)
    bc2 = bias_correction(b2, step)
    return AdamWStepScalars(
        b1=jnp.asarray(b1, f32), one_minus_b1=one_minus(b1),
        b2=jnp.asarray(b2, f32), one_minus_b2=one_minus(b2),
        eps=jnp.asarray(eps, f32),
        step_size=lr / bc1,
        sqrt_bc2=jnp.sqrt(bc2),
        lr_wd=lr * jnp.asarray(weight_decay, f32),
        grad_scale=jnp.asarray(1.0 if grad_scale is None else grad_scale, f32),
        skip=jnp.asarray(False if skip is None else skip).astype(f32),
    )
