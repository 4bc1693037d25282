"""Pallas (Triton) kernels for the Mamba-1 selective scan, forward and backward, behind one custom_vjp.

`selective_scan_pallas` has the jmamba op contract (see jmamba/ops/selective_scan/reference.py);
`ScanBlockConfig` is its static tiling. Module map: config (block sizes), layout (grid and block specs),
kernel_math (in-kernel softplus/sigmoid/decay), forward / backward / combine (kernels), scan (padding,
custom_vjp, partial-sum reductions).
"""

from pallas_kernels.selective_scan.config import DEFAULT_CONFIG, ScanBlockConfig
from pallas_kernels.selective_scan.scan import selective_scan_pallas

__all__ = ["DEFAULT_CONFIG", "ScanBlockConfig", "selective_scan_pallas"]
