"""Parameter initializers that reproduce the official (PyTorch) init rules.

All draws are float32. `torch_linear_uniform` is PyTorch's default `nn.Linear`/`nn.Conv1d` init,
kaiming_uniform(a=√5), i.e. U(−1/√fan_in, +1/√fan_in).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

f32 = jnp.float32


def uniform(key, shape, bound):
    """U(−bound, +bound), float32."""
    return jax.random.uniform(key, shape, f32, -bound, bound)


def torch_linear_uniform(key, shape, fan_in):
    """PyTorch default Linear/Conv init: U(±1/√fan_in)."""
    return uniform(key, shape, 1.0 / math.sqrt(fan_in))


def inverse_softplus_dt_bias(key, shape, dt_min, dt_max, dt_init_floor):
    """Bias b with softplus(b) = dt, dt log-uniform in [dt_min, dt_max] and floored at dt_init_floor.

    b = dt + log(−expm1(−dt)) (= log(exp(dt) − 1)), the official Mamba dt init.
    """
    r = jax.random.uniform(key, shape, f32)
    dt = jnp.exp(r * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = jnp.maximum(dt, dt_init_floor)
    return dt + jnp.log(-jnp.expm1(-dt))
