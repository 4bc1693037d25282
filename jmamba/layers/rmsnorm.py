"""RMSNorm without bias: y = weight · x / √(mean(x²) + eps), statistics in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmamba.core.dtypes import accum_dtype
from jmamba.core.tags import REFERENCE
from jmamba.layers.tags import param


def rms_norm(x, weight, eps, out_dtype=None):
    """Functional RMSNorm over the last axis.

    Args:
      x: [..., D] any float dtype; normalized in float32.
      weight: [D].
      eps: added to the mean square inside the square root.
      out_dtype: dtype of the result (default: x.dtype).
    """
    acc = accum_dtype(x.dtype)
    xf = x.astype(acc)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = xf * r * weight.astype(acc)
    return y.astype(out_dtype or x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with a learned scale `weight [D]` (ones at init, float32).

    The scale is in the "reference" no-weight-decay group of both architectures (every norm scale;
    docs/mamba1.md §2.3, docs/mamba3_siso.md §2.4), tagged as NNX metadata.
    """

    def __init__(self, dim: int, eps: float):
        self.weight = param(jnp.ones((dim,), jnp.float32), no_decay=(REFERENCE,))
        self.eps = eps

    def __call__(self, x, out_dtype=None):
        return rms_norm(x, self.weight[...], self.eps, out_dtype)
