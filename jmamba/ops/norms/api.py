"""`add_rms_norm`: the pre-norm residual step, h = residual + x and y = RMSNorm(h)·weight.

    h = residual + x            in residual's dtype (the float32 stream; h = x without a residual)
    y = h·r·weight              r = 1/√(mean(h²) + eps) per row, statistics in float32, y in out_dtype

Each residual block of `jmamba.ResidualBackbone` ends with the first line and the next block (or the
final norm) starts with the second; one op does both, so the Pallas implementation reads the stream
once per layer each way (the XLA path reads it two to three times). Implementations: "reference" /
"xla" (plain JAX: `rms_norm`'s custom VJP after the add) and "pallas" (two kernels,
`pallas_kernels.rms_norm`). Under a mesh with `data` / `seq` axes the op runs per device on its batch
rows / time shard (every row is independent).

Implementation contract:

    fn(x, residual, weight, *, eps, out_dtype, tuning) -> (y, h)
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax.numpy as jnp

from jmamba.core.validation import check_float, shape_of
from jmamba.ops import dispatch
from jmamba.ops.row_sharding import call_rows_sharded
from jmamba.ops.settings import current_tuning, register_tuning
from pallas_kernels.rms_norm import NormBlockConfig

OP = "add_rms_norm"


@dataclasses.dataclass(frozen=True)
class RMSNormTuning:
    """Tuning of `add_rms_norm`: `pallas_config`, a `NormBlockConfig` (rows per program, column piece
    width, warps) or None (its default)."""

    pallas_config: Any = None

    def __post_init__(self):
        if self.pallas_config is not None:
            if not isinstance(self.pallas_config, NormBlockConfig):
                raise TypeError(f"pallas_config must be a NormBlockConfig or None, got "
                                f"{type(self.pallas_config).__name__}")
            self.pallas_config.validate()


def add_rms_norm(x, residual, weight, *, eps, out_dtype=None, implementation=None, tuning=None):
    """(y, h) with h = residual + x and y = RMSNorm(h)·weight (module docstring).

    Args:
      x: [..., D] float (a mixer's output, e.g. bfloat16).
      residual: [..., D] float like x's shape (the stream, float32), or None (then h = x).
      weight: [D] float, the norm's scale.
      eps: Python float added to the mean square.
      out_dtype: dtype of y (default: h's dtype).
      implementation: None (automatic: the kernels on a CUDA GPU), "reference", "xla" or "pallas".
      tuning: an `RMSNormTuning` (None: the current `jmamba.ops.tuning` settings of add_rms_norm).

    Returns:
      (y [..., D] out_dtype, h [..., D] residual's dtype, or x itself without a residual).
    """
    check_float("x", x)
    s = shape_of(x)
    if len(s) < 1 or s[-1] < 1:
        raise ValueError(f"x must have shape [..., D] with D >= 1, got {s}")
    if residual is not None:
        check_float("residual", residual)
        if shape_of(residual) != s:
            raise ValueError(f"residual must have x's shape {s}, got {shape_of(residual)}")
    check_float("weight", weight)
    if shape_of(weight) != (s[-1],):
        raise ValueError(f"weight must have shape [D] = ({s[-1]},), got {shape_of(weight)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps must be a Python float >= 0, got {eps!r}")
    h_dtype = x.dtype if residual is None else residual.dtype
    out_dtype = jnp.dtype(h_dtype if out_dtype is None else out_dtype)
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"out_dtype must be a float dtype, got {out_dtype}")
    tuning = current_tuning(OP, tuning)
    impl = dispatch.choose(OP, implementation, x=x, residual=residual, weight=weight)
    return call_rows_sharded(impl.fn, (x, residual, weight), (True, True, False), eps=float(eps),
                             out_dtype=out_dtype, tuning=tuning)


def _load_reference():
    from jmamba.ops.norms.reference import add_rms_norm_reference
    return dispatch.Implementation(add_rms_norm_reference, lambda **_: None)


def _load_pallas():
    from jmamba.ops.norms.pallas import implementation
    return implementation()


register_tuning(OP, RMSNormTuning())
dispatch.register(OP, "reference", _load_reference)
dispatch.register(OP, "xla", _load_reference)
dispatch.register(OP, "pallas", _load_pallas)
