"""A Pallas (Triton) kernel for Σ_k Σ_i x_k[i]² over many arrays in one launch: `sum_of_squares_leaves`
(the global gradient norm of a training step, whose per-leaf XLA reductions were ~250 small launches).

`jmamba.ops.sum_of_squares`' Pallas implementation calls it. Module map: config (elements per program,
warps, arrays per launch), kernel (the body and the launch).

Importing this package loads only the config; the entry point imports Pallas on first access.
"""

from pallas_kernels.common.lazy import lazy_exports
from pallas_kernels.sum_of_squares.config import DEFAULT_SUM_OF_SQUARES_CONFIG, SumOfSquaresConfig

__all__ = ["DEFAULT_SUM_OF_SQUARES_CONFIG", "SumOfSquaresConfig", "sum_of_squares_leaves"]

__getattr__, __dir__ = lazy_exports(__name__, {"sum_of_squares_leaves": "kernel"})
