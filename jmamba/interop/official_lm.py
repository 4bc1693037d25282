"""The official mamba_ssm `MambaLMHeadModel` with Mamba-3 (SISO) layers <-> `jmamba.MambaLM`.

A directory holds `config.json` (the official `MambaConfig` fields: d_model, n_layer, vocab_size,
ssm_cfg with "layer": "Mamba3" and the Mamba3 constructor kwargs, rms_norm, residual_in_fp32,
fused_add_norm, pad_vocab_size_multiple, tie_embeddings) and `model.safetensors` (the model's
state_dict under its official names, any float dtype; converted to float32 masters):

    official key                                  jmamba parameter
    backbone.embedding.weight      [V, Dm]        embedding [V, Dm]
    backbone.layers.{i}.norm.weight [Dm]          backbone.layers.{i}.norm.weight
    backbone.layers.{i}.mixer.*                   backbone.layers.{i}.mixer.* (official_mamba3 names)
    backbone.norm_f.weight         [Dm]           backbone.norm_f.weight
    lm_head.weight                 [V, Dm]        lm_head.kernel [Dm, V] (untied only; tied: the embedding)

The official model pads the vocabulary to a multiple of `pad_vocab_size_multiple`; the padded size is
the MambaLM's vocab_size (its embedding has the padded rows), so logits have the same width as the
official model's. The forward is the official one (pre-norm RMSNorm blocks with the residual in
float32, eps 1e-5, final RMSNorm, head; docs/mamba3_siso.md §3.1); fused_add_norm and
residual_in_fp32 change only how PyTorch computes it. Loading is strict: every problem (missing,
unexpected, mis-shaped tensors, unsupported settings) is raised as one ValueError.
"""

from __future__ import annotations

import json
import os

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jmamba.interop.official_mamba3 import (config_from_official, official_kwargs, official_state_dict,
                                            params_from_official, read_official_dir)
from jmamba.lm import MambaLM
from jmamba.mamba3.config import Mamba3Config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_SUPPORTED = {"d_model", "n_layer", "vocab_size", "ssm_cfg", "rms_norm", "residual_in_fp32", "fused_add_norm",
              "pad_vocab_size_multiple", "tie_embeddings", "d_intermediate", "attn_layer_idx", "attn_cfg"}


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return vocab_size + (-vocab_size) % multiple


def lm_config_from_official(conf: dict):
    """(Mamba3Config, padded vocab, tie) from an official `MambaConfig` dict; ValueError on anything unsupported."""
    if not isinstance(conf, dict):
        raise TypeError(f"config must be a JSON object (MambaConfig fields), got {type(conf).__name__}")
    problems = [f"unknown MambaConfig field {k!r}" for k in sorted(set(conf) - _SUPPORTED)]
    ssm = dict(conf.get("ssm_cfg") or {})
    if ssm.pop("layer", "Mamba1") != "Mamba3":
        problems.append("ssm_cfg.layer must be 'Mamba3' (Mamba-1 models load with jmamba.load_hf_mamba)")
    if conf.get("d_intermediate", 0):
        problems.append("d_intermediate > 0 (MLP blocks) is not supported")
    if conf.get("attn_layer_idx"):
        problems.append("attention layers (attn_layer_idx) are not supported")
    if not conf.get("rms_norm", True):
        problems.append("rms_norm=false (LayerNorm blocks) is not supported")
    for k in ("d_model", "n_layer", "vocab_size"):
        v = conf.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            problems.append(f"{k} must be a positive int, got {v!r}")
    multiple = conf.get("pad_vocab_size_multiple", 8)
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple <= 0:
        problems.append(f"pad_vocab_size_multiple must be a positive int, got {multiple!r}")
    if problems:
        raise ValueError("official MambaConfig not supported: " + "; ".join(problems))
    mixer_cfg = config_from_official({**ssm, "d_model": conf["d_model"], "n_layer": conf["n_layer"]})
    return mixer_cfg, padded_vocab(conf["vocab_size"], multiple), bool(conf.get("tie_embeddings", True))


