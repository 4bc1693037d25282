"""Pallas (Triton) kernels for the Mamba-1 selective scan, forward and backward, behind one custom_vjp.

`selective_scan_pallas` has the jmamba op contract (see jmamba/ops/selective_scan/reference.py);
`ScanBlockConfig` is its static tiling; `selective_scan_forward` / `selective_scan_backward` are its
two halves (forward with residuals, cotangents from them) for ops that wrap the scan in their own
custom_vjp. Module map: config (block sizes), layout (program grid, block
specs, launch parameters), channels (per-channel loads/stores), kernel_math (in-kernel
softplus/sigmoid/decay), forward / backward / combine (kernels), scan (padding, custom_vjp,
partial-sum reductions). Shared helpers (dtypes, sizes, padding, flat grids, the launch) are in
pallas_kernels/common.

Importing this package loads only the config (no Pallas backend); `selective_scan_pallas` is
imported on first access.
"""

from pallas_kernels.common.lazy import lazy_exports
from pallas_kernels.selective_scan.config import DEFAULT_CONFIG, ScanBlockConfig

__all__ = ["DEFAULT_CONFIG", "ScanBlockConfig", "selective_scan_backward", "selective_scan_forward",
           "selective_scan_pallas"]

__getattr__, __dir__ = lazy_exports(__name__, {"selective_scan_pallas": "scan", "selective_scan_forward": "scan",
                                               "selective_scan_backward": "scan"})
