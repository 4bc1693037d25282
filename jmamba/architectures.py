"""The architecture registry: everything jmamba knows about an architecture, in one place.

An `Architecture` names its config class (a frozen dataclass with `arch`, `validate()`, `d_model`,
`input_dim`), its backbone and mixer classes and its per-layer state type. The LM wrapper, config
(de)serialisation, checkpoints and loaders look architectures up here instead of keeping their own
tables; a new architecture registers itself with `register_architecture`. Which parameters skip
weight decay is not kept here: the parameters carry it as metadata (`jmamba.core.tags`).
"""

from __future__ import annotations

import dataclasses
from typing import Union

from jmamba.mamba1 import Mamba1Backbone, Mamba1Config, Mamba1LayerState, Mamba1Mixer
from jmamba.mamba3 import Mamba3Backbone, Mamba3Config, Mamba3LayerState, Mamba3Mixer


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One architecture.

    Attributes:
      name: the tag stored with configs ("mamba1", "mamba3"); equals `config_cls.arch`.
      config_cls, backbone_cls, mixer_cls: its classes.
      layer_state_cls: the NamedTuple of one layer's recurrent state.
    """

    name: str
    config_cls: type
    backbone_cls: type
    mixer_cls: type
    layer_state_cls: type


_REGISTRY: dict[str, Architecture] = {}


def register_architecture(arch: Architecture) -> Architecture:
    """Adds `arch` (its name must equal its config class's `arch` tag and be new)."""
    if not isinstance(arch, Architecture):
        raise TypeError(f"arch must be an Architecture, got {type(arch).__name__}")
    if getattr(arch.config_cls, "arch", None) != arch.name:
        raise ValueError(f"{arch.config_cls.__name__}.arch must be {arch.name!r}")
    if arch.name in _REGISTRY or arch.name == "lm":
        raise ValueError(f"an architecture named {arch.name!r} is already registered")
    _REGISTRY[arch.name] = arch
    return arch


def architecture_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_architecture(key: Union[str, object]) -> Architecture:
    """The architecture of a name ("mamba1"), a config class or a config instance.

    Raises:
      ValueError for an unknown name, TypeError for an object that is not a registered config.
    """
    if isinstance(key, str):
        if key not in _REGISTRY:
            raise ValueError(f"unknown architecture {key!r}; registered: {sorted(_REGISTRY)}")
        return _REGISTRY[key]
    cls = key if isinstance(key, type) else type(key)
    for arch in _REGISTRY.values():
        if cls is arch.config_cls:
            return arch
    raise TypeError(f"expected a backbone config ({', '.join(a.config_cls.__name__ for a in _REGISTRY.values())}), "
                    f"got {cls.__name__}")


register_architecture(Architecture("mamba1", Mamba1Config, Mamba1Backbone, Mamba1Mixer, Mamba1LayerState))
register_architecture(Architecture("mamba3", Mamba3Config, Mamba3Backbone, Mamba3Mixer, Mamba3LayerState))
