"""Pallas (Triton) kernels for the Mamba-3 SISO scan, forward and backward, behind one custom_vjp.

`mamba3_siso_scan_pallas` has the jmamba op contract (jmamba/ops/mamba3_siso_scan/api.py);
`Mamba3ScanConfig` holds its static launch parameters. Module map: config (launch parameters, call
geometry, the kernel layout of d_state), layout (HBM layouts, grids, block specs), chunk_math (in-kernel
math), queries_keys (the per-head rotated, biased, scaled queries / keys: layout, pure-JAX reference,
forward kernel), qk_gradients (their backward kernel), state_passes (the forward state / backward
adjoint passes over chunks), chunk_forward / chunk_backward (the per-chunk output and gradient
kernels), core (custom_vjp), scan (the plain-JAX glue around it).
"""

from pallas_kernels.mamba3_siso.config import DEFAULT_CONFIG, Mamba3ScanConfig
from pallas_kernels.mamba3_siso.scan import mamba3_siso_scan_pallas

__all__ = ["DEFAULT_CONFIG", "Mamba3ScanConfig", "mamba3_siso_scan_pallas"]
