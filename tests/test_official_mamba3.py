"""load_official_mamba3: an official-layout checkpoint (names, torch [out, in] layouts, (H, 1, N)
biases) reproduces the numpy model run on those same tensors; the name/shape mapping round-trips
through the writer; bad checkpoints give one clear error listing every problem."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.flax import save_file as save_flax
from safetensors.numpy import save_file

import numpy_mamba3 as npm
from helpers import assert_close
from jmamba import Mamba3Mixer, load_official_mamba3
from jmamba.interop.official_mamba3 import official_state_dict, save_official_mamba3

GATE = dict(d_model=8, d_state=8, expand=2, headdim=4, ngroups=2, rope_fraction=0.5, A_floor=0.3,
            is_outproj_norm=False, chunk_size=4)
NORM = dict(d_model=8, d_state=6, expand=2, headdim=4, ngroups=1, rope_fraction=1.0, A_floor=1e-4,
            is_outproj_norm=True, chunk_size=16)


def official_tensors(kw, seed=0):
    """Random tensors with the official Mamba3 state_dict names and torch shapes (per-head biases differ)."""
    r = np.random.default_rng(seed)
    Dm, N, G, P = kw["d_model"], kw["d_state"], kw["ngroups"], kw["headdim"]
    Di = kw["expand"] * Dm
    H = Di // P
    S = npm.num_rope_angles(N, kw["rope_fraction"])
    sd = {"in_proj.weight": r.normal(size=(2 * Di + 2 * G * N + 3 * H + S, Dm)) * 0.5,
          "dt_bias": r.normal(size=(H,)) - 2.0, "B_bias": 1 + 0.5 * r.normal(size=(H, 1, N)),
          "C_bias": 1 + 0.5 * r.normal(size=(H, 1, N)), "B_norm.weight": 1 + 0.3 * r.normal(size=(N,)),
          "C_norm.weight": 1 + 0.3 * r.normal(size=(N,)), "D": 1 + 0.5 * r.normal(size=(H,)),
          "out_proj.weight": r.normal(size=(Dm, Di)) / np.sqrt(Di)}
    if kw["is_outproj_norm"]:
        sd["norm.weight"] = 1 + 0.3 * r.normal(size=(Di,))
    return {k: v.astype(np.float32) for k, v in sd.items()}


def write_checkpoint(path, sd, kw, *, bf16=False):
    os.makedirs(path, exist_ok=True)
    if bf16:
        save_flax({k: jnp.asarray(v, jnp.bfloat16) for k, v in sd.items()}, os.path.join(path, "model.safetensors"))
    else:
        save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(kw, f)
    return path


_FORWARD = nnx.jit(lambda m, u: m(u))


@pytest.mark.parametrize("kw,bf16", [(GATE, False), (NORM, True)], ids=["gate-groups-Afloor", "outproj_norm-fullrope-bf16file"])
def test_loaded_checkpoint_reproduces_the_numpy_model(tmp_path, kw, bf16):
    sd = official_tensors(kw)
    extra = dict(kw, dt_min=0.001, dt_max=0.1, dt_init_floor=1e-4, is_mimo=False, mimo_rank=4, layer_idx=3,
                 dropout=0.0)   # what a dump of the constructor kwargs may also hold
    mixer = load_official_mamba3(write_checkpoint(tmp_path, sd, extra, bf16=bf16))
    # chunk_size is the official module's kernel knob: absorbed (jmamba's is a tuning setting of the op)
    assert isinstance(mixer, Mamba3Mixer) and mixer.config.chunk_size is None
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(nnx.state(mixer, nnx.Param)))
    if bf16:   # the numpy model sees exactly what the file holds
        sd = {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)) for k, v in sd.items()}
    u = np.random.default_rng(1).normal(size=(2, 11, kw["d_model"])).astype(np.float32)
    y, state = _FORWARD(mixer, jnp.asarray(u))
    want_y, want_state = npm.mixer_forward(sd, u, kw)
    assert_close("mixer output", y, want_y, 2e-5)
    for field, got, want in zip(state._fields, state, want_state):
        assert_close(f"final {field} state", got, want, 2e-5)
    if kw["A_floor"] > 0.1:    # the A_floor clamp is active for part of the inputs (so it is tested)
        H, S = 4, 2
        dd_A = (u @ sd["in_proj.weight"].T)[..., -2 * H - S:-H - S]      # [.., dd_dt, dd_A, trap, angles]
        frac = np.mean(npm.heavy_tail(dd_A) < kw["A_floor"])
        assert 0.02 < frac < 0.98, frac


def test_mapping_round_trips_through_the_writer(tmp_path):
    sd = official_tensors(NORM, seed=3)
    mixer = load_official_mamba3(write_checkpoint(tmp_path / "a", sd, NORM))
    back = official_state_dict(mixer)
    assert set(back) == set(sd)
    for k in sd:
        assert back[k].shape == sd[k].shape, k
        np.testing.assert_array_equal(back[k], sd[k], err_msg=k)
    # jmamba mixer -> official files -> jmamba mixer: identical parameters and config
    save_official_mamba3(tmp_path / "b", mixer)
    again = load_official_mamba3(tmp_path / "b")
    assert again.config == mixer.config
    for a, b in zip(jax.tree.leaves(nnx.state(again, nnx.Param)), jax.tree.leaves(nnx.state(mixer, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    with open(tmp_path / "b" / "config.json") as f:
        written = json.load(f)
    assert {k: written[k] for k in NORM if k != "chunk_size"} == {k: v for k, v in NORM.items() if k != "chunk_size"}
    assert "chunk_size" not in written


def test_writer_uses_official_names_and_layouts():
    """Independent of the loader: the writer's tensors are the jmamba ones transposed / reshaped."""
    from jmamba import Mamba3Config
    mixer = Mamba3Mixer(Mamba3Config(d_model=8, d_state=8, headdim=4, ngroups=2, n_layers=1), rngs=nnx.Rngs(0))
    sd = official_state_dict(mixer)
    np.testing.assert_array_equal(sd["in_proj.weight"], np.asarray(mixer.in_proj.kernel[...]).T)
    np.testing.assert_array_equal(sd["out_proj.weight"], np.asarray(mixer.out_proj.kernel[...]).T)
    np.testing.assert_array_equal(sd["B_bias"][:, 0], np.asarray(mixer.B_bias[...]))
    assert sd["in_proj.weight"].shape == (mixer.config.in_proj_dim, 8) and sd["C_bias"].shape == (4, 1, 8)
    assert "norm.weight" not in sd


