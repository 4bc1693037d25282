"""Master weights as safetensors: flat keys (`layers.0.mixer.in_proj.kernel`), float32, config in metadata.

Keys follow the nnx parameter paths joined with dots; layouts are jmamba's ([in, out] kernels).
Metadata: `format = "jmamba"`, `config` = the JSON of the backbone or LM config.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file
from safetensors import safe_open

from jmamba.configs import config_from_json, config_to_json

FORMAT = "jmamba"


def flatten_params(params) -> dict[str, np.ndarray]:
    """nnx.State (or nested dict) of params -> {"a.b.c": np.ndarray}."""
    pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    flat = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(pure):
        key = ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        flat[key] = np.asarray(jax.device_get(leaf))
    return flat


def unflatten_params(flat: dict[str, np.ndarray]) -> dict:
    """{"a.0.c": x} -> nested dict with int keys for list indices (what nnx.replace_by_pure_dict takes)."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = [int(p) if p.isdigit() else p for p in key.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def save_safetensors(path, params, cfg) -> None:
    """Writes float32 master weights and `cfg` (backbone config or MambaLMConfig) to `path` atomically."""
    flat = flatten_params(params)
    bad = [k for k, v in flat.items() if v.dtype != np.float32]
    if bad:
        raise TypeError(f"params must be float32 master weights; not float32: {bad[:5]}")
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(flat, tmp, metadata={"format": FORMAT, "config": config_to_json(cfg)})
    os.replace(tmp, path)


def load_safetensors(path):
    """Reads a file written by `save_safetensors`.

    Returns:
      (params, cfg): params as a nested dict of numpy arrays (feed `nnx.replace_by_pure_dict`), and
      the config object.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no safetensors file at {path}")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT or "config" not in meta:
        raise ValueError(f"{path} is not a jmamba safetensors file (metadata format={meta.get('format')!r}); "
                         "use the interop loaders for HF or mamba-rs files")
    cfg = config_from_json(meta["config"])
    return unflatten_params(load_file(path)), cfg

