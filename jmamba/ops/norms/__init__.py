"""The pre-norm residual step (add + RMSNorm): reference / xla (plain JAX) and the Pallas kernels."""

from jmamba.ops.norms.api import RMSNormTuning, add_rms_norm
from jmamba.ops.norms.reference import rms_norm

__all__ = ["RMSNormTuning", "add_rms_norm", "rms_norm"]
