"""mamba-rs native safetensors files: layout checked against the numpy model, round trip, bad files."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import numpy_mamba1 as npm
import numpy_mamba3 as npm3
from helpers import assert_close, perturbed
from jmamba import Mamba1Backbone, Mamba1Config, Mamba3Backbone, Mamba3Config
from jmamba.interop.mamba_rs import load_mamba_rs, save_mamba_rs

CFG = Mamba1Config(d_model=16, n_layers=2, d_state=4, d_conv=3, input_dim=5)


def rs_file(tmp_path, cfg=CFG):
    model = Mamba1Backbone(cfg, rngs=nnx.Rngs(0))
    path = os.path.join(tmp_path, "rs.safetensors")
    save_mamba_rs(path, nnx.state(model, nnx.Param), cfg)
    return model, path


def test_written_file_has_mamba_rs_names_layouts_and_metadata(tmp_path):
    model, path = rs_file(tmp_path)
    t = load_file(path)
    with safe_open(path, framework="numpy") as f:
        meta = json.loads(f.metadata()["config"])
    assert meta == {"d_model": 16, "d_state": 4, "d_conv": 3, "expand": 2, "n_layers": 2, "input_dim": 5,
                    "scan_mode": "Auto", "rms_norm_eps": 1e-5}
    assert t["layers.1.conv1d.weight"].shape == (32, 3) and t["layers.0.a_log"].shape == (32, 4)
    assert t["input_proj.weight"].shape == (5, 16) and t["layers.0.in_proj.weight"].shape == (16, 64)
    # the numpy model, fed straight from the mamba-rs tensors (its own layouts), gives the jmamba output
    p = {"input_proj": {"kernel": t["input_proj.weight"], "bias": t["input_proj.bias"]},
         "norm_f": {"weight": t["norm_f.weight"]}, "layers": {}}
    for i in range(2):
        g = lambda k: t[f"layers.{i}.{k}"]
        p["layers"][i] = {"norm": {"weight": g("norm.weight")}, "mixer": {
            "in_proj": {"kernel": g("in_proj.weight")}, "conv1d": {"kernel": g("conv1d.weight").T, "bias": g("conv1d.bias")},
            "x_proj": {"kernel": g("x_proj.weight")}, "dt_proj": {"kernel": g("dt_proj.weight"), "bias": g("dt_proj.bias")},
            "A_log": g("a_log"), "D": g("D"), "out_proj": {"kernel": g("out_proj.weight")}}}
    x = np.random.default_rng(0).normal(size=(2, 7, 5)).astype(np.float32)
    y, _ = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x))
    want, _ = npm.backbone_forward(p, x, CFG)
    assert_close("y", y, want, 1e-5)


def test_round_trip(tmp_path):
    model, path = rs_file(tmp_path)
    params, cfg = load_mamba_rs(path)
    assert cfg.d_model == 16 and cfg.input_dim == 5 and cfg.d_conv == 3
    other = Mamba1Backbone(cfg, rngs=nnx.Rngs(9))
    st = nnx.state(other, nnx.Param)
    nnx.replace_by_pure_dict(st, params)
    for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(a, b)


def test_write_refusals(tmp_path):
    lm_cfg = Mamba1Config(d_model=16, n_layers=1, d_state=4)
    with pytest.raises(ValueError, match="input_dim"):
        save_mamba_rs(os.path.join(tmp_path, "a"), nnx.state(Mamba1Backbone(lm_cfg, rngs=nnx.Rngs(0)), nnx.Param), lm_cfg)
    cfg = Mamba1Config(d_model=16, n_layers=1, d_state=4, input_dim=3, dt_rank=3)
    with pytest.raises(ValueError, match="dt_rank"):
        save_mamba_rs(os.path.join(tmp_path, "b"), nnx.state(Mamba1Backbone(cfg, rngs=nnx.Rngs(0)), nnx.Param), cfg)


def rewrite(path, fn, meta_fn=None):
    t = dict(load_file(path))
    with safe_open(path, framework="numpy") as f:
        meta = dict(f.metadata())
    fn(t)
    if meta_fn:
        meta_fn(meta)
    save_file(t, path, metadata=meta)


@pytest.mark.parametrize("mutate,match", [
    (lambda p: rewrite(p, lambda t: t.pop("layers.1.a_log")), "missing tensor 'layers.1.a_log'"),
    (lambda p: rewrite(p, lambda t: t.update(junk=np.zeros(2, np.float32))), "unexpected tensors"),
    (lambda p: rewrite(p, lambda t: t.update({"layers.0.conv1d.weight": np.zeros((3, 32), np.float32)})),
     r"conv1d.weight' must have shape \(32, 3\)"),
    (lambda p: rewrite(p, lambda t: t.update({"layers.0.D": np.zeros(32, np.float16)})), "float32"),
    (lambda p: rewrite(p, lambda t: None, lambda m: m.pop("config")), "no 'config' metadata"),
    (lambda p: rewrite(p, lambda t: None, lambda m: m.update(config=json.dumps({"mamba_version": 7}))), "mamba_version 7"),
    (lambda p: rewrite(p, lambda t: None, lambda m: m.update(config=json.dumps({"mamba_version": 3, "d_model": 16}))),
     "config metadata lacks"),
    (lambda p: open(p, "wb").write(b"\x00" * 3), "not a readable safetensors"),
])
def test_bad_files(tmp_path, mutate, match):
    _, path = rs_file(tmp_path)
    mutate(path)
    with pytest.raises(ValueError, match=match):
        load_mamba_rs(path)


# --------------------------------------------------------------------------------------- Mamba-3
CFG3 = Mamba3Config(d_model=16, n_layers=2, d_state=8, headdim=8, ngroups=2, input_dim=5)


@pytest.mark.parametrize("outproj_norm", [False, True])
def test_mamba3_file_layout_checked_against_numpy_and_round_trip(tmp_path, outproj_norm):
    import dataclasses
    cfg = dataclasses.replace(CFG3, is_outproj_norm=outproj_norm)
    model = perturbed(Mamba3Backbone(cfg, rngs=nnx.Rngs(0)), scale=0.1)
    path = os.path.join(tmp_path, "rs3.safetensors")
    save_mamba_rs(path, nnx.state(model, nnx.Param), cfg)
    t = load_file(path)
    with safe_open(path, framework="numpy") as f:
        meta = json.loads(f.metadata()["config"])
    assert meta["mamba_version"] == 3 and meta["headdim"] == 8 and meta["ngroups"] == 2
    assert t["layers.0.b_bias"].shape == (4, 8) and t["layers.1.norm_gate.weight"].shape == (32,)
    if not outproj_norm:
        np.testing.assert_array_equal(t["layers.0.norm_gate.weight"], 1.0)
    # numpy model straight from the mamba-rs tensors: official state_dict = transposed [in, out] linears
    x = np.random.default_rng(0).normal(size=(2, 7, 5))
    h = x @ t["input_proj.weight"] + t["input_proj.bias"]
    kw = dict(d_model=16, d_state=8, expand=2, headdim=8, ngroups=2, rope_fraction=0.5, A_floor=cfg.A_floor,
              is_outproj_norm=outproj_norm)
    for i in range(2):
        g = lambda k: np.asarray(t[f"layers.{i}.{k}"], np.float64)
        sd = {"in_proj.weight": g("in_proj.weight").T, "dt_bias": g("dt_bias"), "B_bias": g("b_bias")[:, None],
              "C_bias": g("c_bias")[:, None], "B_norm.weight": g("b_norm.weight"), "C_norm.weight": g("c_norm.weight"),
              "D": g("D"), "out_proj.weight": g("out_proj.weight").T, "norm.weight": g("norm_gate.weight")}
        out, _ = npm3.mixer_forward(sd, npm3.rmsnorm(h, g("norm.weight"), 1e-5), kw)
        h = h + out
    want = npm3.rmsnorm(h, t["norm_f.weight"], 1e-5)
    y, _ = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x, jnp.float32))
    assert_close("y", y, want, 2e-5)
    params, cfg2 = load_mamba_rs(path, is_outproj_norm=outproj_norm)
    assert cfg2 == dataclasses.replace(cfg, rescale_out_proj=False) and cfg2.chunk_size is None
    st = nnx.state(Mamba3Backbone(cfg2, rngs=nnx.Rngs(5)), nnx.Param)
    nnx.replace_by_pure_dict(st, params)
    for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(a, b)
