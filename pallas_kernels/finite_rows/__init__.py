"""A Pallas (Triton) kernel for the rows of many arrays that hold only finite numbers, in one launch:
`finite_rows_leaves` (the non-finite guard's check of the carried recurrent state, whose per-array XLA
row reductions were ~100 small launches per training step).

`jmamba.ops.finite_rows`' Pallas implementation calls it (opt-in: it was no faster than the per-array
checks in the train steps measured, BENCHMARKS.md session 36). Module map: config (elements per program,
warps, arrays per launch), kernel (the body and the launch).

Importing this package loads only the config; the entry point imports Pallas on first access.
"""

from pallas_kernels.common.lazy import lazy_exports
from pallas_kernels.finite_rows.config import DEFAULT_FINITE_ROWS_CONFIG, FiniteRowsConfig

__all__ = ["DEFAULT_FINITE_ROWS_CONFIG", "FiniteRowsConfig", "finite_rows_leaves"]

__getattr__, __dir__ = lazy_exports(__name__, {"finite_rows_leaves": "kernel"})