def lm_from_official(conf: dict, state_dict: dict) -> MambaLM:
    """A MambaLM holding an official MambaLMHeadModel(Mamba3) state_dict (name -> array)."""
    cfg, vocab, tie = lm_config_from_official(conf)
    Dm = cfg.d_model
    want = {"backbone.embedding.weight": (vocab, Dm), "backbone.norm_f.weight": (Dm,)}
    want |= {f"backbone.layers.{i}.norm.weight": (Dm,) for i in range(cfg.n_layers)}
    if not tie:
        want["lm_head.weight"] = (vocab, Dm)
    mixer_keys = {f"backbone.layers.{i}.mixer." for i in range(cfg.n_layers)}
    problems = [f"missing key {k!r} (shape {s})" for k, s in want.items() if k not in state_dict]
    problems += [f"{k!r} has shape {tuple(np.shape(state_dict[k]))}, expected {s}" for k, s in want.items()
                 if k in state_dict and tuple(np.shape(state_dict[k])) != s]
    known = set(want) | ({"lm_head.weight"} if tie else set())
    problems += [f"unexpected key {k!r}" for k in sorted(state_dict)
                 if k not in known and not any(k.startswith(p) for p in mixer_keys)]
    layers = {}
    for i in range(cfg.n_layers):
        prefix = f"backbone.layers.{i}.mixer."
        sub = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        try:
            layers[i] = params_from_official(sub, cfg, strict=True)
        except ValueError as e:
            problems.append(f"layer {i}: {e}")
    if problems:
        raise ValueError("official MambaLMHeadModel state_dict does not match its config: " + "; ".join(problems))
    f32 = lambda k: np.asarray(np.asarray(state_dict[k], np.float32))   # noqa: E731
    pure = {"embedding": f32("backbone.embedding.weight"),
            "backbone": {"layers": {i: {"norm": {"weight": f32(f"backbone.layers.{i}.norm.weight")},
                                        "mixer": layers[i]} for i in range(cfg.n_layers)},
                         "norm_f": {"weight": f32("backbone.norm_f.weight")}}}
    if not tie:
        pure["lm_head"] = {"kernel": np.ascontiguousarray(f32("lm_head.weight").T)}
    lm = MambaLM(cfg, vocab, tie_embeddings=tie, rngs=nnx.Rngs(0))
    state = nnx.state(lm, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(lm, state)
    return lm


def load_official_lm(path) -> MambaLM:
    """Loads an official MambaLMHeadModel(Mamba3) directory (config.json + model.safetensors)."""
    conf, state_dict = read_official_dir(path, "official MambaLMHeadModel directory")
    return lm_from_official(conf, state_dict)


def official_lm_config(lm: MambaLM) -> dict:
    """The official MambaConfig dict of a Mamba-3 MambaLM (vocabulary taken as already padded)."""
    cfg = lm.config.backbone
    if not isinstance(cfg, Mamba3Config):
        raise TypeError(f"only Mamba-3 LMs export as an official MambaLMHeadModel, got {type(cfg).__name__}")
    if cfg.input_dim is not None or cfg.norm_eps != 1e-5:
        raise ValueError("the official model has no input projection and uses RMSNorm eps 1e-5")
    ssm = {"layer": "Mamba3", **official_kwargs(cfg)}
    ssm.pop("d_model")
    return {"d_model": cfg.d_model, "n_layer": cfg.n_layers, "vocab_size": lm.config.vocab_size, "ssm_cfg": ssm,
            "d_intermediate": 0, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
            "pad_vocab_size_multiple": 8 if lm.config.vocab_size % 8 == 0 else 1,
            "tie_embeddings": lm.config.tie_embeddings}


def official_lm_state_dict(lm: MambaLM) -> dict[str, np.ndarray]:
    """The MambaLM's parameters under official MambaLMHeadModel names and torch layouts (float32)."""
    conf = official_lm_config(lm)
    p = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
    sd = {"backbone.embedding.weight": np.asarray(p["embedding"], np.float32),
          "backbone.norm_f.weight": np.asarray(p["backbone"]["norm_f"]["weight"], np.float32)}
    for i, layer in enumerate(lm.backbone.layers):
        sd[f"backbone.layers.{i}.norm.weight"] = np.asarray(layer.norm.weight[...], np.float32)
        sd |= {f"backbone.layers.{i}.mixer.{k}": v for k, v in official_state_dict(layer.mixer).items()}
    if not conf["tie_embeddings"]:
        sd["lm_head.weight"] = np.ascontiguousarray(np.asarray(p["lm_head"]["kernel"], np.float32).T)
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def save_official_lm(path, lm: MambaLM) -> None:
    """Writes a Mamba-3 MambaLM as an official MambaLMHeadModel directory (config.json + model.safetensors)."""
    conf = official_lm_config(lm)
    sd = official_lm_state_dict(lm)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, f".{WEIGHTS_FILE}.tmp-{os.getpid()}")
    save_file(sd, tmp)
    os.replace(tmp, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
