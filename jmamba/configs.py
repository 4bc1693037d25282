"""Config (de)serialisation: configs travel as JSON inside safetensors metadata and checkpoints."""

from __future__ import annotations

import dataclasses
import json

from jmamba.architectures import architecture_names, get_architecture
from jmamba.lm import MambaLMConfig


def config_to_dict(cfg) -> dict:
    """A JSON-able dict with an `arch` tag ("mamba1", "mamba3" or "lm"); deprecated fields are left out."""
    if isinstance(cfg, MambaLMConfig):
        return {"arch": "lm", "backbone": config_to_dict(cfg.backbone), "vocab_size": cfg.vocab_size,
                "tie_embeddings": cfg.tie_embeddings}
    try:
        get_architecture(cfg)
    except TypeError:
        raise TypeError(f"cfg must be a backbone config or MambaLMConfig, got {type(cfg).__name__}") from None
    skip = set(getattr(cfg, "deprecated_fields", ()))
    return {"arch": cfg.arch, **{k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip}}


def normalize_config_dict(d: dict) -> dict:
    """A stored config dict without the fields that are no longer part of a config (e.g. the Mamba-3
    `chunk_size` of checkpoints written before it became a tuning knob), so old checkpoints restore
    and compare equal to a config built today."""
    d = dict(d)
    if d.get("arch") == "lm" and isinstance(d.get("backbone"), dict):
        d["backbone"] = normalize_config_dict(d["backbone"])
    elif d.get("arch") in architecture_names():
        cls = get_architecture(d["arch"]).config_cls
        for name in getattr(cls, "deprecated_fields", ()):
            d.pop(name, None)
    return d


def config_from_dict(d: dict):
    d = normalize_config_dict(d)
    arch = d.pop("arch", None)
    if arch == "lm":
        return MambaLMConfig(config_from_dict(d["backbone"]), d["vocab_size"], d["tie_embeddings"]).validate()
    if arch not in architecture_names():
        raise ValueError(f"unknown config arch {arch!r}; expected one of {sorted(architecture_names()) + ['lm']}")
    cls = get_architecture(arch).config_cls
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}")
    return cls(**d).validate()


def config_to_json(cfg) -> str:
    return json.dumps(config_to_dict(cfg), sort_keys=True)


def config_from_json(s: str):
    return config_from_dict(json.loads(s))


def __getattr__(name):
    if name == "CONFIG_CLASSES":   # the old table; the architecture registry replaces it
        import warnings

        warnings.warn("jmamba.configs.CONFIG_CLASSES is deprecated; use jmamba.get_architecture(name).config_cls",
                      DeprecationWarning, stacklevel=2)
        return {n: get_architecture(n).config_cls for n in architecture_names()}
    raise AttributeError(f"module 'jmamba.configs' has no attribute {name!r}")
