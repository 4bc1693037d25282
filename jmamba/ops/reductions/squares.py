"""`sum_of_squares(leaves)`: Σ_k Σ_i x_k[i]² over a list of arrays, float32 — the global gradient norm's
square (`jmamba.training.clipping.global_norm`, which clipping and the non-finite guard read).

Why an op: a 130M-parameter LM has ~150–250 gradient arrays, and reducing each with XLA costs one or two
small launches per array (a few µs each, ~250 per training step in the profiles of
docs/performance.md). Implementations:
  "reference" / "xla": each array's Σ x² (an XLA reduction), the per-array sums added in list order
    (the same function under both names);
  "pallas": the arrays' pieces in one launch per `max_leaves_per_call` arrays
    (`pallas_kernels.sum_of_squares`), the per-program partials summed by one reduction.
The automatic choice (`implementation=None`, no `dispatch.prefer` block; `automatic_implementation`) is
"pallas" on a CUDA GPU without a mesh axis of size > 1 (where the kernel declines: its arrays may be
sharded), "xla" otherwise. Measured on an H100 (BENCHMARKS.md, session 34): the kernel takes 0.3–0.7 ms
off the synchronised train step of both 130M-class models (~250 launches fewer per step).
Values agree to float32 rounding (the summation order differs); each implementation is deterministic.
A NaN anywhere gives NaN, an inf gives inf (the guard reads a non-finite norm as a bad step). Not
differentiable (clipping uses the value only).

Implementation contract:

    fn(leaves: list of arrays, *, tuning) -> float32 scalar
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jmamba.ops import dispatch
from jmamba.ops.pallas_platform import GPU_PLATFORMS, interpret_mode, whole_array_kernel_reason
from jmamba.ops.settings import current_tuning, register_tuning
from pallas_kernels.sum_of_squares import SumOfSquaresConfig

OP = "sum_of_squares"
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class SumOfSquaresTuning:
    """Tuning of `sum_of_squares`: `pallas_config`, a `SumOfSquaresConfig` (elements per program, warps,
    arrays per launch) or None (its default)."""

    pallas_config: Any = None

    def __post_init__(self):
        if self.pallas_config is not None:
            if not isinstance(self.pallas_config, SumOfSquaresConfig):
                raise TypeError(f"pallas_config must be a SumOfSquaresConfig or None, got "
                                f"{type(self.pallas_config).__name__}")
            self.pallas_config.validate()


def sum_of_squares(leaves, *, implementation=None, tuning=None):
    """Σ over every element of every array of x², as a float32 scalar (module docstring).

    Args:
      leaves: a list (or tuple) of float arrays: float16, bfloat16 or float32, any shapes; empty arrays
        and an empty list give 0.
      implementation: None (a `dispatch.prefer` choice, else `automatic_implementation`), "reference",
        "xla" or "pallas".
      tuning: a `SumOfSquaresTuning` (None: the current `jmamba.ops.tuning` settings of sum_of_squares).
    """
    if not isinstance(leaves, (list, tuple)):
        raise TypeError(f"leaves must be a list or tuple of arrays (e.g. jax.tree.leaves(grads)), got "
                        f"{type(leaves).__name__}")
    for k, x in enumerate(leaves):
        dt = jnp.result_type(x)
        if not jnp.issubdtype(dt, jnp.floating) or jnp.dtype(dt).itemsize > 4:
            raise TypeError(f"leaves[{k}] must be a float16, bfloat16 or float32 array, got dtype {dt}")
    tuning = current_tuning(OP, tuning)
    if implementation is None and dispatch.preferred(OP) is None:
        implementation = automatic_implementation(leaves)
    impl = dispatch.choose(OP, implementation, leaves=leaves)
    return impl.fn([jnp.asarray(x) for x in leaves], tuning=tuning)


def automatic_implementation(leaves, platform=None) -> str:
    """What `sum_of_squares(leaves)` runs with no implementation named: "pallas" where the kernel runs
    compiled and unsharded (a CUDA GPU, no mesh axis of size > 1), else "xla"."""
    platform = platform or dispatch.default_platform()
    if platform in GPU_PLATFORMS and _pallas_supported(platform=platform, leaves=leaves) is None:
        return "pallas"
    return "xla"


def per_array_sums(leaves, *, tuning=None):
    """The "reference" and "xla" implementations: Σ x² of each array in float32 (one XLA reduction
    each), added in list order."""
    total = jnp.zeros((), F32)
    for x in leaves:
        total = total + jnp.sum(jnp.square(x.astype(F32)))
    return total


def _pallas_supported(*, platform, leaves, **_):
    return whole_array_kernel_reason(platform, "the Pallas sum-of-squares kernel", "the arrays")


def sum_of_squares_pallas(leaves, *, tuning=None):
    from pallas_kernels.sum_of_squares import sum_of_squares_leaves

    return sum_of_squares_leaves(leaves, config=tuning and tuning.pallas_config, interpret=interpret_mode())


def _load_per_array():
    return dispatch.Implementation(per_array_sums, lambda **_: None)


def _load_pallas():
    return dispatch.Implementation(sum_of_squares_pallas, _pallas_supported)


register_tuning(OP, SumOfSquaresTuning())
dispatch.register(OP, "reference", _load_per_array)
dispatch.register(OP, "xla", _load_per_array)
dispatch.register(OP, "pallas", _load_pallas)
