"""Optimizers: `fused_adamw` (torch AdamW numerics, optax transformation + in-place fused apply)
and `no_decay_mask` (the Mamba weight-decay groups, True = decay)."""

from jmamba.optim.fused_adamw import FusedAdamW, FusedAdamWState, fused_adamw
from jmamba.optim.no_decay_mask import DECAY, NO_DECAY, no_decay_mask, no_decay_paths
from pallas_kernels.fused_adamw import KernelConfig

__all__ = ["DECAY", "FusedAdamW", "FusedAdamWState", "KernelConfig", "NO_DECAY", "fused_adamw",
           "no_decay_mask", "no_decay_paths"]
