"""transformers `MambaForCausalLM` checkpoints <-> `jmamba.MambaLM` (docs/mamba1.md §6).

Reads a directory with `config.json` and `model.safetensors` (or shards listed in
`model.safetensors.index.json`): HF-native config keys (`hidden_size`, `num_hidden_layers`, ...) or the
original state-spaces keys (`d_model`, `n_layer`, ...). Tensors may be f32/bf16/f16; they become float32
masters. Layout changes: Linear weights `[out, in]` are transposed to jmamba's `[in, out]` kernels;
`conv1d.weight [E, 1, K]` becomes `[K, E]`. The head is tied when `tie_word_embeddings` is true or
absent (a stored `lm_head.weight` is then ignored, the embedding wins); untied needs `lm_head.weight`.

Every key and shape is checked before the model is built: a missing, unexpected or mis-shaped tensor
or an unsupported option (`use_bias: true`, `intermediate_size != expand·hidden_size`, a non-"silu"
activation) raises ValueError naming it, and nothing is half-loaded.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jmamba.core.files import read_json
from jmamba.lm import MambaLM
from jmamba.mamba1.config import Mamba1Config

_LAYER_KEYS = {  # HF mixer key -> (jmamba path inside the mixer, transform)
    "in_proj.weight": (("in_proj", "kernel"), "T"),
    "conv1d.weight": (("conv1d", "kernel"), "conv"),
    "conv1d.bias": (("conv1d", "bias"), None),
    "x_proj.weight": (("x_proj", "kernel"), "T"),
    "dt_proj.weight": (("dt_proj", "kernel"), "T"),
    "dt_proj.bias": (("dt_proj", "bias"), None),
    "A_log": (("A_log",), None),
    "D": (("D",), None),
    "out_proj.weight": (("out_proj", "kernel"), "T"),
}


def hf_config_to_mamba1(hf: dict) -> tuple[Mamba1Config, int, bool]:
    """HF / original config dict -> (Mamba1Config, vocab_size, tie_embeddings)."""
    def get(*names, default=None, required=True):
        for n in names:
            if n in hf:
                return hf[n]
        if required and default is None:
            raise ValueError(f"config.json has none of {names}")
        return default

    if hf.get("model_type", "mamba") not in ("mamba",):
        raise ValueError(f"config.json model_type must be 'mamba', got {hf.get('model_type')!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    d_model = get("hidden_size", "d_model")
    expand = get("expand", default=2)
    if "intermediate_size" in hf and hf["intermediate_size"] != int(expand * d_model):
        raise ValueError(f"config.json intermediate_size {hf['intermediate_size']} != expand·hidden_size "
                         f"= {int(expand * d_model)}")
    rank = hf.get("time_step_rank", "auto")
    if rank != "auto" and not isinstance(rank, int):
        raise ValueError(f"config.json time_step_rank must be 'auto' or an int, got {rank!r}")
    ssm_cfg = hf.get("ssm_cfg") or {}
    cfg = Mamba1Config(
        d_model=d_model,
        n_layers=get("num_hidden_layers", "n_layer"),
        d_state=get("state_size", default=ssm_cfg.get("d_state", 16)),
        d_conv=get("conv_kernel", default=ssm_cfg.get("d_conv", 4)),
        expand=expand,
        dt_rank=rank,
        norm_eps=get("layer_norm_epsilon", "rms_norm_eps", default=1e-5),
        conv_bias=bool(hf.get("use_conv_bias", True)),
        rescale_out_proj=False,
    ).validate()
    vocab = get("vocab_size")
    tie = bool(hf.get("tie_word_embeddings", True))
    return cfg, vocab, tie


def _shard_files(path):
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(set(weight_map.values()))
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return ["model.safetensors"]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def _read_tensors(path) -> dict[str, np.ndarray]:
    tensors = {}
    for name in _shard_files(path):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} (listed in the index) is missing")
        for key, value in read_safetensors_any_float(file).items():
            if key in tensors:
                raise ValueError(f"tensor {key!r} appears in more than one shard")
            tensors[key] = value
    return tensors


_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


def read_safetensors_any_float(file) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as numpy (BF16 widened to float32; numpy has no bfloat16).

    Memory-maps the file, so a large checkpoint is not read twice.
    """
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > min(size - 8, 1 << 28):
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (OSError, struct.error, ValueError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
    data = np.memmap(file, np.uint8, mode="r", offset=8 + n)
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info.get("dtype") not in _DTYPES:
            raise ValueError(f"{file}: tensor {key!r} has unsupported dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        if end > data.size:
            raise ValueError(f"{file}: tensor {key!r} lies past the end of the file (truncated?)")
        a = data[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        out[key] = a
    return out


def load_hf_mamba(path, *, rngs: nnx.Rngs | None = None) -> MambaLM:
    """Builds a MambaLM from a transformers MambaForCausalLM directory (config.json + safetensors)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json")
    hf = read_json(cfg_path)
    cfg, vocab, tie = hf_config_to_mamba1(hf)
    tensors = _read_tensors(path)
    if "backbone.embedding.weight" in tensors and "backbone.embeddings.weight" not in tensors:
        tensors["backbone.embeddings.weight"] = tensors.pop("backbone.embedding.weight")
    for bias in (k for k in tensors if k.endswith(("in_proj.bias", "out_proj.bias"))):
        raise ValueError(f"{bias}: in_proj/out_proj biases (use_bias=true) are not supported")
    if hf.get("use_bias"):
        raise ValueError("config.json use_bias=true is not supported (no in_proj/out_proj biases)")

    lm = MambaLM(cfg, vocab, tie_embeddings=tie, rngs=rngs or nnx.Rngs(0))
    target = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
    pure = _map_tensors(tensors, cfg, vocab, tie, target)
    state = nnx.state(lm, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(lm, state)
    return lm


def _map_tensors(tensors, cfg, vocab, tie, target):
    """HF tensors -> jmamba pure dict; every expected key checked, shapes verified against `target`."""
    used = set()
    out = {"backbone": {"layers": {}}}

    def take(key, transform=None):
        if key not in tensors:
            raise ValueError(f"missing tensor {key!r}")
        used.add(key)
        a = np.asarray(tensors[key], np.float32)
        if transform == "T":
            a = a.T
        elif transform == "conv":
            if a.ndim != 3 or a.shape[1] != 1:
                raise ValueError(f"{key} must have shape [E, 1, K], got {a.shape}")
            a = a[:, 0, :].T
        return np.ascontiguousarray(a)

    out["embedding"] = take("backbone.embeddings.weight")
    out["backbone"]["norm_f"] = {"weight": take("backbone.norm_f.weight")}
    for i in range(cfg.n_layers):
        pre = f"backbone.layers.{i}."
        mixer = {}
        for hf_key, (jpath, transform) in _LAYER_KEYS.items():
            if hf_key == "conv1d.bias" and not cfg.conv_bias:
                continue
            node = mixer
            for p in jpath[:-1]:
                node = node.setdefault(p, {})
            node[jpath[-1]] = take(pre + "mixer." + hf_key, transform)
        out["backbone"]["layers"][i] = {"norm": {"weight": take(pre + "norm.weight")}, "mixer": mixer}
    if tie:
        used.add("lm_head.weight")      # tied: the embedding is the head, a stored copy is ignored
    else:
        if "lm_head.weight" not in tensors:
            raise ValueError("tie_word_embeddings is false but the checkpoint has no 'lm_head.weight'")
        out["lm_head"] = {"kernel": take("lm_head.weight", "T")}
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise ValueError(f"unexpected tensors in the checkpoint: {unexpected[:8]}")
    _check_shapes(out, target)
    return out


def _check_shapes(got, want, path=""):
    if isinstance(want, dict):
        for k in want:
            if k not in got:
                raise ValueError(f"no tensor for parameter {path}{k}")
            _check_shapes(got[k], want[k], f"{path}{k}.")
        return
    if tuple(np.shape(got)) != tuple(np.shape(want)):
        raise ValueError(f"parameter {path[:-1]} must have shape {tuple(np.shape(want))} (after layout "
                         f"conversion), the checkpoint gives {tuple(np.shape(got))}")


def save_hf_mamba(path, lm: MambaLM) -> None:
    """Writes `lm` (a Mamba-1 MambaLM) as a transformers MambaForCausalLM directory (float32)."""
    cfg = lm.config.backbone
    if not isinstance(cfg, Mamba1Config):
        raise TypeError("save_hf_mamba writes Mamba-1 language models only")
    if cfg.input_dim is not None:
        raise ValueError("an HF MambaForCausalLM has no input projection (input_dim must be None)")
    p = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
    t = {"backbone.embeddings.weight": p["embedding"], "backbone.norm_f.weight": p["backbone"]["norm_f"]["weight"]}
    for i in range(cfg.n_layers):
        layer = p["backbone"]["layers"][i]
        t[f"backbone.layers.{i}.norm.weight"] = layer["norm"]["weight"]
        for hf_key, (jpath, transform) in _LAYER_KEYS.items():
            node = layer["mixer"]
            for k in jpath:
                node = node.get(k) if isinstance(node, dict) else None
                if node is None:
                    break
            if node is None:
                continue
            a = np.asarray(node, np.float32)
            a = a.T if transform == "T" else a.T[:, None, :] if transform == "conv" else a
            t[f"backbone.layers.{i}.mixer.{hf_key}"] = a
    if not lm.config.tie_embeddings:
        t["lm_head.weight"] = np.asarray(p["lm_head"]["kernel"], np.float32).T
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in t.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    hf = {
        "architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers, "intermediate_size": cfg.d_inner, "state_size": cfg.d_state,
        "conv_kernel": cfg.d_conv, "expand": cfg.expand, "time_step_rank": cfg.resolved_dt_rank,
        "layer_norm_epsilon": cfg.norm_eps, "vocab_size": lm.config.vocab_size, "use_bias": False,
        "use_conv_bias": cfg.conv_bias, "hidden_act": "silu", "residual_in_fp32": True,
        "tie_word_embeddings": lm.config.tie_embeddings, "time_step_min": cfg.dt_min,
        "time_step_max": cfg.dt_max, "time_step_floor": cfg.dt_init_floor, "time_step_scale": cfg.dt_scale,
        "time_step_init_scheme": cfg.dt_init, "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
