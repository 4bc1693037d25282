"""Pallas (Triton) kernels for the pre-norm residual step: h = residual + x, y = RMSNorm(h)·weight.

`add_rms_norm_forward` writes the new residual stream h (float32), the normalized y and the per-row
1/rms in one pass over the rows; `add_rms_norm_backward` forms the stream's cotangent (the incoming
one plus the norm's), that cotangent in x's dtype, and per-block partial sums of the weight gradient
in one pass. `jmamba.ops.add_rms_norm`'s Pallas implementation calls both inside its custom_vjp.
Module map: config (row / column blocks, warps), kernels (the two kernel bodies), norm (padding,
block specs, launches, the partial-sum reduction).

Importing this package loads only the config; the entry points import Pallas on first access.
"""

from pallas_kernels.common.lazy import lazy_exports
from pallas_kernels.rms_norm.config import DEFAULT_NORM_CONFIG, NormBlockConfig

__all__ = ["DEFAULT_NORM_CONFIG", "NormBlockConfig", "add_rms_norm_backward", "add_rms_norm_forward"]

__getattr__, __dir__ = lazy_exports(__name__, {"add_rms_norm_forward": "norm", "add_rms_norm_backward": "norm"})
