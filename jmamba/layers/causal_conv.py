"""Causal depthwise conv1d with a carried left context and document-boundary resets.

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

import jax.numpy as jnp
from flax import nnx

from jmamba.core.dtypes import accum_dtype
from jmamba.layers.initializers import torch_linear_uniform


def causal_conv(x, conv_state, kernel, bias, reset=None):
    """Depthwise causal convolution over time.

    Args:
      x: [Bt, T, E] new inputs.
      conv_state: [Bt, K-1, E] the K-1 inputs before x, oldest first.
      kernel: [K, E]. bias: [E] or None.
      reset: optional [Bt, T] bool; True at t means nothing before t is seen by outputs ≥ t.

    Returns:
      (c [Bt, T, E] float32, new_state [Bt, K-1, E] float32 = the last K-1 inputs).
    """
    f32 = accum_dtype(x.dtype, kernel.dtype)
    k_size = kernel.shape[0]
    seqlen = x.shape[1]
    xt = jnp.concatenate([conv_state.astype(f32), x.astype(f32)], axis=1)   # [Bt, K-1+T, E]
    w = kernel.astype(f32)
    if reset is None:
        c = sum(w[k] * xt[:, k:k + seqlen] for k in range(k_size))
        new_state = xt[:, seqlen:]
    else:
        # Segment id of every position of x̃: the carried context is segment 0, each reset starts a new one.
        seg_x = jnp.cumsum(reset.astype(jnp.int32), axis=1)                   # [Bt, T]
        seg = jnp.concatenate([jnp.zeros((x.shape[0], k_size - 1), jnp.int32), seg_x], axis=1)
        c = sum(w[k] * jnp.where((seg[:, k:k + seqlen] == seg_x)[..., None], xt[:, k:k + seqlen], 0.0)
                for k in range(k_size))
        keep = (seg[:, seqlen:] == seg_x[:, -1:])[..., None]
        new_state = jnp.where(keep, xt[:, seqlen:], 0.0)
    return (c if bias is None else c + bias.astype(f32)), new_state


def causal_conv_step(x_t, conv_state, kernel, bias):
    """One decode step. x_t: [Bt, E]; conv_state: [Bt, K-1, E] -> (c_t [Bt, E] f32, new_state)."""
    f32 = accum_dtype(x_t.dtype, kernel.dtype)
    win = jnp.concatenate([conv_state.astype(f32), x_t.astype(f32)[:, None]], axis=1)  # [Bt, K, E]
    c = jnp.sum(win * kernel.astype(f32), axis=1)
    return (c if bias is None else c + bias.astype(f32)), win[:, 1:]


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
