"""Reductions: `log_sum_exp` over wide rows (the cross entropy's normalizer), `sum_of_squares` over a
list of arrays (the global gradient norm's square) and `finite_rows` over a list of arrays (the guard's
check of the carried state), each with reference / xla and a Pallas kernel."""

from jmamba.ops.reductions.api import LogSumExpTuning, log_sum_exp
from jmamba.ops.reductions.finite import FiniteRowsTuning, finite_rows
from jmamba.ops.reductions.squares import SumOfSquaresTuning, sum_of_squares

__all__ = ["FiniteRowsTuning", "LogSumExpTuning", "SumOfSquaresTuning", "finite_rows", "log_sum_exp", "sum_of_squares"]
