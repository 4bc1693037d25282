"""Official `mamba_ssm.modules.mamba3.Mamba3` (SISO) weights <-> `jmamba.Mamba3Mixer`.

A checkpoint directory holds `model.safetensors` (the module's `state_dict`: official names,
torch layouts, any float dtype) and `config.json` (the module's constructor kwargs). The mapping
(docs/mamba3_siso.md §2.1, §2.5):

    official key       official shape      jmamba nnx path      jmamba shape
    in_proj.weight     (in_proj_dim, Dm)   in_proj.kernel       [Dm, in_proj_dim]   (transposed)
    dt_bias            (H)                 dt_bias              [H]
    B_bias, C_bias     (H, 1, N)           B_bias, C_bias       [H, N]              (mimo_rank axis dropped)
    B_norm.weight      (N)                 B_norm.weight        [N]
    C_norm.weight      (N)                 C_norm.weight        [N]
    D                  (H)                 D                    [H]
    norm.weight        (Di)                norm.weight          [Di]                (is_outproj_norm only)
    out_proj.weight    (Dm, Di)            out_proj.kernel      [Di, Dm]            (transposed)

Weights are converted to float32 masters. The mixer computes the official forward math
(docs/mamba3_siso.md §3.2; rows 11-15 of §5 are shared with mamba-rs). Where the official module and mamba-rs differ
(§5), this follows the official module and says so:
  * names/layouts (#7, #8): official only; a `norm.weight` is required exactly when
    is_outproj_norm (mamba-rs always stores `norm_gate.weight`). `strict=False` tolerates extra keys.
  * numerics (#16): the official Triton kernels round Q/K/V/Z, the accumulated angle and the
    output to bf16 even in an fp32 module; jmamba keeps all of these in the compute dtype / f32
    (docs/mamba3_siso.md §8), so outputs agree with the official module to ≈3.5e-3 relative
    (docs/mamba3_siso.md §6.3), not bit-for-bit.
  * decode (#19): the official module step does not wrap θ mod 2π; jmamba wraps (same math).
  * cross-window state (#17): `Mamba3Mixer.__call__` takes and returns the four states with
    full gradients (the official kernel's semantics); the backbone truncates by default.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jmamba.core.files import read_json
from jmamba.mamba3.config import Mamba3Config
from jmamba.mamba3.mixer import Mamba3Mixer

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Constructor kwargs that map onto Mamba3Config fields (official name -> jmamba field).
CONFIG_FIELDS = {"d_model": "d_model", "d_state": "d_state", "expand": "expand", "headdim": "headdim",
                 "ngroups": "ngroups", "rope_fraction": "rope_fraction", "A_floor": "A_floor",
                 "is_outproj_norm": "is_outproj_norm", "dt_min": "dt_min",
                 "dt_max": "dt_max", "dt_init_floor": "dt_init_floor"}
# Kwargs the official constructor absorbs without effect on a SISO forward (chunk_size is a kernel
# tuning knob: jmamba.ops.tuning, not model config).
ABSORBED = ("dropout", "layer_idx", "n_layer", "device", "dtype", "mimo_rank", "chunk_size")


def config_from_official(kwargs: dict) -> Mamba3Config:
    """Official `Mamba3(**kwargs)` constructor kwargs -> a validated `Mamba3Config` (one layer)."""
    if not isinstance(kwargs, dict):
        raise TypeError(f"config must be a JSON object of Mamba3 constructor kwargs, got {type(kwargs).__name__}")
    if "d_model" not in kwargs:
        raise ValueError("config: missing required Mamba3 kwarg 'd_model'")
    unknown = sorted(set(kwargs) - set(CONFIG_FIELDS) - set(ABSORBED) - {"is_mimo"})
    if unknown:
        raise ValueError(f"config: unknown Mamba3 kwargs {unknown}")
    if kwargs.get("is_mimo", False):
        raise ValueError("config: is_mimo=True (MIMO Mamba-3) is not supported; only SISO checkpoints load")
    fields = {CONFIG_FIELDS[k]: v for k, v in kwargs.items() if k in CONFIG_FIELDS}
    expand = fields.get("expand", 2)
    if isinstance(expand, float) and expand.is_integer():
        fields["expand"] = int(expand)       # the official module takes int(expand·d_model)
    if isinstance(fields.get("rope_fraction"), int) and not isinstance(fields.get("rope_fraction"), bool):
        fields["rope_fraction"] = float(fields["rope_fraction"])
    n_layer = kwargs.get("n_layer")
    n_layers = n_layer if isinstance(n_layer, int) and not isinstance(n_layer, bool) and n_layer > 0 else 1
    try:
        return Mamba3Config(n_layers=n_layers, **fields).validate()
    except (TypeError, ValueError) as e:
        raise ValueError(f"config: {e}") from None


def official_kwargs(cfg: Mamba3Config) -> dict:
    """The official constructor kwargs of a `Mamba3Config` (what `config.json` holds)."""
    return {k: getattr(cfg, f) for k, f in CONFIG_FIELDS.items()}


def official_shapes(cfg: Mamba3Config) -> dict[str, tuple]:
    """Expected official state_dict: key -> torch shape."""
    Dm, Di, H, N = cfg.d_model, cfg.d_inner, cfg.nheads, cfg.d_state
    shapes = {"in_proj.weight": (cfg.in_proj_dim, Dm), "dt_bias": (H,), "B_bias": (H, 1, N), "C_bias": (H, 1, N),
              "B_norm.weight": (N,), "C_norm.weight": (N,), "D": (H,), "out_proj.weight": (Dm, Di)}
    if cfg.is_outproj_norm:
        shapes["norm.weight"] = (Di,)
    return shapes


def params_from_official(state_dict: dict, cfg: Mamba3Config, *, strict: bool = True) -> dict:
    """Official state_dict (name -> array) -> jmamba mixer params (nested dict of float32 numpy).

    Every problem (missing, unexpected with strict, mis-shaped, non-float) is collected and raised
    as one ValueError, so nothing is ever half-converted.
    """
    want = official_shapes(cfg)
    problems = [f"missing key {k!r} (expected shape {s})" for k, s in want.items() if k not in state_dict]
    if strict:
        problems += [f"unexpected key {k!r}" for k in sorted(set(state_dict) - set(want))]
    for k, s in want.items():
        if k in state_dict:
            a = state_dict[k]
            if tuple(np.shape(a)) != s:
                problems.append(f"{k!r} has shape {tuple(np.shape(a))}, expected {s}")
            elif not jnp.issubdtype(jnp.result_type(a), jnp.floating):
                problems.append(f"{k!r} has dtype {jnp.result_type(a)}, expected a float dtype")
    if problems:
        raise ValueError("official Mamba3 state_dict does not match the config: " + "; ".join(problems))
    sd = {k: np.asarray(jnp.asarray(state_dict[k]).astype(jnp.float32)) for k in want}
    params = {"in_proj": {"kernel": np.ascontiguousarray(sd["in_proj.weight"].T)},
              "dt_bias": sd["dt_bias"], "B_bias": sd["B_bias"][:, 0, :], "C_bias": sd["C_bias"][:, 0, :],
              "B_norm": {"weight": sd["B_norm.weight"]}, "C_norm": {"weight": sd["C_norm.weight"]},
              "D": sd["D"], "out_proj": {"kernel": np.ascontiguousarray(sd["out_proj.weight"].T)}}
    if cfg.is_outproj_norm:
        params["norm"] = {"weight": sd["norm.weight"]}
    return params


def official_state_dict(mixer: Mamba3Mixer) -> dict[str, np.ndarray]:
    """A `Mamba3Mixer`'s parameters under official names and torch layouts (float32)."""
    if not isinstance(mixer, Mamba3Mixer):
        raise TypeError(f"mixer must be a Mamba3Mixer, got {type(mixer).__name__}")
    p = nnx.to_pure_dict(nnx.state(mixer, nnx.Param))
    a = lambda x: np.asarray(x, np.float32)
    sd = {"in_proj.weight": a(p["in_proj"]["kernel"]).T, "dt_bias": a(p["dt_bias"]),
          "B_bias": a(p["B_bias"])[:, None, :], "C_bias": a(p["C_bias"])[:, None, :],
          "B_norm.weight": a(p["B_norm"]["weight"]), "C_norm.weight": a(p["C_norm"]["weight"]),
          "D": a(p["D"]), "out_proj.weight": a(p["out_proj"]["kernel"]).T}
    if mixer.config.is_outproj_norm:
        sd["norm.weight"] = a(p["norm"]["weight"])
    return {k: np.ascontiguousarray(v) for k, v in sd.items()}


