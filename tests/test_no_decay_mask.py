"""no_decay_mask: the Mamba-1 / Mamba-3 weight-decay groups read from the parameters' metadata,
polarity (True = decay), modules and their nnx.State alike, LM prefixes, errors, and the one-step
effect of the mask on fused_adamw and optax.adamw. (The deprecated `no_decay_mask(params, arch, mode)`
is in tests/test_deprecations.py.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from builders import abstract_params
from jmamba import Mamba1Backbone, Mamba1Config, Mamba3Backbone, Mamba3Config, MambaLM
from jmamba.optim import DECAY, NO_DECAY, fused_adamw, no_decay_mask, no_decay_paths
from jmamba.optim.no_decay_mask import dotted_path

N_LAYERS = 2
M1 = Mamba1Config(d_model=8, n_layers=N_LAYERS, d_state=2, input_dim=3)
M3 = Mamba3Config(d_model=8, n_layers=N_LAYERS, d_state=4, headdim=8, input_dim=3, is_outproj_norm=True)


def val(leaf):
    """The Python bool inside a mask leaf (an nnx.Param for nnx.State params)."""
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def per_layer(names):
    return [f"layers.{i}.{n}" for i in range(N_LAYERS) for n in names]


def all_paths(params):
    return [dotted_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


# The groups (docs/mamba1.md §2.3, docs/mamba3_siso.md §2.4): the oracle of every test below.
MAMBA1_REFERENCE = sorted(per_layer(["norm.weight", "mixer.dt_proj.bias", "mixer.A_log", "mixer.D"])
                          + ["norm_f.weight"])
MAMBA1_OFFICIAL = sorted(per_layer(["mixer.A_log", "mixer.D"]))
MAMBA3_REFERENCE = sorted(per_layer(["norm.weight", "mixer.B_norm.weight", "mixer.C_norm.weight",
                                     "mixer.norm.weight", "mixer.dt_bias", "mixer.D", "mixer.B_bias",
                                     "mixer.C_bias"]) + ["norm_f.weight", "input_proj.bias"])
MAMBA3_OFFICIAL = sorted(per_layer(["mixer.dt_bias", "mixer.D"]))


# -------------------------------------------------------------------------------------- Mamba-1
def test_mamba1_groups_and_polarity():
    params = abstract_params(lambda: Mamba1Backbone(M1, rngs=nnx.Rngs(0)))
    assert sorted(no_decay_paths(params)) == MAMBA1_REFERENCE
    assert sorted(no_decay_paths(params, "official")) == MAMBA1_OFFICIAL
    assert sorted(no_decay_paths(params, mode="official")) == MAMBA1_OFFICIAL
    assert no_decay_paths(params, "none") == []
    mask = no_decay_mask(params)
    assert jax.tree.structure(mask) == jax.tree.structure(params)   # usable as an optax mask
    assert DECAY is True and NO_DECAY is False
    mixer = mask["layers"][0]["mixer"]
    assert val(mixer["A_log"]) is False and val(mixer["D"]) is False          # not decayed
    assert val(mixer["dt_proj"]["bias"]) is False and val(mask["norm_f"]["weight"]) is False
    for decayed in (mixer["in_proj"]["kernel"], mixer["conv1d"]["kernel"], mixer["conv1d"]["bias"],
                    mixer["x_proj"]["kernel"], mixer["dt_proj"]["kernel"], mixer["out_proj"]["kernel"],
                    mask["input_proj"]["kernel"], mask["input_proj"]["bias"]):
        assert val(decayed) is True
    n_true = sum(jax.tree.leaves(mask))
    assert n_true == len(jax.tree.leaves(params)) - len(MAMBA1_REFERENCE)


@pytest.mark.parametrize("tie", [True, False])
def test_mamba_lm_paths_are_prefixed_and_embedding_decayed(tie):
    cfg = Mamba1Config(d_model=8, n_layers=N_LAYERS, d_state=2)
    params = abstract_params(lambda: MambaLM(cfg, 11, tie_embeddings=tie, rngs=nnx.Rngs(0)))
    ref = no_decay_paths(params)
    assert sorted(ref) == sorted("backbone." + p for p in MAMBA1_REFERENCE if not p.startswith("input_proj"))
    mask = no_decay_mask(params)
    assert val(mask["embedding"]) is True
    if not tie:
        assert val(mask["lm_head"]["kernel"]) is True
    assert sorted(no_decay_paths(params, "official")) == ["backbone." + p for p in MAMBA1_OFFICIAL]


# -------------------------------------------------------------------------------------- Mamba-3
@pytest.mark.parametrize("outproj_norm", [True, False])
def test_mamba3_groups(outproj_norm):
    cfg = dataclasses.replace(M3, is_outproj_norm=outproj_norm)
    params = abstract_params(lambda: Mamba3Backbone(cfg, rngs=nnx.Rngs(0)))
    want = [p for p in MAMBA3_REFERENCE if outproj_norm or not p.endswith("mixer.norm.weight")]
    assert sorted(no_decay_paths(params)) == want
    assert sorted(no_decay_paths(params, "official")) == MAMBA3_OFFICIAL
    assert no_decay_paths(params, "none") == []
    mask = no_decay_mask(params)
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    decayed = set(all_paths(params)) - set(want)
    assert decayed == ({"input_proj.kernel"} | set(per_layer(["mixer.in_proj.kernel", "mixer.out_proj.kernel"])))


def test_a_module_and_its_params_give_the_same_mask():
    """The model itself, its nnx.State of params and a single mixer: the tags travel with the parameters."""
    model = Mamba3Backbone(M3, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert no_decay_paths(model) == no_decay_paths(params)
    assert jax.tree.leaves(no_decay_mask(model, "official")) == jax.tree.leaves(no_decay_mask(params, "official"))
    mixer = model.layers[0].mixer
    assert sorted(no_decay_paths(mixer)) == sorted(["B_bias", "B_norm.weight", "C_bias", "C_norm.weight", "D",
                                                    "dt_bias", "norm.weight"])
    assert sorted(no_decay_paths(mixer, "official")) == ["D", "dt_bias"]


# ---------------------------------------------------------------------------------------- errors
def test_bad_mode_or_tree_raise():
    m1 = abstract_params(lambda: Mamba1Backbone(M1, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="mode must be one of"):
        no_decay_mask(m1, mode="torch")
    with pytest.raises(ValueError, match="mode must be one of"):
        no_decay_mask(m1, "mamba2")                 # neither a mode nor a (deprecated) arch name
    with pytest.raises(TypeError, match="metadata"):
        no_decay_mask({"w": jnp.zeros(3)})          # a pure dict carries no tags
    with pytest.raises(TypeError, match="metadata"):
        no_decay_paths(nnx.to_pure_dict(m1))
    with pytest.raises(ValueError, match="params has no leaves"):
        no_decay_mask({})
    with pytest.raises(TypeError, match="takes"):
        no_decay_mask(m1, "reference", "official")


# --------------------------------------------------------------------------- effect of one step
@pytest.mark.parametrize("which", ["fused_adamw", "optax.adamw"])
def test_one_step_masked_param_differs_by_lr_wd_w0(which):
    lr, wd = 1e-3, 0.1
    r = np.random.default_rng(1)
    shapes = abstract_params(lambda: Mamba3Backbone(M3, rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda x: jnp.asarray(r.normal(size=x.shape), jnp.float32), shapes)
    mask = no_decay_mask(params)
    grads = jax.tree.map(lambda x: jnp.asarray(r.normal(size=x.shape), jnp.float32), params)
    make = fused_adamw if which == "fused_adamw" else optax.adamw

    def one_step(opt):
        @jax.jit
        def run(params, grads):
            u, _ = opt.update(grads, opt.init(params), params)
            return optax.apply_updates(params, u)
        return run(params, grads)

    decayed = one_step(make(lr, weight_decay=wd))
    masked = one_step(make(lr, weight_decay=wd, mask=mask))
    seen = 0
    for m, w0, d, u in zip(jax.tree.leaves(mask), jax.tree.leaves(params), jax.tree.leaves(decayed),
                           jax.tree.leaves(masked)):
        w0, d, u = (np.asarray(x, np.float64) for x in (w0, d, u))
        if m:
            np.testing.assert_array_equal(u, d)
        else:
            seen += 1
            atol = 3 * float(np.max(np.spacing(np.abs(w0).astype(np.float32))))
            np.testing.assert_allclose(u - d, lr * wd * w0, rtol=0, atol=atol)
            assert np.max(np.abs(u - d)) > 10 * atol   # the decay term is far above rounding
    assert seen == len(MAMBA3_REFERENCE)
