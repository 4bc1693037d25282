"""mamba-rs native safetensors files <-> jmamba backbone parameters (docs/mamba1.md §6.5).

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
backbone without `input_dim` or with another dt_rank is refused.

Mamba-3 SISO files (docs/mamba3_siso.md §2.1, §2.5, §5 rows 7-8; metadata `config` with
`mamba_version: 3`, `d_model, d_state, expand, headdim, ngroups, n_layers, input_dim, rope_fraction,
a_floor`):

| mamba-rs key | jmamba path | layout |
|---|---|---|
| `layers.{i}.in_proj.weight` [Dm, in_proj_dim] | `layers[i].mixer.in_proj.kernel` | same |
| `layers.{i}.dt_bias` [H], `.D` [H] | `.dt_bias`, `.D` | same |
| `layers.{i}.b_bias`, `.c_bias` [H, N] | `.B_bias`, `.C_bias` | same |
| `layers.{i}.b_norm.weight`, `.c_norm.weight` [N] | `.B_norm.weight`, `.C_norm.weight` | same |
| `layers.{i}.norm_gate.weight` [Di] (always stored) | `.norm.weight` (only when is_outproj_norm) | same |
| `layers.{i}.out_proj.weight` [Di, Dm] | `.out_proj.kernel` | same |

mamba-rs does not store `is_outproj_norm`: `load_mamba_rs(path, is_outproj_norm=...)` takes it (a
model without the gated norm writes ones there). Its `chunk_size` is not stored either (64 here).
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
from jmamba.mamba3.config import Mamba3Config

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


_MIXER3 = {  # mamba-rs name -> jmamba mixer path (no transposes: both store [in, out])
    "in_proj.weight": "in_proj.kernel", "dt_bias": "dt_bias", "b_bias": "B_bias", "c_bias": "C_bias",
    "b_norm.weight": "B_norm.weight", "c_norm.weight": "C_norm.weight", "D": "D",
    "norm_gate.weight": "norm.weight", "out_proj.weight": "out_proj.kernel",
}


def _key_map(cfg):
    """[(mamba-rs key, jmamba flat key, transpose)] for every tensor."""
    mixer = {k: v for k, v in _MIXER.items()} if isinstance(cfg, Mamba1Config) else \
        {k: (v, False) for k, v in _MIXER3.items()}
    m = [("input_proj.weight", "input_proj.kernel", False), ("input_proj.bias", "input_proj.bias", False)]
    for i in range(cfg.n_layers):
        m.append((f"layers.{i}.norm.weight", f"layers.{i}.norm.weight", False))
        for rs, (ours, t) in mixer.items():
            m.append((f"layers.{i}.{rs}", f"layers.{i}.mixer.{ours}", t))
    m.append(("norm_f.weight", "norm_f.weight", False))
    return m


def _rs_metadata(cfg):
    if isinstance(cfg, Mamba1Config):
        return {"d_model": cfg.d_model, "d_state": cfg.d_state, "d_conv": cfg.d_conv, "expand": cfg.expand,
                "n_layers": cfg.n_layers, "input_dim": cfg.input_dim, "scan_mode": "Auto",
                "rms_norm_eps": cfg.norm_eps}
    return {"d_model": cfg.d_model, "d_state": cfg.d_state, "expand": cfg.expand, "headdim": cfg.headdim,
            "ngroups": cfg.ngroups, "n_layers": cfg.n_layers, "input_dim": cfg.input_dim,
            "rope_fraction": cfg.rope_fraction, "a_floor": cfg.A_floor, "mamba_version": 3}


def save_mamba_rs(path, params, cfg) -> None:
    """Writes a Mamba-1 or Mamba-3 backbone's float32 params as a mamba-rs safetensors file."""
    if not isinstance(cfg, (Mamba1Config, Mamba3Config)):
        raise TypeError(f"cfg must be a Mamba1Config or Mamba3Config, got {type(cfg).__name__}")
    if cfg.input_dim is None:
        raise ValueError("mamba-rs backbones always have an input projection: cfg.input_dim must be set")
    if isinstance(cfg, Mamba1Config) and cfg.resolved_dt_rank != math.ceil(cfg.d_model / 16):
        raise ValueError(f"mamba-rs fixes dt_rank = ceil(d_model/16) = {math.ceil(cfg.d_model / 16)}, "
                         f"got {cfg.resolved_dt_rank}")
    flat = flatten_params(params)
    out = {}
    for rs, ours, transpose in _key_map(cfg):
        if ours not in flat:
            if ours.endswith("conv1d.bias") and not cfg.conv_bias:
                out[rs] = np.zeros((cfg.d_inner,), np.float32)
                continue
            if rs.endswith("norm_gate.weight") and not cfg.is_outproj_norm:
                out[rs] = np.ones((cfg.d_inner,), np.float32)     # mamba-rs always allocates it
                continue
            raise ValueError(f"params have no {ours!r} (is this a backbone for {cfg}?)")
        a = np.asarray(flat[ours], np.float32)
        out[rs] = np.ascontiguousarray(a.T if transpose else a)
    meta = _rs_metadata(cfg)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(out, tmp, metadata={"config": json.dumps(meta)})
    os.replace(tmp, path)


