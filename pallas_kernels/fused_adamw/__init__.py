"""Fused AdamW as a Pallas-Triton kernel: p, m and v of many tensors updated in one launch, in place.

Module map: config (`AdamWStepScalars`, the per-step float32 scalars; `KernelConfig`, the launch
shape; `COMPUTE_DTYPES`), kernel (`fused_adamw_leaves`; `fused_adamw_flat` for leaves that live in
flat buffers; the Pallas kernel; its docstring has the update's numerics, layout and HBM traffic).

Importing this package loads only the config (no Pallas backend; `jmamba.optim` imports it at
`import jmamba`); the kernel module is imported on first access.
"""

from pallas_kernels.common.lazy import lazy_exports
from pallas_kernels.fused_adamw.config import COMPUTE_DTYPES, AdamWStepScalars, KernelConfig

__all__ = ["COMPUTE_DTYPES", "AdamWStepScalars", "KernelConfig", "fused_adamw_flat", "fused_adamw_leaves"]

__getattr__, __dir__ = lazy_exports(__name__, {"fused_adamw_flat": "kernel", "fused_adamw_leaves": "kernel"})
