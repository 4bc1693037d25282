"""RMSNorm without bias: y = weight · x / √(mean(x²) + eps), statistics in float32.

The functional form and its custom VJP are the op layer's (`jmamba.ops.norms`, re-exported here);
`RMSNorm.add_and_norm` is the pre-norm residual step (`jmamba.ops.add_rms_norm`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jmamba.core.tags import REFERENCE
from jmamba.layers.tags import param
from jmamba.ops import add_rms_norm, rms_norm

__all__ = ["RMSNorm", "rms_norm"]


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

    def add_and_norm(self, x, residual, out_dtype=None):
        """(y, h): h = residual + x (x cast to residual's dtype; h = x when residual is None) and
        y = this norm of h in out_dtype (default h's dtype), as one op (`jmamba.ops.add_rms_norm`)."""
        return add_rms_norm(x, residual, self.weight[...], eps=self.eps,
                            out_dtype=None if out_dtype is None else jnp.dtype(out_dtype))