def load_mamba_rs(path, *, is_outproj_norm: bool = False):
    """Reads a mamba-rs Mamba-1 or Mamba-3 safetensors file.

    Args:
      path: the .safetensors file.
      is_outproj_norm: Mamba-3 only (mamba-rs does not store it): use the stored `norm_gate.weight`
        as the gated output norm; False ignores it.

    Returns:
      (params as a nested dict for `nnx.replace_by_pure_dict`, config). A Mamba-1 config has
      `conv_bias=True` (mamba-rs always stores one); both have `rescale_out_proj=False`.
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
    version = rs.get("mamba_version", 1)
    if version not in (1, 3):
        raise ValueError(f"{path}: mamba_version {version!r} files are not supported")
    cfg, shapes = (_mamba1_from_rs(path, rs) if version == 1 else _mamba3_from_rs(path, rs, is_outproj_norm))
    flat = {}
    expected = _key_map(cfg)
    for rs_key, ours, transpose in expected:
        if rs_key not in tensors:
            raise ValueError(f"{path}: missing tensor {rs_key!r}")
        want = shapes.get(rs_key) or shapes[rs_key.split(".", 2)[2]]
        a = np.asarray(tensors[rs_key])
        if a.shape != want:
            raise ValueError(f"{path}: tensor {rs_key!r} must have shape {want}, got {a.shape}")
        if a.dtype != np.float32:
            raise ValueError(f"{path}: tensor {rs_key!r} must be float32 (mamba-rs files are f32), got {a.dtype}")
        if rs_key.endswith("norm_gate.weight") and not is_outproj_norm:
            continue
        flat[ours] = np.ascontiguousarray(a.T if transpose else a)
    unexpected = sorted(set(tensors) - {k for k, _, _ in expected})
    if unexpected:
        raise ValueError(f"{path}: unexpected tensors {unexpected[:8]}")
    return unflatten_params(flat), cfg


def _require(path, rs, keys):
    missing = [k for k in keys if k not in rs]
    if missing:
        raise ValueError(f"{path}: config metadata lacks {missing}")


def _mamba1_from_rs(path, rs):
    _require(path, rs, ("d_model", "d_state", "d_conv", "expand", "n_layers", "input_dim"))
    cfg = Mamba1Config(d_model=rs["d_model"], n_layers=rs["n_layers"], d_state=rs["d_state"], d_conv=rs["d_conv"],
                       expand=rs["expand"], input_dim=rs["input_dim"], norm_eps=rs.get("rms_norm_eps", 1e-5),
                       rescale_out_proj=False).validate()
    E, N, K, R, D = cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.resolved_dt_rank, cfg.d_model
    return cfg, {"input_proj.weight": (cfg.input_dim, D), "input_proj.bias": (D,), "norm_f.weight": (D,),
                 "norm.weight": (D,), "in_proj.weight": (D, 2 * E), "conv1d.weight": (E, K), "conv1d.bias": (E,),
                 "x_proj.weight": (E, R + 2 * N), "dt_proj.weight": (R, E), "dt_proj.bias": (E,),
                 "a_log": (E, N), "D": (E,), "out_proj.weight": (E, D)}


def _mamba3_from_rs(path, rs, is_outproj_norm):
    _require(path, rs, ("d_model", "d_state", "expand", "headdim", "ngroups", "n_layers", "input_dim",
                        "rope_fraction", "a_floor"))
    cfg = Mamba3Config(d_model=rs["d_model"], n_layers=rs["n_layers"], d_state=rs["d_state"], expand=rs["expand"],
                       headdim=rs["headdim"], ngroups=rs["ngroups"], rope_fraction=rs["rope_fraction"],
                       input_dim=rs["input_dim"], A_floor=rs["a_floor"], is_outproj_norm=bool(is_outproj_norm),
                       rescale_out_proj=False).validate()
    D, N, H, Di = cfg.d_model, cfg.d_state, cfg.nheads, cfg.d_inner
    return cfg, {"input_proj.weight": (cfg.input_dim, D), "input_proj.bias": (D,), "norm_f.weight": (D,),
                 "norm.weight": (D,), "in_proj.weight": (D, cfg.in_proj_dim), "dt_bias": (H,), "b_bias": (H, N),
                 "c_bias": (H, N), "b_norm.weight": (N,), "c_norm.weight": (N,), "D": (H,),
                 "norm_gate.weight": (Di,), "out_proj.weight": (Di, D)}
