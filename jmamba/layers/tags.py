"""`param`: an `nnx.Param` carrying its no-weight-decay modes as metadata (see `jmamba.core.tags`)."""

from __future__ import annotations

from flax import nnx

from jmamba.core.tags import DECAY_MODES, NO_DECAY


def param(value, *, no_decay: tuple = ()) -> nnx.Param:
    """An `nnx.Param(value)`, tagged `no_decay=(mode, ...)` when it is left undecayed in those modes."""
    bad = [m for m in no_decay if m not in DECAY_MODES[:2]]
    if bad:
        raise ValueError(f"no_decay modes must be among {DECAY_MODES[:2]}, got {bad}")
    return nnx.Param(value, **{NO_DECAY: tuple(no_decay)}) if no_decay else nnx.Param(value)
