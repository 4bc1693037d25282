"""Reductions: `log_sum_exp` over wide rows (the cross entropy's normalizer) and `sum_of_squares` over a
list of arrays (the global gradient norm's square), each with reference / xla and a Pallas kernel."""

from jmamba.ops.reductions.api import LogSumExpTuning, log_sum_exp
from jmamba.ops.reductions.squares import SumOfSquaresTuning, sum_of_squares

__all__ = ["LogSumExpTuning", "SumOfSquaresTuning", "log_sum_exp", "sum_of_squares"]
