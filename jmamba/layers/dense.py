"""`Dense`: y = x · kernel (+ bias), kernel stored [in, out] in float32 (master precision).

The matmul runs in the dtype of the incoming activations (the kernel is cast to it), so the
compute precision is chosen by whoever casts the activations (see `jmamba.Precision`); XLA
accumulates bf16/f16 matmuls in float32 on GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jmamba.layers.initializers import torch_linear_uniform
from jmamba.layers.tags import param


class Dense(nnx.Module):
    """Linear layer with PyTorch's default init (kernel U(±1/√in)·init_scale, bias zeros).

    Attributes:
      kernel: [in_features, out_features] float32.
      bias: [out_features] float32, or None; `bias_no_decay` lists the no-weight-decay modes it
        belongs to (NNX metadata read by `jmamba.no_decay_mask`).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = False,
                 init_scale: float = 1.0, bias_no_decay: tuple = (), rngs: nnx.Rngs):
        w = torch_linear_uniform(rngs.params(), (in_features, out_features), in_features) * init_scale
        self.kernel = nnx.Param(w)
        self.bias = (param(jnp.zeros((out_features,), jnp.float32), no_decay=bias_no_decay)
                     if use_bias else None)

    def __call__(self, x):
        y = jnp.dot(x, self.kernel[...].astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y