def test_prefix_selects_one_mixer_of_a_full_model_file(tmp_path):
    sd = official_tensors(GATE, seed=5)
    other = official_tensors(GATE, seed=6)
    full = {f"backbone.layers.1.mixer.{k}": v for k, v in sd.items()}
    full.update({f"backbone.layers.0.mixer.{k}": v for k, v in other.items()})
    full["backbone.embedding.weight"] = np.zeros((3, 8), np.float32)
    path = write_checkpoint(tmp_path, full, GATE)
    mixer = load_official_mamba3(path, prefix="backbone.layers.1.mixer.")
    np.testing.assert_array_equal(official_state_dict(mixer)["in_proj.weight"], sd["in_proj.weight"])


# ------------------------------------------------------------------------------------ bad checkpoints
def _drop(sd, key):
    sd = dict(sd)
    del sd[key]
    return sd


@pytest.mark.parametrize("mutate_sd,mutate_kw,err,match", [
    (lambda sd: _drop(sd, "dt_bias"), None, ValueError, "missing key 'dt_bias'"),
    (lambda sd: {**sd, "mimo_x": np.ones(3, np.float32)}, None, ValueError, "unexpected key 'mimo_x'"),
    (lambda sd: {**sd, "B_bias": sd["B_bias"][:, 0]}, None, ValueError, r"'B_bias' has shape \(4, 8\), expected \(4, 1, 8\)"),
    (lambda sd: {**sd, "in_proj.weight": sd["in_proj.weight"].T.copy()}, None, ValueError, "'in_proj.weight' has shape"),
    (lambda sd: {**sd, "D": np.ones(4, np.int32)}, None, ValueError, "'D' has dtype int32"),
    (lambda sd: _drop({**sd, "norm.weight": np.ones(16, np.float32)}, "C_bias"), None, ValueError,
     "missing key 'C_bias'.*unexpected key 'norm.weight'"),     # every problem in one message
    (None, lambda kw: {k: v for k, v in kw.items() if k != "d_model"}, ValueError, "d_model"),
    (None, lambda kw: {**kw, "d_modle": 8}, ValueError, r"unknown Mamba3 kwargs \['d_modle'\]"),
    (None, lambda kw: {**kw, "is_mimo": True}, ValueError, "is_mimo"),
    (None, lambda kw: {**kw, "rope_fraction": 0.25}, ValueError, "rope_fraction"),
    (None, lambda kw: {**kw, "headdim": 3}, ValueError, "headdim"),
    (None, lambda kw: {**kw, "ngroups": 3}, ValueError, "ngroups"),
    (None, lambda kw: {**kw, "d_state": 16}, ValueError, "'B_norm.weight' has shape"),
])
def test_bad_checkpoint_raises_one_clear_error(tmp_path, mutate_sd, mutate_kw, err, match):
    sd = official_tensors(GATE)
    sd = mutate_sd(sd) if mutate_sd else sd
    kw = mutate_kw(GATE) if mutate_kw else GATE
    with pytest.raises(err, match=match):
        load_official_mamba3(write_checkpoint(tmp_path, sd, kw))


def test_missing_files_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_official_mamba3(tmp_path)
    write_checkpoint(tmp_path, official_tensors(GATE), GATE)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_official_mamba3(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_official_mamba3(tmp_path)


def test_non_strict_tolerates_extra_keys(tmp_path):
    sd = {**official_tensors(GATE), "norm_gate.weight": np.ones(16, np.float32)}
    mixer = load_official_mamba3(write_checkpoint(tmp_path, sd, GATE), strict=False)
    assert mixer.norm is None
