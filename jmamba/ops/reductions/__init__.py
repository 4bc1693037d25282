"""Row reductions over wide rows: `log_sum_exp` (the cross entropy's normalizer), reference / xla and
the one-pass Pallas kernel."""

from jmamba.ops.reductions.api import LogSumExpTuning, log_sum_exp

__all__ = ["LogSumExpTuning", "log_sum_exp"]
