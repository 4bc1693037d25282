"""The AdamW update op (torch numerics): reference / xla (plain JAX) and the fused Pallas kernel."""

from jmamba.ops.adamw.api import AdamWKernelConfig, AdamWTuning, adamw_update, adamw_update_flat
from jmamba.ops.adamw.numerics import bias_correction, step_scalars

__all__ = ["AdamWKernelConfig", "AdamWTuning", "adamw_update", "adamw_update_flat", "bias_correction", "step_scalars"]
