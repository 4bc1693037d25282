"""`no_decay_mask`: the optax weight-decay mask that leaves out the Mamba no-decay groups.

POLARITY: the returned pytree holds True = DECAY this leaf, False = NO decay, the convention of
`optax.adamw(mask=...)` and `jmamba.fused_adamw(mask=...)`. The function is named after the groups
it removes; `no_decay_paths` lists those groups by path, and `DECAY` / `NO_DECAY` name the two values.

The groups are not tables here: every parameter that is left undecayed carries the modes it is
undecayed in as NNX metadata (`no_decay=("reference", "official")`, see `jmamba.core.tags`), set
where the model creates it. So the mask needs no architecture name and no path patterns, and works
for any module built from jmamba layers. The groups (docs/mamba1.md §2.3, docs/mamba3_siso.md §2.4):

  mode "reference" (the mamba-rs `reference_no_decay` groups)
    mamba1: every norm scale, mixer.dt_proj.bias, mixer.A_log, mixer.D
    mamba3: every norm scale, mixer.{dt_bias, D}, and every bias (input_proj.bias,
            mixer.{B_bias, C_bias})
  mode "official" (the official `_no_weight_decay` markers)
    mamba1: A_log, D;   mamba3: dt_bias, D
  mode "none": every leaf is decayed.

Everything else is decayed: the projections, conv1d (kernel and bias), input_proj.kernel (and, for
Mamba-1, input_proj.bias), and in a `MambaLM` the `embedding` and `lm_head`.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from flax import nnx

from jmamba.core.tags import DECAY_MODES, NO_DECAY as NO_DECAY_KEY

DECAY = True
NO_DECAY = False
MODES = DECAY_MODES
_OLD_ARCHS = ("mamba1", "mamba3")


def dotted_path(path) -> str:
    """`layers.0.mixer.A_log` from a jax key path (dicts, lists, attributes, nnx Variables)."""
    parts = []
    for i, k in enumerate(path):
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name == "value" and i == len(path) - 1:   # the array inside an nnx.Variable
                continue
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts)


def _params_of(model_or_params):
    if isinstance(model_or_params, nnx.Module):
        return nnx.state(model_or_params, nnx.Param)
    return model_or_params


def _mode_from_args(args, mode):
    """`no_decay_mask(params, mode)`, or the old `no_decay_mask(params, arch, mode)` (arch ignored)."""
    if not args:
        return mode
    if len(args) > 2:
        raise TypeError("no_decay_mask takes (model_or_params, mode='reference')")
    if args[0] in _OLD_ARCHS:
        warnings.warn("no_decay_mask(params, arch, mode): the arch argument is deprecated and ignored (the "
                      "groups are read from the parameters' metadata); call no_decay_mask(params, mode)",
                      DeprecationWarning, stacklevel=3)
        return args[1] if len(args) == 2 else mode
    if len(args) == 1:
        return args[0]
    raise TypeError("no_decay_mask takes (model_or_params, mode='reference')")


def _classify(model_or_params, mode):
    """(structure of the params, [(dotted path, decayed?)] per leaf)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    params = _params_of(model_or_params)
    variables = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if not variables:
        raise ValueError("params has no leaves")
    bare = [dotted_path(p) for p, v in variables if not isinstance(v, nnx.Variable)]
    if bare:
        raise TypeError("no_decay_mask needs the model or its nnx.State of parameters "
                        "(nnx.state(model, nnx.Param), or TrainState.nnx_params()), whose parameters carry "
                        f"the no-decay tags; got plain arrays at {bare[:3]} (a pure dict, such as "
                        "TrainState.params, has no metadata)")
    out = []
    for path, var in variables:
        modes = var.get_metadata().get(NO_DECAY_KEY, ())
        out.append((dotted_path(path), NO_DECAY if mode in modes else DECAY))
    return params, out


def no_decay_mask(model_or_params: Any, *args, mode: str = "reference") -> Any:
    """The weight-decay mask: True = DECAY, False = in a no-decay group of `mode`.

    Args:
      model_or_params: a jmamba module (backbone, `MambaLM`, mixer) or its `nnx.State` of params
        (`nnx.state(model, nnx.Param)`, `TrainState.nnx_params()`; not the plain-dict
        `TrainState.params`, which carries no tags).
      mode: "reference" (mamba-rs groups, default), "official" (official `_no_weight_decay`
        markers) or "none" (decay everything); may be given positionally. The old call
        `no_decay_mask(params, arch, mode)` still works (arch is ignored, with a DeprecationWarning).

    Returns:
      A pytree with the structure of the params whose leaves are Python bools, True where the leaf
      is decayed; pass it as `mask=` to `fused_adamw` or `optax.adamw`.
    """
    mode = _mode_from_args(args, mode)
    params, decided = _classify(model_or_params, mode)
    return jax.tree.structure(params).unflatten([d for _, d in decided])


def no_decay_paths(model_or_params: Any, *args, mode: str = "reference") -> list[str]:
    """The dotted paths of the leaves that get NO weight decay (the False leaves of `no_decay_mask`)."""
    mode = _mode_from_args(args, mode)
    return [name for name, d in _classify(model_or_params, mode)[1] if d == NO_DECAY]
