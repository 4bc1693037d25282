"""`no_decay_mask`: the optax weight-decay mask that leaves out the Mamba no-decay groups.

POLARITY: the returned pytree holds True = DECAY this leaf, False = NO decay, the convention of
`optax.adamw(mask=...)` and `jmamba.optim.fused_adamw(mask=...)`. The function is named after the
groups it removes; `no_decay_paths` lists those groups by path, and `DECAY` / `NO_DECAY` name
the two values.

Groups (spec/mamba1.md §2.3, spec/mamba3_siso.md §2.4), by nnx path inside a backbone (`layers[i]`
is any layer):

  mode "reference" (the mamba-rs `reference_no_decay` groups)
    mamba1: layers[i].norm.weight, layers[i].mixer.dt_proj.bias, layers[i].mixer.A_log,
            layers[i].mixer.D, norm_f.weight
    mamba3: every norm scale (layers[i].norm.weight, layers[i].mixer.{B_norm,C_norm,norm}.weight,
            norm_f.weight), layers[i].mixer.{dt_bias, D}, and every bias
            (input_proj.bias, layers[i].mixer.{B_bias, C_bias})
  mode "official" (the official `_no_weight_decay` markers)
    mamba1: A_log, D;   mamba3: dt_bias, D
  mode "none": every leaf is decayed.

Everything else is decayed: the projections, conv1d (kernel and bias), input_proj.kernel, and in a
`MambaLM` (paths under `backbone.`) the `embedding` and `lm_head`.

Open question: spec/mamba3_siso.md §2.4 reads mamba-rs as still decaying input_proj.bias, B_bias
and C_bias; the Mamba-3 "reference" group above follows the project's issue text instead (every
bias undecayed). The choice is one line in `_NO_DECAY[("mamba3", "reference")]`.

A path that is not a parameter of the named architecture raises ValueError: a mask for the wrong
architecture would otherwise silently decay A_log or D.
"""

from __future__ import annotations

import re
from typing import Any

import jax

DECAY = True
NO_DECAY = False

ARCHS = ("mamba1", "mamba3")
MODES = ("reference", "official", "none")

_LAYER = r"layers\.\d+\."
# Every parameter path of each backbone (regular expressions over dotted paths, layer index as \d+).
_KNOWN = {
    "mamba1": [r"input_proj\.(kernel|bias)", _LAYER + r"norm\.weight",
               _LAYER + r"mixer\.(in_proj\.kernel|conv1d\.kernel|conv1d\.bias|x_proj\.kernel"
                        r"|dt_proj\.kernel|dt_proj\.bias|A_log|D|out_proj\.kernel)",
               r"norm_f\.weight"],
    "mamba3": [r"input_proj\.(kernel|bias)", _LAYER + r"norm\.weight",
               _LAYER + r"mixer\.(in_proj\.kernel|dt_bias|B_bias|C_bias|B_norm\.weight"
                        r"|C_norm\.weight|D|norm\.weight|out_proj\.kernel)",
               r"norm_f\.weight"],
}
_NO_DECAY = {
    ("mamba1", "reference"): [_LAYER + r"norm\.weight", _LAYER + r"mixer\.(dt_proj\.bias|A_log|D)",
                              r"norm_f\.weight"],
    ("mamba1", "official"): [_LAYER + r"mixer\.(A_log|D)"],
    ("mamba3", "reference"): [_LAYER + r"norm\.weight",
                              _LAYER + r"mixer\.(B_norm\.weight|C_norm\.weight|norm\.weight"
                                       r"|dt_bias|D|B_bias|C_bias)",
                              r"norm_f\.weight", r"input_proj\.bias"],
    ("mamba3", "official"): [_LAYER + r"mixer\.(dt_bias|D)"],
}
# Parameters of MambaLM outside the backbone (always decayed).
_LM_OUTSIDE = [r"embedding", r"lm_head\.kernel"]


def _compile(patterns):
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


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


def _check(arch, mode):
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _classify(params, arch, mode):
    """Yields (key path, dotted path, decayed?) for every leaf, checking that it belongs to `arch`."""
    _check(arch, mode)
    known = _compile(_KNOWN[arch])
    outside = _compile(_LM_OUTSIDE)
    no_decay = _compile(_NO_DECAY.get((arch, mode), []))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ValueError("params has no leaves")
    is_lm = any(dotted_path(p).startswith("backbone.") for p, _ in leaves)
    out = []
    for path, _ in leaves:
        name = dotted_path(path)
        inner = name
        if is_lm:
            if outside.fullmatch(name):
                out.append((path, name, DECAY))
                continue
            if not name.startswith("backbone."):
                raise ValueError(f"params: {name!r} is not a parameter of a MambaLM ({arch})")
            inner = name[len("backbone."):]
        if not known.fullmatch(inner):
            raise ValueError(f"params: {name!r} is not a parameter of a {arch} backbone "
                             f"(wrong arch, or not an nnx.Param state / param dict?)")
        decayed = not (no_decay is not None and no_decay.fullmatch(inner))
        out.append((path, name, DECAY if decayed else NO_DECAY))
    return out


def no_decay_mask(params: Any, arch: str, mode: str = "reference") -> Any:
    """The weight-decay mask for `params`: True = DECAY, False = in a no-decay group.

    Args:
      params: the parameter pytree of a Mamba-1/Mamba-3 backbone or of a `MambaLM`: an
        `nnx.State` of params (`nnx.state(model, nnx.Param)`) or nested dicts/lists with the same
        paths.
      arch: "mamba1" or "mamba3".
      mode: "reference" (mamba-rs groups), "official" (official `_no_weight_decay` markers) or
        "none" (decay everything).

    Returns:
      A pytree with the structure of `params` whose leaves are Python bools, True where the leaf
      is decayed; pass it as `mask=` to `fused_adamw` or `optax.adamw`.
    """
    decided = [d for _, _, d in _classify(params, arch, mode)]
    return jax.tree.structure(params).unflatten(decided)


def no_decay_paths(params: Any, arch: str, mode: str = "reference") -> list[str]:
    """The dotted paths of the leaves that get NO weight decay (the False leaves of `no_decay_mask`)."""
    return [name for _, name, d in _classify(params, arch, mode) if d == NO_DECAY]
