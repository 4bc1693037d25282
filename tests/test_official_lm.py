"""The official MambaLMHeadModel with Mamba-3 layers: import a full LM state_dict, check the logits
against an independent float64 numpy model that reads the official names and layouts, export it back."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

import numpy_mamba3 as npm3
import jmamba
from jmamba.interop.official_lm import official_lm_state_dict

KW = dict(d_state=8, expand=2, headdim=4, ngroups=1, rope_fraction=0.5, A_floor=1e-4, is_outproj_norm=False)


def official_model(tie, *, d_model=8, n_layer=2, vocab=13, seed=0, is_outproj_norm=False):
    """(MambaConfig dict, state_dict) of a random official model, built only from the official layouts."""
    r = np.random.default_rng(seed)
    kw = dict(KW, is_outproj_norm=is_outproj_norm)
    N, P, G = kw["d_state"], kw["headdim"], kw["ngroups"]
    Di = kw["expand"] * d_model
    H = Di // P
    S = npm3.num_rope_angles(N, kw["rope_fraction"])
    V = vocab + (-vocab) % 8
    a = lambda *s, scale=0.3: (scale * r.normal(size=s)).astype(np.float32)   # noqa: E731
    sd = {"backbone.embedding.weight": a(V, d_model, scale=0.5), "backbone.norm_f.weight": 1 + a(d_model)}
    for i in range(n_layer):
        pre = f"backbone.layers.{i}."
        sd[pre + "norm.weight"] = 1 + a(d_model)
        sd |= {pre + "mixer.in_proj.weight": a(2 * Di + 2 * G * N + 3 * H + S, d_model),
               pre + "mixer.dt_bias": a(H) - 2.0, pre + "mixer.B_bias": 1 + a(H, 1, N), pre + "mixer.C_bias": 1 + a(H, 1, N),
               pre + "mixer.B_norm.weight": 1 + a(N), pre + "mixer.C_norm.weight": 1 + a(N), pre + "mixer.D": 1 + a(H),
               pre + "mixer.out_proj.weight": a(d_model, Di)}
        if is_outproj_norm:
            sd[pre + "mixer.norm.weight"] = 1 + a(Di)
    if not tie:
        sd["lm_head.weight"] = a(V, d_model)
    conf = {"d_model": d_model, "n_layer": n_layer, "vocab_size": vocab, "d_intermediate": 0,
            "ssm_cfg": {"layer": "Mamba3", **kw}, "rms_norm": True, "residual_in_fp32": True,
            "fused_add_norm": True, "pad_vocab_size_multiple": 8, "tie_embeddings": tie}
    return conf, sd


def numpy_logits(conf, sd, ids):
    """Independent float64 forward of the official model (embedding, pre-norm Mamba3 blocks, head)."""
    kw = dict(conf["ssm_cfg"], d_model=conf["d_model"])
    kw.pop("layer")
    f64 = lambda k: np.asarray(sd[k], np.float64)   # noqa: E731
    h = f64("backbone.embedding.weight")[ids]
    for i in range(conf["n_layer"]):
        pre = f"backbone.layers.{i}."
        mixer = {k[len(pre + "mixer."):]: v for k, v in sd.items() if k.startswith(pre + "mixer.")}
        out, _ = npm3.mixer_forward(mixer, npm3.rmsnorm(h, f64(pre + "norm.weight"), 1e-5), kw)
        h = h + out
    h = npm3.rmsnorm(h, f64("backbone.norm_f.weight"), 1e-5)
    head = f64("backbone.embedding.weight") if conf["tie_embeddings"] else f64("lm_head.weight")
    return h @ head.T


def write(path, conf, sd):
    os.makedirs(path, exist_ok=True)
    json.dump(conf, open(os.path.join(path, "config.json"), "w"))
    save_file(sd, os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("tie, outproj_norm", [(True, False), (False, True)])
def test_official_lm_logits_match_an_independent_reference_and_export_round_trips(tmp_path, tie, outproj_norm):
    conf, sd = official_model(tie, is_outproj_norm=outproj_norm)
    write(tmp_path / "official", conf, sd)
    lm = jmamba.load_official_lm(tmp_path / "official")
    assert lm.config.vocab_size == 16 and lm.config.tie_embeddings == tie
    ids = np.random.default_rng(1).integers(0, 13, (2, 7))
    logits, _ = lm(jnp.asarray(ids, jnp.int32))
    want = numpy_logits(conf, sd, ids)
    err = np.max(np.abs(np.asarray(logits, np.float64) - want)) / np.max(np.abs(want))
    assert err < 2e-5, err
    jmamba.save_official_lm(tmp_path / "export", lm)
    back = official_lm_state_dict(jmamba.load_official_lm(tmp_path / "export"))
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)
    exported = json.load(open(tmp_path / "export" / "config.json"))
    assert exported["ssm_cfg"]["layer"] == "Mamba3" and exported["n_layer"] == 2 and exported["tie_embeddings"] == tie


def test_official_lm_refuses_what_it_cannot_load(tmp_path):
    conf, sd = official_model(True)
    bad_sd = dict(sd)
    bad_sd.pop("backbone.layers.1.norm.weight")
    bad_sd["backbone.layers.0.mixer.D"] = np.zeros(3, np.float32)
    bad_sd["extra"] = np.zeros(1, np.float32)
    write(tmp_path / "a", conf, bad_sd)
    with pytest.raises(ValueError) as e:
        jmamba.load_official_lm(tmp_path / "a")
    msg = str(e.value)
    assert "layers.1.norm.weight" in msg and "'D'" in msg and "'extra'" in msg
    for change, what in (({"ssm_cfg": {"layer": "Mamba1"}}, "Mamba3"), ({"d_intermediate": 4}, "d_intermediate"),
                         ({"rms_norm": False}, "rms_norm"), ({"bogus": 1}, "bogus")):
        write(tmp_path / "b", conf | change, sd)
        with pytest.raises(ValueError, match=what):
            jmamba.load_official_lm(tmp_path / "b")
