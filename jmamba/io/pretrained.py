"""`MambaLM.save_pretrained` / `MambaLM.from_pretrained`: a trained model in and out in one call.

A pretrained directory holds two files:

    config.json         {"format": "jmamba", "format_version": 1, "config": <the MambaLMConfig>}
    model.safetensors   float32 master weights (`save_safetensors`, config also in the metadata)

`from_pretrained` also reads a training-checkpoint directory (`save_checkpoint`, with the
`MambaLMConfig` stored as its config): the parameters of the newest (or the given) step. Loading is
strict (`jmamba.load_weights`): a missing, unexpected, wrong-shape or non-finite tensor raises a
`ValueError` listing all of them. Both architectures (any registered one) work.

The methods live on `MambaLM`; this module implements them (registered with `jmamba.lm` when
`jmamba.io` is imported, which `import jmamba` does), so the model layer does not import io.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx

from jmamba import lm as lm_module
from jmamba.configs import config_from_dict, config_to_dict
from jmamba.core.files import read_json
from jmamba.io.checkpoint import CheckpointError, _open_checkpoint, checkpoint_info
from jmamba.io.safetensors_io import save_safetensors
from jmamba.io.weights import load_weights
from jmamba.lm import MambaLM, MambaLMConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "jmamba"
FORMAT_VERSION = 1


def save_pretrained(directory, lm: MambaLM) -> str:
    """Writes `lm`'s config and float32 weights into `directory` (created if missing); returns it."""
    if not isinstance(lm, MambaLM):
        raise TypeError(f"lm must be a MambaLM, got {type(lm).__name__}")
    os.makedirs(directory, exist_ok=True)
    save_safetensors(os.path.join(directory, WEIGHTS_FILE), nnx.state(lm, nnx.Param), lm.config)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": config_to_dict(lm.config)}
    tmp = os.path.join(directory, f".{CONFIG_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(directory, CONFIG_FILE))
    return os.path.abspath(directory)


def _read_config(directory):
    path = os.path.join(directory, CONFIG_FILE)
    meta = read_json(path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "config" not in meta:
        raise ValueError(f"{path} is not a jmamba pretrained config (for transformers directories use "
                         "jmamba.load_hf_mamba)")
    cfg = config_from_dict(meta["config"])
    if not isinstance(cfg, MambaLMConfig):
        raise ValueError(f"{path} holds a backbone config, not a MambaLM config")
    return cfg


def _build(cfg: MambaLMConfig, rngs):
    return MambaLM(cfg.backbone, cfg.vocab_size, tie_embeddings=cfg.tie_embeddings, rngs=rngs or nnx.Rngs(0))


def from_pretrained(directory, *, step=None, rngs=None) -> MambaLM:
    """A `MambaLM` from a pretrained directory or a training-checkpoint directory (newest step, or `step`)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no directory {directory}")
    if os.path.isfile(os.path.join(directory, CONFIG_FILE)):
        if step is not None:
            raise ValueError("step is only meaningful for a checkpoint directory")
        lm = _build(_read_config(directory), rngs)
        load_weights(lm, os.path.join(directory, WEIGHTS_FILE))
        return lm
    info = checkpoint_info(directory, step)   # FileNotFoundError when it is not a checkpoint folder either
    cfg = info["config"]
    if not isinstance(cfg, MambaLMConfig):
        raise ValueError(f"checkpoint {directory} (step {info['step']}) was saved without a MambaLM config "
                         "(save_checkpoint(..., config=lm.config)); cannot tell which model it holds")
    lm = _build(cfg, rngs)
    load_weights(lm, _checkpoint_params(directory, info["step"], lm))
    return lm


def _checkpoint_params(directory, step, lm):
    """{dotted param key: array} of the TrainState.params stored in a checkpoint."""
    import orbax.checkpoint as ocp

    with _open_checkpoint(directory, step) as (mngr, step, _meta):
        try:
            flat = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
        except Exception as e:   # noqa: BLE001
            raise CheckpointError(f"checkpoint step {step} in {directory}: its arrays could not be read "
                                  f"({type(e).__name__}: {str(e)[:300]})") from e
    out = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(nnx.state(lm, nnx.Param)):
        key = ".params" + jax.tree_util.keystr(path)
        if key in flat:
            dotted = ".".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path
                              if getattr(p, "name", None) != "value")
            out[dotted] = np.asarray(flat[key])
    return out


lm_module.register_pretrained_io(save_pretrained, from_pretrained)
