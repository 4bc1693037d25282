"""Optimizers: `fused_adamw` (torch AdamW numerics, optax transformation + fused apply through the
`jmamba.ops.adamw_update` op), the fused-apply protocol, and `no_decay_mask` (the Mamba
weight-decay groups read from parameter metadata, True = decay)."""

from jmamba.ops import AdamWKernelConfig as KernelConfig
from jmamba.optim.fused_adamw import FusedAdamW, FusedAdamWState, fused_adamw
from jmamba.optim.fused_apply import FUSED_APPLY, find_fused_apply
from jmamba.optim.no_decay_mask import DECAY, NO_DECAY, no_decay_mask, no_decay_paths

__all__ = ["DECAY", "FUSED_APPLY", "FusedAdamW", "FusedAdamWState", "KernelConfig", "NO_DECAY",
           "find_fused_apply", "fused_adamw", "no_decay_mask", "no_decay_paths"]
