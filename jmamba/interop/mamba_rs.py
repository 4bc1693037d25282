"""mamba-rs native safetensors files <-> jmamba backbone parameters (spec/mamba1.md §6.5).

mamba-rs (`serialize.rs`) stores float32 tensors with its own key names and row-major `[in, out]`
linear layouts (the same as jmamba's kernels), and the config as JSON in the metadata entry `config`:
`{d_model, d_state, d_conv, expand, n_layers, input_dim, scan_mode, rms_norm_eps}`.

| mamba-rs key | jmamba path | layout |
|---|---|---|
| `input_proj.weight` [input_dim, D], `input_proj.bias` [D] | `input_proj.kernel`, `input_proj.bias` | same |
| `layers.{i}.norm.weight` [D] | `layers[i].norm.weight` | same |
| `layers.{i}.in_proj.weight` [D, 2E] | `layers[i].mixer.in_proj.kernel` | same |
| `layers.{i}.conv1d.weight` [E, K] | `layers[i].mixer.conv1d.kernel` [K, E] | transposed |
| `layers.{i}.conv1d.bias` [E] | `layers[i].mixer.conv1d.bias` | same (zeros when conv_bias=False) |
| `layers.{i}.x_proj.weight` [E, R+2N] | `layers[i].mixer.x_proj.kernel` | same |
| `layers.{i}.dt_proj.weight` [R, E], `.bias` [E] | `layers[i].mixer.dt_proj.kernel`, `.bias` | same |
| `layers.{i}.a_log` [E, N], `layers.{i}.D` [E] | `layers[i].mixer.A_log`, `.D` | same |
| `layers.{i}.out_proj.weight` [E, D] | `layers[i].mixer.out_proj.kernel` | same |
| `norm_f.weight` [D] | `norm_f.weight` | same |

mamba-rs always has an input projection and always uses dt_rank = ceil(d_model / 16); writing a
backbone without `input_dim` or with another dt_rank is refused. Mamba-3 files are not handled yet.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jmamba.io.safetensors_io import flatten_params, unflatten_params
from jmamba.mamba1.config import Mamba1Config

_MIXER = {  # mamba-rs name -> (jmamba mixer path, transpose?)
    "in_proj.weight": ("in_proj.kernel", False),
    "conv1d.weight": ("conv1d.kernel", True),
    "conv1d.bias": ("conv1d.bias", False),
    "x_proj.weight": ("x_proj.kernel", False),
    "dt_proj.weight": ("dt_proj.kernel", False),
    "dt_proj.bias": ("dt_proj.bias", False),
    "a_log": ("A_log", False),
    "D": ("D", False),
    "out_proj.weight": ("out_proj.kernel", False),
}


def _key_map(cfg: Mamba1Config):
    """[(mamba-rs key, jmamba flat key, transpose)] for every tensor."""
    m = [("input_proj.weight", "input_proj.kernel", False), ("input_proj.bias", "input_proj.bias", False)]
    for i in range(cfg.n_layers):
        m.append((f"layers.{i}.norm.weight", f"layers.{i}.norm.weight", False))
        for rs, (ours, t) in _MIXER.items():
            m.append((f"layers.{i}.{rs}", f"layers.{i}.mixer.{ours}", t))
    m.append(("norm_f.weight", "norm_f.weight", False))
    return m


def save_mamba_rs(path, params, cfg: Mamba1Config) -> None:
    """Writes a Mamba-1 backbone's float32 params as a mamba-rs safetensors file."""
    if not isinstance(cfg, Mamba1Config):
        raise TypeError(f"cfg must be a Mamba1Config (mamba-rs Mamba-3 files are not supported yet), got {type(cfg).__name__}")
    if cfg.input_dim is None:
        raise ValueError("mamba-rs backbones always have an input projection: cfg.input_dim must be set")
    if cfg.resolved_dt_rank != math.ceil(cfg.d_model / 16):
        raise ValueError(f"mamba-rs fixes dt_rank = ceil(d_model/16) = {math.ceil(cfg.d_model / 16)}, "
                         f"got {cfg.resolved_dt_rank}")
    flat = flatten_params(params)
    out = {}
    for rs, ours, transpose in _key_map(cfg):
        if ours not in flat:
            if ours.endswith("conv1d.bias") and not cfg.conv_bias:
                out[rs] = np.zeros((cfg.d_inner,), np.float32)
                continue
            raise ValueError(f"params have no {ours!r} (is this a Mamba-1 backbone for {cfg}?)")
        a = np.asarray(flat[ours], np.float32)
        out[rs] = np.ascontiguousarray(a.T if transpose else a)
    meta = {"d_model": cfg.d_model, "d_state": cfg.d_state, "d_conv": cfg.d_conv, "expand": cfg.expand,
            "n_layers": cfg.n_layers, "input_dim": cfg.input_dim, "scan_mode": "Auto",
            "rms_norm_eps": cfg.norm_eps}
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(out, tmp, metadata={"config": json.dumps(meta)})
    os.replace(tmp, path)


def load_mamba_rs(path):
    """Reads a mamba-rs Mamba-1 safetensors file.

    Returns:
      (params as a nested dict for `nnx.replace_by_pure_dict`, Mamba1Config). The config has
      `conv_bias=True` (mamba-rs always stores one) and `rescale_out_proj=False`.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file at {path}")
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:   # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from e
    if "config" not in meta:
        raise ValueError(f"{path}: no 'config' metadata (not a mamba-rs file)")
    rs = json.loads(meta["config"])
    if rs.get("mamba_version", 1) != 1:
        raise ValueError(f"{path}: mamba_version {rs.get('mamba_version')} files are not supported yet")
    missing = [k for k in ("d_model", "d_state", "d_conv", "expand", "n_layers", "input_dim") if k not in rs]
    if missing:
        raise ValueError(f"{path}: config metadata lacks {missing}")
    cfg = Mamba1Config(d_model=rs["d_model"], n_layers=rs["n_layers"], d_state=rs["d_state"], d_conv=rs["d_conv"],
                       expand=rs["expand"], input_dim=rs["input_dim"], norm_eps=rs.get("rms_norm_eps", 1e-5),
                       rescale_out_proj=False).validate()
    E, N, K, R, D = cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.resolved_dt_rank, cfg.d_model
    shapes = {"input_proj.weight": (cfg.input_dim, D), "input_proj.bias": (D,), "norm_f.weight": (D,)}
    layer_shapes = {"norm.weight": (D,), "in_proj.weight": (D, 2 * E), "conv1d.weight": (E, K), "conv1d.bias": (E,),
                    "x_proj.weight": (E, R + 2 * N), "dt_proj.weight": (R, E), "dt_proj.bias": (E,),
                    "a_log": (E, N), "D": (E,), "out_proj.weight": (E, D)}
    flat = {}
    expected = _key_map(cfg)
    for rs_key, ours, transpose in expected:
        if rs_key not in tensors:
            raise ValueError(f"{path}: missing tensor {rs_key!r}")
        want = shapes.get(rs_key) or layer_shapes[rs_key.split(".", 2)[2]]
        a = np.asarray(tensors[rs_key])
        if a.shape != want:
            raise ValueError(f"{path}: tensor {rs_key!r} must have shape {want}, got {a.shape}")
        if a.dtype != np.float32:
            raise ValueError(f"{path}: tensor {rs_key!r} must be float32 (mamba-rs files are f32), got {a.dtype}")
        flat[ours] = np.ascontiguousarray(a.T if transpose else a)
    unexpected = sorted(set(tensors) - {k for k, _, _ in expected})
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors {unexpected[:8]}")
    return unflatten_params(flat), cfg