def read_official_dir(path, what: str, *, prefix: str = ""):
    """(config.json as a dict, {key without `prefix`: numpy array} of model.safetensors) of an official
    checkpoint directory; FileNotFoundError / ValueError naming the file."""
    path = os.fspath(path)
    cfg_path, w_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for p in (cfg_path, w_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{what} is missing {p}")
    conf = read_json(cfg_path)
    with safe_open(w_path, framework="numpy") as f:
        tensors = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    return conf, tensors


def load_official_mamba3(path, *, prefix: str = "", strict: bool = True) -> Mamba3Mixer:
    """Loads an official Mamba3 SISO checkpoint directory into a `Mamba3Mixer`.

    Args:
      path: directory with `model.safetensors` and `config.json` (constructor kwargs).
      prefix: key prefix of the mixer inside the file, e.g. "backbone.layers.3.mixer." for one
        layer of a full model (only keys under it are read).
      strict: reject keys (under `prefix`) that the mixer does not use.

    Returns:
      A `Mamba3Mixer` (float32 parameters) computing the official forward.
    """
    kwargs, state_dict = read_official_dir(path, "official Mamba3 checkpoint", prefix=prefix)
    cfg = config_from_official(kwargs)
    params = params_from_official(state_dict, cfg, strict=strict)
    mixer = Mamba3Mixer(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(mixer, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(mixer, state)
    return mixer


def save_official_mamba3(path, mixer: Mamba3Mixer) -> None:
    """Writes `mixer` as an official checkpoint directory (`model.safetensors` + `config.json`)."""
    sd = official_state_dict(mixer)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    kwargs = official_kwargs(mixer.config)
    tmp = os.path.join(path, f".{WEIGHTS_FILE}.tmp-{os.getpid()}")
    save_file(sd, tmp)
    os.replace(tmp, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(kwargs, f, indent=2, sort_keys=True)
