"""`log_sum_exp(x)`: log Σ_v exp(x[..., v]) over the last axis, float32.

The cross entropy's normalizer over the vocabulary (`jmamba.training.losses`): its [B, T, V] bf16
logits are the largest array of a training step (1.65 GB at B=8, T=2048, V=50280), so the fast
implementations read them once. Implementations:
  "reference": the textbook two passes (the row max, then log Σ exp(x − max));
  "xla": one variadic XLA reduction carrying the running max and the rescaled sum (the automatic
    choice, `AUTOMATIC`);
  "pallas": one kernel walking each row in pieces (`pallas_kernels.log_sum_exp`), opt-in with
    `dispatch.prefer("log_sum_exp", "pallas")` until it has run on a GPU.
Values agree to float32 rounding (the order of the sums differs). Rows of −inf give −inf ("xla",
"pallas"; NaN for "reference"); a NaN or +inf in a row gives a non-finite value. Not differentiable:
it has no VJP (the cross entropy's custom VJP needs only the value). Under a mesh it runs per device
on its `data` rows / `seq` shard.

Implementation contract:

    fn(x, *, tuning) -> [...] float32
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jmamba.core.validation import check_float, shape_of
from jmamba.ops import dispatch
from jmamba.ops.row_sharding import call_rows_sharded
from jmamba.ops.settings import current_tuning, register_tuning
from pallas_kernels.log_sum_exp import LogSumExpConfig

OP = "log_sum_exp"
# What implementation=None runs when no `dispatch.prefer` block names one. The Pallas kernel passes its GPU
# test, but the train step is slower with it (H100, session 30, `gpu_session.sh lse_ab`: Mamba-1 84.2 ->
# 85.9 ms, Mamba-3 82.1 -> 84.5 ms, +1.5 GiB peak), so the automatic choice is the XLA reduction; None
# would let dispatch pick ("pallas" on a CUDA GPU).
AUTOMATIC = "xla"


@dataclasses.dataclass(frozen=True)
class LogSumExpTuning:
    """Tuning of `log_sum_exp`: `pallas_config`, a `LogSumExpConfig` (rows per program, piece width,
    warps, stages) or None (its default)."""

    pallas_config: Any = None

    def __post_init__(self):
        if self.pallas_config is not None:
            if not isinstance(self.pallas_config, LogSumExpConfig):
                raise TypeError(f"pallas_config must be a LogSumExpConfig or None, got "
                                f"{type(self.pallas_config).__name__}")
            self.pallas_config.validate()


def log_sum_exp(x, *, implementation=None, tuning=None):
    """log Σ exp over the last axis of x [..., V] (any float dtype) -> [...] float32 (module docstring).

    Args:
      x: [..., V] float array, V >= 1.
      implementation: None (a `dispatch.prefer` choice, else `AUTOMATIC`), "reference", "xla" or "pallas".
      tuning: a `LogSumExpTuning` (None: the current `jmamba.ops.tuning` settings of log_sum_exp).
    """
    check_float("x", x)
    s = shape_of(x)
    if len(s) < 1 or s[-1] < 1:
        raise ValueError(f"x must have shape [..., V] with V >= 1, got {s}")
    tuning = current_tuning(OP, tuning)
    if implementation is None and dispatch.preferred(OP) is None:
        implementation = AUTOMATIC
    impl = dispatch.choose(OP, implementation, x=x)
    return call_rows_sharded(impl.fn, (x,), (True,), tuning=tuning)


def _load_reference():
    from jmamba.ops.reductions.reference import log_sum_exp_two_pass
    return dispatch.Implementation(log_sum_exp_two_pass, lambda **_: None)


def _load_xla():
    from jmamba.ops.reductions.xla import log_sum_exp_one_pass
    return dispatch.Implementation(log_sum_exp_one_pass, lambda **_: None)


def _load_pallas():
    from jmamba.ops.reductions.pallas import implementation
    return implementation()


register_tuning(OP, LogSumExpTuning())
dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_xla)
dispatch.register(OP, "pallas", _load_pallas)
