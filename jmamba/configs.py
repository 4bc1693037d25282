"""Config (de)serialisation: configs travel as JSON inside safetensors metadata and checkpoints."""

from __future__ import annotations

import dataclasses
import json

from jmamba.lm import MambaLMConfig
from jmamba.mamba1.config import Mamba1Config
from jmamba.mamba3.config import Mamba3Config

CONFIG_CLASSES = {"mamba1": Mamba1Config, "mamba3": Mamba3Config}


def config_to_dict(cfg) -> dict:
    """A JSON-able dict with an `arch` tag ("mamba1", "mamba3" or "lm")."""
    if isinstance(cfg, MambaLMConfig):
        return {"arch": "lm", "backbone": config_to_dict(cfg.backbone), "vocab_size": cfg.vocab_size,
                "tie_embeddings": cfg.tie_embeddings}
    if type(cfg) not in CONFIG_CLASSES.values():
        raise TypeError(f"cfg must be a backbone config or MambaLMConfig, got {type(cfg).__name__}")
    return {"arch": cfg.arch, **dataclasses.asdict(cfg)}


def config_from_dict(d: dict):
    d = dict(d)
    arch = d.pop("arch", None)
    if arch == "lm":
        return MambaLMConfig(config_from_dict(d["backbone"]), d["vocab_size"], d["tie_embeddings"]).validate()
    if arch not in CONFIG_CLASSES:
        raise ValueError(f"unknown config arch {arch!r}; expected one of {sorted(CONFIG_CLASSES) + ['lm']}")
    cls = CONFIG_CLASSES[arch]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}")
    return cls(**d).validate()


def config_to_json(cfg) -> str:
    return json.dumps(config_to_dict(cfg), sort_keys=True)


def config_from_json(s: str):
    return config_from_dict(json.loads(s))
