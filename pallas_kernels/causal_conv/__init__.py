"""Pallas (Triton) kernels for Mamba-1's causal depthwise conv1d + bias + SiLU, forward and backward.

`conv_silu_forward` (u = silu(conv(x̃) + bias)) and `conv_silu_backward` (dx, dstate, dkernel, dbias
from du, with the conv output recomputed) are the two halves that `jmamba.ops.mamba1_mixer_core`'s
Pallas implementation calls inside its own custom_vjp. Both can read x as the first half of
in_proj's packed [Bt, T, 2E] output, and the backward writes its dx into a packed [Bt, T, 2E]
cotangent with the gate's cotangent beside it, so neither direction copies x or z apart.
Module map: config (block sizes), kernels (the two kernel bodies), conv (padding, halo block specs,
launches, partial-sum reductions).

Importing this package loads only the config; the entry points import Pallas on first access.
"""

from pallas_kernels.causal_conv.config import DEFAULT_CONV_CONFIG, ConvBlockConfig
from pallas_kernels.common.lazy import lazy_exports

__all__ = ["ConvBlockConfig", "DEFAULT_CONV_CONFIG", "conv_silu_backward", "conv_silu_forward"]

__getattr__, __dir__ = lazy_exports(__name__, {"conv_silu_forward": "conv", "conv_silu_backward": "conv"})
