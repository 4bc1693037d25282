"""Mamba3Config: official defaults, derived sizes (spec examples), validate() errors naming the field;
the parameter naming contract and the official init rules of Mamba3Mixer / Mamba3Backbone."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx

from jmamba import Mamba3Backbone, Mamba3Config, Mamba3Mixer, MambaLM
from jmamba.configs import config_from_json, config_to_json


def test_official_defaults():
    cfg = Mamba3Config()
    assert (cfg.d_state, cfg.headdim, cfg.expand, cfg.ngroups, cfg.rope_fraction) == (128, 64, 2, 1, 0.5)
    assert (cfg.A_floor, cfg.is_outproj_norm, cfg.norm_eps) == (1e-4, False, 1e-5)
    assert cfg.chunk_size is None, "the chunk length is a tuning knob of the scan op, not model config"
    assert (cfg.dt_min, cfg.dt_max, cfg.dt_init_floor) == (1e-3, 0.1, 1e-4)
    assert cfg.input_dim is None and cfg.rescale_out_proj is True and cfg.arch == "mamba3"
    assert cfg.backbone_input_dim == cfg.d_model and Mamba3Config(input_dim=7).backbone_input_dim == 7


@pytest.mark.parametrize("kwargs,sizes", [
    # spec §1 "Examples": official defaults with Dm=768, and the mamba-rs default config
    (dict(d_model=768), (1536, 24, 32, 3432)),
    (dict(d_model=128, d_state=16, headdim=16), (256, 16, 4, 596)),
    # rope_fraction 1.0 rotates all N dims; an odd d_state·rf split loses one dim (official rule)
    (dict(d_model=64, d_state=16, headdim=16, rope_fraction=1.0, ngroups=2), (128, 8, 8, 2 * 128 + 2 * 2 * 16 + 24 + 8)),
    (dict(d_model=8, d_state=6, headdim=4), (16, 4, 1, 32 + 12 + 12 + 1)),
])
def test_derived_sizes(kwargs, sizes):
    cfg = Mamba3Config(**kwargs).validate()
    assert (cfg.d_inner, cfg.nheads, cfg.num_rope_angles, cfg.in_proj_dim) == sizes


@pytest.mark.parametrize("field,value", [
    ("d_model", 0), ("d_model", 2.5), ("d_model", True), ("n_layers", 0), ("d_state", 0), ("d_state", 7),
    ("expand", 0), ("headdim", 0), ("headdim", 5), ("ngroups", 0), ("ngroups", 5), ("ngroups", 3),
    ("rope_fraction", 0.25), ("rope_fraction", True), ("input_dim", 0),
    ("norm_eps", 0.0), ("norm_eps", float("nan")), ("dt_min", -1e-3), ("dt_max", 0.0), ("dt_init_floor", -1.0),
    ("A_floor", -1e-4), ("A_floor", float("inf")), ("is_outproj_norm", 1), ("rescale_out_proj", "yes"),
])
def test_validate_names_the_bad_field(field, value):
    base = dict(d_model=16, d_state=8, headdim=8, expand=2)    # nheads = 4
    with pytest.raises(ValueError, match=field):
        Mamba3Config(**{**base, field: value}).validate()


@pytest.mark.parametrize("value", [0, 16.0])
def test_validate_names_a_bad_deprecated_chunk_size(value):
    with pytest.warns(DeprecationWarning, match="chunk_size"):
        cfg = Mamba3Config(d_model=16, d_state=8, headdim=8, chunk_size=value)
    with pytest.raises(ValueError, match="chunk_size"):
        cfg.validate()


def test_cross_field_constraints():
    with pytest.raises(ValueError, match="dt_min"):
        Mamba3Config(dt_min=0.2, dt_max=0.1).validate()
    with pytest.raises(ValueError, match="d_state .* too small"):
        Mamba3Config(d_model=16, headdim=8, d_state=2).validate()      # 2·0.5 = 1 dim: no angle
    Mamba3Config(d_model=16, headdim=8, d_state=2, rope_fraction=1.0).validate()


def test_modules_refuse_an_invalid_config():
    with pytest.raises(ValueError, match="headdim"):
        Mamba3Mixer(Mamba3Config(d_model=8, headdim=5), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="ngroups"):
        Mamba3Backbone(Mamba3Config(d_model=8, headdim=4, d_state=8, ngroups=3), rngs=nnx.Rngs(0))


def test_config_json_round_trip_and_lm():
    cfg = Mamba3Config(d_model=8, n_layers=2, d_state=8, headdim=4, ngroups=2, rope_fraction=1.0,
                       is_outproj_norm=True)
    assert config_from_json(config_to_json(cfg)) == cfg
    assert "chunk_size" not in json.loads(config_to_json(cfg))
    lm = MambaLM(cfg, vocab_size=11, rngs=nnx.Rngs(0))
    assert isinstance(lm.backbone, Mamba3Backbone)


def _paths(module):
    flat = nnx.to_flat_state(nnx.state(module, nnx.Param))
    return {".".join(map(str, path)): (tuple(v.shape), v.dtype) for path, v in flat}


@pytest.mark.parametrize("norm", [False, True], ids=["gate", "outproj_norm"])
def test_parameter_naming_contract(norm):
    """The exact nnx paths and shapes other code (weight-decay masks, interop) is written against."""
    cfg = Mamba3Config(d_model=8, n_layers=2, d_state=6, headdim=4, ngroups=2, input_dim=3, is_outproj_norm=norm)
    Dm, Di, H, N = 8, 16, 4, 6
    mixer = {"in_proj.kernel": (Dm, cfg.in_proj_dim), "dt_bias": (H,), "B_bias": (H, N), "C_bias": (H, N),
             "B_norm.weight": (N,), "C_norm.weight": (N,), "D": (H,), "out_proj.kernel": (Di, Dm)}
    if norm:
        mixer["norm.weight"] = (Di,)
    want = {"input_proj.kernel": (3, Dm), "input_proj.bias": (Dm,), "norm_f.weight": (Dm,)}
    for i in range(2):
        want[f"layers.{i}.norm.weight"] = (Dm,)
        want.update({f"layers.{i}.mixer.{k}": s for k, s in mixer.items()})
    got = _paths(Mamba3Backbone(cfg, rngs=nnx.Rngs(0)))
    assert {k: s for k, (s, _) in got.items()} == want
    assert all(dt == np.float32 for _, dt in got.values())


def test_official_init_rules():
    cfg = Mamba3Config(d_model=64, n_layers=4, d_state=16, headdim=16, dt_min=1e-3, dt_max=0.1)
    m = Mamba3Mixer(cfg, rngs=nnx.Rngs(0))
    H, N, Di = cfg.nheads, cfg.d_state, cfg.d_inner
    w_in = np.asarray(m.in_proj.kernel[...])
    bound_in = 1 / math.sqrt(cfg.d_model)                           # torch Linear default
    assert np.abs(w_in).max() <= bound_in and np.abs(w_in).max() > 0.95 * bound_in
    w_out = np.asarray(m.out_proj.kernel[...])
    bound_out = 1 / math.sqrt(Di) / math.sqrt(cfg.n_layers)         # rescale_prenorm_residual, n_res = 1
    assert np.abs(w_out).max() <= bound_out and np.abs(w_out).max() > 0.9 * bound_out
    dt = np.log1p(np.exp(np.asarray(m.dt_bias[...], np.float64)))    # softplus(dt_bias) = initial dt
    assert dt.shape == (H,) and dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert len(np.unique(dt)) == H
    for name in ("B_bias", "C_bias", "D"):
        np.testing.assert_array_equal(getattr(m, name)[...], 1.0)
    for norm in (m.B_norm, m.C_norm):
        np.testing.assert_array_equal(norm.weight[...], 1.0)
    assert m.norm is None
    unscaled = Mamba3Mixer(Mamba3Config(d_model=64, n_layers=4, d_state=16, headdim=16, rescale_out_proj=False),
                           rngs=nnx.Rngs(0))
    assert np.abs(np.asarray(unscaled.out_proj.kernel[...])).max() > 0.9 / math.sqrt(Di)


def test_state_layout():
    cfg = Mamba3Config(d_model=8, n_layers=2, d_state=8, headdim=4, ngroups=2)
    state = Mamba3Backbone(cfg, rngs=nnx.Rngs(0)).init_state(3)
    assert len(state) == 2 and state[0]._fields == ("angle", "ssm", "k", "v")
    assert [tuple(a.shape) for a in state[0]] == [(3, 4, 2), (3, 4, 4, 8), (3, 4, 8), (3, 4, 4)]
    assert all(a.dtype == np.float32 and not np.any(np.asarray(a)) for a in jax.tree.leaves(state))
