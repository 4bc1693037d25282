"""`Precision`: the one name for the compute precision, used by models, ops callers and training.

Master parameters, optimizer state, the residual stream, norm statistics and every scan state stay
float32 whatever the precision; the precision is the dtype of the mixers' matmuls and activations
(docs/numerics.md). "f16" additionally needs dynamic loss scaling in training. "f64" exists only for
finite-difference checks under `jax.enable_x64` (everything then runs in float64).
"""

from __future__ import annotations

import enum

import jax.numpy as jnp


class Precision(str, enum.Enum):
    """Compute precision. A `str` enum: `Precision.BF16 == "bf16"`, hashable and static under jit."""

    F32 = "f32"
    BF16 = "bf16"
    F16 = "f16"
    F64 = "f64"

    @property
    def compute_dtype(self):
        return jnp.dtype(_DTYPES[self])

    @property
    def needs_loss_scale(self) -> bool:
        return self is Precision.F16

    def __str__(self) -> str:
        return self.value


_DTYPES = {Precision.F32: jnp.float32, Precision.BF16: jnp.bfloat16, Precision.F16: jnp.float16,
           Precision.F64: jnp.float64}
_ALIASES = {"f32": Precision.F32, "float32": Precision.F32, "bf16": Precision.BF16,
            "bfloat16": Precision.BF16, "f16": Precision.F16, "float16": Precision.F16,
            "f64": Precision.F64, "float64": Precision.F64}
TRAINING_PRECISIONS = (Precision.F32, Precision.BF16, Precision.F16)


def as_precision(value, name: str = "precision") -> Precision:
    """A `Precision` from a Precision, its name ("bf16", "bfloat16", ...), a dtype, or None (= f32).

    Raises:
      ValueError naming `name` for anything else.
    """
    if value is None:
        return Precision.F32
    if isinstance(value, Precision):
        return value
    if isinstance(value, str):
        if value in _ALIASES:
            return _ALIASES[value]
    else:
        try:
            key = jnp.dtype(value).name
        except TypeError:
            key = None
        if key in _ALIASES:
            return _ALIASES[key]
    raise ValueError(f"{name} must be one of 'f32', 'bf16', 'f16' (or a jmamba.Precision / float dtype), "
                     f"got {value!r}")


def as_training_precision(value, name: str = "precision") -> Precision:
    """Like `as_precision`, but only the precisions a train step supports (not f64)."""
    p = as_precision(value, name)
    if p not in TRAINING_PRECISIONS:
        raise ValueError(f"{name} must be one of 'f32', 'bf16', 'f16' for training, got {value!r}")
    return p
