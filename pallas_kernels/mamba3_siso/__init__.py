"""Pallas (Triton) kernels for the Mamba-3 SISO scan, forward and backward, behind one custom_vjp.

`chunked_scan` runs the scan on prepared operands (the op's glue, jmamba/ops/mamba3_siso_scan/pallas.py,
prepares them with the per-position math it shares with the XLA implementation);
`Mamba3ScanConfig` holds its static launch parameters. Module map: config (launch parameters, call
geometry, the kernel layout of d_state), layout (HBM layouts, grids, block specs, launch),
chunk_math (in-kernel math), queries_keys (the per-head rotated, biased, scaled queries / keys:
layout, pure-JAX reference, forward kernel), qk_gradients (their backward kernel), state_passes (the
forward state / backward adjoint passes over chunks), chunk_forward / chunk_backward (the per-chunk
output and gradient kernels), core (custom_vjp), scan (layout and chunk-entry angles around it). Shared helpers
(dtypes, sizes, padding, flat grids, the launch) are in pallas_kernels/common.

Importing this package loads only the config (no Pallas backend); `chunked_scan` is imported on
first access.
"""

from pallas_kernels.common.lazy import lazy_exports
from pallas_kernels.mamba3_siso.config import DEFAULT_CONFIG, Mamba3ScanConfig

__all__ = ["DEFAULT_CONFIG", "Mamba3ScanConfig", "chunked_scan"]

__getattr__, __dir__ = lazy_exports(__name__, {"chunked_scan": "scan"})
