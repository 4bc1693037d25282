"""Causal depthwise conv1d with a carried left context and document-boundary resets (the math is the
op `jmamba.ops.causal_conv1d`; this module holds the layer and its init).

    x̃ = concat_time(S_conv, x)                         [Bt, K-1+T, E]
    c_t[e] = bias[e] + Σ_k kernel[k, e] · x̃[t + k, e]   tap K-1 multiplies x_t, tap 0 x_{t-K+1}

(PyTorch cross-correlation with padding K-1, first T outputs kept; `kernel[k, e] =
conv1d.weight[e, 0, k]`). With a reset mask, an input older than the most recent reset at or
before t is treated as zero, exactly as if the sequence had restarted there; the returned state
is zeroed likewise, so a window boundary is invisible.
Numerics: computed in float32 (K multiply-adds per element), returned as float32 (float64 inputs
stay float64).
"""

from __future__ import annotations

from flax import nnx

from jmamba.ops import causal_conv1d as causal_conv
from jmamba.ops import causal_conv1d_step as causal_conv_step
from jmamba.layers.initializers import torch_linear_uniform

__all__ = ["CausalConv1d", "causal_conv", "causal_conv_step"]


class CausalConv1d(nnx.Module):
    """Depthwise causal conv with PyTorch Conv1d default init (weight and bias U(±1/√K)).

    Attributes:
      kernel: [K, E] float32 (= torch `conv1d.weight[:, 0, :].T`).
      bias: [E] float32, or None (`use_bias=False`).
    """

    def __init__(self, channels: int, kernel_size: int, *, use_bias: bool = True, rngs: nnx.Rngs):
        self.kernel = nnx.Param(torch_linear_uniform(rngs.params(), (kernel_size, channels), kernel_size))
        self.bias = (nnx.Param(torch_linear_uniform(rngs.params(), (channels,), kernel_size))
                     if use_bias else None)

    def _bias(self):
        return None if self.bias is None else self.bias[...]

    def __call__(self, x, conv_state, reset=None):
        return causal_conv(x, conv_state, self.kernel[...], self._bias(), reset)

    def step(self, x_t, conv_state):
        return causal_conv_step(x_t, conv_state, self.kernel[...], self._bias())
