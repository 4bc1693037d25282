"""`load_weights`: put saved weights into a model in one call, strictly by default.

    report = jmamba.load_weights(model, "runs/x/model.safetensors")       # or a dict of arrays

The source is a jmamba safetensors file (`save_safetensors`), or a dict of arrays: flat with dotted
keys (`layers.0.mixer.A_log`) or nested like `nnx.to_pure_dict(nnx.state(model, nnx.Param))`.
Before anything is written, every tensor is compared with the model's parameters:

* strict (default): missing parameters, unexpected tensors, and tensors of the wrong shape or dtype
  all raise one `ValueError` listing every problem; the model is left untouched.
* `strict=False`: a documented partial load. Missing parameters keep their current values and
  unexpected tensors are ignored (both listed in the report); a wrong shape or dtype still raises,
  since such a tensor cannot stand in for the parameter.

Non-finite values in a tensor raise as well (a NaN weight would poison every later step).
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmamba.io.safetensors_io import flatten_params, load_safetensors


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What `load_weights` did: the keys loaded, and (strict=False only) the keys it passed over."""

    loaded: tuple
    missing: tuple
    unexpected: tuple

    def __str__(self):
        return (f"loaded {len(self.loaded)} tensors" + (f"; kept {len(self.missing)} missing parameters at their "
                f"current values: {list(self.missing)[:5]}" if self.missing else "")
                + (f"; ignored {len(self.unexpected)} unexpected tensors: {list(self.unexpected)[:5]}"
                   if self.unexpected else ""))


def _source_tensors(source) -> dict[str, np.ndarray]:
    if isinstance(source, (str, os.PathLike)):
        params, _cfg = load_safetensors(source)
        return flatten_params(params)
    if isinstance(source, nnx.State):
        return flatten_params(source)
    if isinstance(source, dict):
        if all(isinstance(k, str) and not isinstance(v, dict) for k, v in source.items()):
            return {k: np.asarray(v) for k, v in source.items()}
        return flatten_params(source)
    raise TypeError(f"source must be a path to a jmamba safetensors file, a dict of arrays or an nnx.State, "
                    f"got {type(source).__name__}")


def load_weights(model: nnx.Module, source, *, strict: bool = True) -> LoadReport:
    """Loads `source` into `model`'s parameters (in place) after checking all of them.

    Raises:
      ValueError listing missing / unexpected / wrong-shape / wrong-dtype / non-finite tensors
      (missing and unexpected only when strict); nothing is changed then.
      TypeError for a source of the wrong kind.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
    tensors = _source_tensors(source)
    state = nnx.state(model, nnx.Param)
    want = flatten_params(state)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    problems = []
    if strict and missing:
        problems.append(f"missing {len(missing)}: {missing[:8]}")
    if strict and unexpected:
        problems.append(f"unexpected {len(unexpected)}: {unexpected[:8]}")
    for k in sorted(set(want) & set(tensors)):
        got, ref = tensors[k], want[k]
        if got.shape != ref.shape:
            problems.append(f"{k}: shape {got.shape}, the model has {ref.shape}")
        elif got.dtype != ref.dtype:
            problems.append(f"{k}: dtype {got.dtype}, the model has {ref.dtype}")
        elif np.issubdtype(got.dtype, np.floating) and not np.all(np.isfinite(got)):
            problems.append(f"{k}: holds non-finite values")
    if problems:
        raise ValueError("weights do not fit the model (nothing was loaded): " + "; ".join(problems))
    loaded = sorted(set(want) & set(tensors))
    pure = nnx.to_pure_dict(state)
    _assign(pure, {k: tensors[k] for k in loaded})
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return LoadReport(tuple(loaded), tuple(missing), tuple(unexpected))


def _assign(tree, flat):
    """Writes flat dotted-key arrays into the nested pure dict `tree` (int keys for list indices)."""
    for key, value in flat.items():
        node = tree
        parts = [int(p) if p.isdigit() else p for p in key.split(".")]
        for p in parts[:-1]:
            node = node[p]
        node[parts[-1]] = jnp.asarray(value)
