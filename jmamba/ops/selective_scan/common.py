"""Pieces shared by every selective-scan implementation and the decode step (pure JAX, float32):
the state and tuning types, the thresholded softplus, δ preparation and the group expansion."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype

SOFTPLUS_THRESHOLD = 20.0
XLA_INNER = ("associative", "sequential")
MIXER_RESIDUALS = ("inputs", "activations")


class SelectiveScanState(NamedTuple):
    """The recurrent state of a selective scan.

    Attributes:
      ssm: [Bt, d, n] float32, the scan state h (h_{T-1} after a window).
    """

    ssm: jax.Array


@dataclasses.dataclass(frozen=True)
class SelectiveScanTuning:
    """Tuning of `selective_scan` (speed and rounding only; see `jmamba.ops.tuning`).

    Attributes:
      xla_chunk_size: steps per chunk of the "xla" implementation (None: its backend default).
      xla_inner: "associative" or "sequential" combination inside an "xla" chunk (None: backend default).
      pallas_config: a `pallas_kernels.selective_scan.ScanBlockConfig` for the "pallas" kernels
        (None: their default).
      mixer_residuals: what the "pallas" implementation of `mamba1_mixer_core` keeps for its backward
        (speed against memory; the values and cotangents are bit-identical either way):
        "activations" (default since 2026-12-06): the op's inputs and u and delta ([Bt, T, E] each, in
          the compute dtype) and the x projection (Δin | B | C, [Bt, T, R + 2N]). At the 130m-class
          benchmark shape (B=8, T=2048, E=1536, bf16) that is ~103 MB per layer more than "inputs":
          peak 11.6 → 13.4 GiB for the 24-layer train step (PyTorch's fused path: 17.8 GiB), and
          about −1.7 ms per step on an H100 (benchmarks/notes_training_step.md, session 27).
        "inputs": the op's inputs only; the backward recomputes the conv output u, delta and B, C
          (one conv kernel launch and the two projection matmuls per layer): about what PyTorch's
          fused `mamba_inner_fn` keeps. Use it when memory binds (long contexts).
        The "reference" and "xla" compositions are differentiated by autodiff and keep what it keeps.
      conv_config: a `pallas_kernels.causal_conv.ConvBlockConfig` for the conv kernels of the "pallas"
        `mamba1_mixer_core` (None: their default).
    """

    xla_chunk_size: Optional[int] = None
    xla_inner: Optional[str] = None
    pallas_config: Any = None
    mixer_residuals: str = "activations"
    conv_config: Any = None

    def __post_init__(self):
        c = self.xla_chunk_size
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c <= 0):
            raise ValueError(f"xla_chunk_size must be None or a positive int, got {c!r}")
        if self.xla_inner is not None and self.xla_inner not in XLA_INNER:
            raise ValueError(f"xla_inner must be None or one of {XLA_INNER}, got {self.xla_inner!r}")
        if self.mixer_residuals not in MIXER_RESIDUALS:
            raise ValueError(f"mixer_residuals must be one of {MIXER_RESIDUALS}, got {self.mixer_residuals!r}")
        if self.conv_config is not None:
            from pallas_kernels.causal_conv import ConvBlockConfig   # the config module only
            if not isinstance(self.conv_config, ConvBlockConfig):
                raise TypeError(f"conv_config must be None or a pallas_kernels.causal_conv.ConvBlockConfig, "
                                f"got {type(self.conv_config).__name__}")
            self.conv_config.validate()


def softplus_thresholded(x):
    """`x if x > 20 else log1p(exp(x))` (torch `F.softplus`, the official CUDA kernel and mamba-rs).

    Its derivative is σ(x) below the threshold and exactly 1 above it.
    """
    return jnp.where(x > SOFTPLUS_THRESHOLD, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_THRESHOLD))))


def prepare_delta(delta, delta_bias, delta_softplus, acc=None):
    """`softplus_thr(delta + delta_bias)` (or without softplus) in `acc` (default float32), [Bt, T, d]."""
    acc = acc or accum_dtype(delta.dtype)
    dl = delta.astype(acc)
    if delta_bias is not None:
        dl = dl + delta_bias.astype(acc)
    if delta_softplus:
        dl = softplus_thresholded(dl)
    return dl


def expand_groups(x, d):
    """[..., g, n] -> [..., d, n]: channel e reads group e // (d // g) (official grouping)."""
    g = x.shape[-2]
    return jnp.repeat(x, d // g, axis=-2)
