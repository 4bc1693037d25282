"""`finite_rows(leaves, batch_size)`: [B] bool, True where row b of every array is finite — the non-finite
guard's check of the recurrent state carried between windows (`jmamba.training.guard`).

Why an op: a 24-layer model carries ~50–100 state arrays, and checking each with XLA costs one row
reduction launch per array (~100 small launches per training step in the profiles of
docs/performance.md). Implementations:
  "reference" / "xla": per array, `all(isfinite)` over each row (an XLA reduction), AND-ed in list order
    (the same function under both names);
  "pallas": every array's rows in one launch per `max_leaves_per_call` arrays
    (`pallas_kernels.finite_rows`: per-piece partials Σ x·0, 0 or NaN), summed per row by one reduction.
The automatic choice (`implementation=None`, no `dispatch.prefer` block; `automatic_implementation`) is
"xla" everywhere: on an H100 (session 36, BENCHMARKS.md) the kernel left both 130M-class train steps
unchanged (Mamba-3 76.4 vs 76.6 ms, Mamba-1 81.4 vs 81.3 ms with the XLA checks), so it is opt-in
(`dispatch.prefer("finite_rows", "pallas")`); it declines under a mesh axis of size > 1 (the rows may be
sharded). Every implementation gives the same answer exactly (no rounding is involved). Not
differentiable (the guard uses the flags only).

Implementation contract:

    fn(leaves: list of arrays [B, ...], batch_size, *, tuning) -> [B] bool
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jmamba.ops import dispatch
from jmamba.ops.pallas_platform import interpret_mode, whole_array_kernel_reason
from jmamba.ops.settings import current_tuning, register_tuning
from pallas_kernels.finite_rows import FiniteRowsConfig

OP = "finite_rows"


@dataclasses.dataclass(frozen=True)
class FiniteRowsTuning:
    """Tuning of `finite_rows`: `pallas_config`, a `FiniteRowsConfig` (elements per program, warps, arrays
    per launch) or None (its default)."""

    pallas_config: Any = None

    def __post_init__(self):
        if self.pallas_config is not None:
            if not isinstance(self.pallas_config, FiniteRowsConfig):
                raise TypeError(f"pallas_config must be a FiniteRowsConfig or None, got "
                                f"{type(self.pallas_config).__name__}")
            self.pallas_config.validate()


def finite_rows(leaves, batch_size, *, implementation=None, tuning=None):
    """[B] bool: True where row b of every array holds only finite numbers (module docstring).

    Args:
      leaves: a list (or tuple) of float arrays (float16, bfloat16 or float32), each with leading axis
        `batch_size`; empty arrays and an empty list leave every row True.
      batch_size: B, a positive int.
      implementation: None (a `dispatch.prefer` choice, else `automatic_implementation`), "reference",
        "xla" or "pallas".
      tuning: a `FiniteRowsTuning` (None: the current `jmamba.ops.tuning` settings of finite_rows).
    """
    if not isinstance(leaves, (list, tuple)):
        raise TypeError(f"leaves must be a list or tuple of arrays (e.g. jax.tree.leaves(state)), got "
                        f"{type(leaves).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for k, x in enumerate(leaves):
        dt = jnp.result_type(x)
        if not jnp.issubdtype(dt, jnp.floating) or jnp.dtype(dt).itemsize > 4:
            raise TypeError(f"leaves[{k}] must be a float16, bfloat16 or float32 array, got dtype {dt}")
        shape = jnp.shape(x)
        if len(shape) < 1 or shape[0] != batch_size:
            raise ValueError(f"leaves[{k}] must have leading axis batch_size = {batch_size}, got shape {shape}")
    tuning = current_tuning(OP, tuning)
    if implementation is None and dispatch.preferred(OP) is None:
        implementation = automatic_implementation(leaves)
    impl = dispatch.choose(OP, implementation, leaves=leaves)
    return impl.fn([jnp.asarray(x) for x in leaves], batch_size, tuning=tuning)


def automatic_implementation(leaves, platform=None) -> str:
    """What `finite_rows(leaves, ...)` runs with no implementation named: "xla" on every platform (module
    docstring: the kernel was no faster in the train step)."""
    return "xla"


def per_array_rows(leaves, batch_size, *, tuning=None):
    """The "reference" and "xla" implementations: each array's rows checked by one XLA reduction, the
    [B] flags AND-ed in list order."""
    ok = jnp.ones((batch_size,), bool)
    for x in leaves:
        ok = ok & jnp.all(jnp.isfinite(x.reshape(batch_size, -1)), axis=1)
    return ok


def _pallas_supported(*, platform, leaves, **_):
    return whole_array_kernel_reason(platform, "the Pallas finite-rows kernel", "the rows")


def finite_rows_pallas(leaves, batch_size, *, tuning=None):
    from pallas_kernels.finite_rows import finite_rows_leaves

    return finite_rows_leaves(leaves, batch_size, config=tuning and tuning.pallas_config, interpret=interpret_mode())


def _load_per_array():
    return dispatch.Implementation(per_array_rows, lambda **_: None)


def _load_pallas():
    return dispatch.Implementation(finite_rows_pallas, _pallas_supported)


register_tuning(OP, FiniteRowsTuning())
dispatch.register(OP, "reference", _load_per_array)
dispatch.register(OP, "xla", _load_per_array)
dispatch.register(OP, "pallas", _load_pallas)
