"""A Pallas (Triton) kernel for log Σ exp over the last axis of wide rows (the cross entropy's
normalizer over the vocabulary), in one pass: `row_log_sum_exp`.

`jmamba.ops.log_sum_exp`'s Pallas implementation calls it. Module map: config (rows per program,
vocabulary piece width, warps, pipelining stages), kernel (the body and the launch).

Importing this package loads only the config; the entry point imports Pallas on first access.
"""

from pallas_kernels.common.lazy import lazy_exports
from pallas_kernels.log_sum_exp.config import DEFAULT_LSE_CONFIG, LogSumExpConfig

__all__ = ["DEFAULT_LSE_CONFIG", "LogSumExpConfig", "row_log_sum_exp"]

__getattr__, __dir__ = lazy_exports(__name__, {"row_log_sum_exp": "kernel"})
