"""no_decay_mask: the Mamba-1 / Mamba-3 weight-decay groups, polarity (True = decay), LM prefixes,
wrong-architecture errors, and the one-step effect of the mask on fused_adamw and optax.adamw."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmamba import Mamba1Backbone, Mamba1Config, MambaLM
from jmamba.optim import DECAY, NO_DECAY, fused_adamw, no_decay_mask, no_decay_paths

N_LAYERS = 2
M1 = Mamba1Config(d_model=8, n_layers=N_LAYERS, d_state=2, input_dim=3)


def abstract_params(make):
    """nnx.State of the module's params, as shapes only (no compile, no init compute)."""
    return nnx.state(nnx.eval_shape(make), nnx.Param)


def val(leaf):
    """The Python bool inside a mask leaf (an nnx.Param for nnx.State params)."""
    return leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf


def per_layer(names):
    return [f"layers.{i}.{n}" for i in range(N_LAYERS) for n in names]


def mamba3_params(*, is_outproj_norm=True, layers_as_list=False, as_nnx_state=False, d=8, h=2, n=4):
    """A hand-built Mamba-3 backbone param tree with the contract's nnx paths (the module may not exist)."""
    r = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)   # noqa: E731
    leaf = (lambda x: nnx.Param(x)) if as_nnx_state else (lambda x: x)

    def layer():
        mixer = {"in_proj": {"kernel": leaf(arr(d, 40))}, "dt_bias": leaf(arr(h)),
                 "B_bias": leaf(arr(h, n)), "C_bias": leaf(arr(h, n)),
                 "B_norm": {"weight": leaf(arr(n))}, "C_norm": {"weight": leaf(arr(n))},
                 "D": leaf(arr(h)), "out_proj": {"kernel": leaf(arr(2 * d, d))}}
        if is_outproj_norm:
            mixer["norm"] = {"weight": leaf(arr(2 * d))}
        return {"norm": {"weight": leaf(arr(d))}, "mixer": mixer}

    layers = [layer() for _ in range(N_LAYERS)]
    tree = {"input_proj": {"kernel": leaf(arr(3, d)), "bias": leaf(arr(d))},
            "layers": layers if layers_as_list else dict(enumerate(layers)),
            "norm_f": {"weight": leaf(arr(d))}}
    return nnx.State(tree) if as_nnx_state else tree


# -------------------------------------------------------------------------------------- Mamba-1
MAMBA1_REFERENCE = sorted(per_layer(["norm.weight", "mixer.dt_proj.bias", "mixer.A_log", "mixer.D"])
                          + ["norm_f.weight"])
MAMBA1_OFFICIAL = sorted(per_layer(["mixer.A_log", "mixer.D"]))


def test_mamba1_groups_and_polarity():
    params = abstract_params(lambda: Mamba1Backbone(M1, rngs=nnx.Rngs(0)))
    assert sorted(no_decay_paths(params, "mamba1")) == MAMBA1_REFERENCE
    assert sorted(no_decay_paths(params, "mamba1", "official")) == MAMBA1_OFFICIAL
    assert no_decay_paths(params, "mamba1", "none") == []
    mask = no_decay_mask(params, "mamba1")
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
    ref = no_decay_paths(params, "mamba1")
    assert sorted(ref) == sorted("backbone." + p for p in MAMBA1_REFERENCE if not p.startswith("input_proj"))
    mask = no_decay_mask(params, "mamba1")
    assert val(mask["embedding"]) is True
    if not tie:
        assert val(mask["lm_head"]["kernel"]) is True
    assert sorted(no_decay_paths(params, "mamba1", "official")) == ["backbone." + p for p in MAMBA1_OFFICIAL]


# -------------------------------------------------------------------------------------- Mamba-3
MAMBA3_REFERENCE = sorted(per_layer(["norm.weight", "mixer.B_norm.weight", "mixer.C_norm.weight",
                                     "mixer.norm.weight", "mixer.dt_bias", "mixer.D", "mixer.B_bias",
                                     "mixer.C_bias"]) + ["norm_f.weight", "input_proj.bias"])
MAMBA3_OFFICIAL = sorted(per_layer(["mixer.dt_bias", "mixer.D"]))


@pytest.mark.parametrize("layers_as_list,as_nnx_state", [(False, False), (True, False), (False, True)])
def test_mamba3_groups(layers_as_list, as_nnx_state):
    params = mamba3_params(layers_as_list=layers_as_list, as_nnx_state=as_nnx_state)
    assert sorted(no_decay_paths(params, "mamba3")) == MAMBA3_REFERENCE
    assert sorted(no_decay_paths(params, "mamba3", "official")) == MAMBA3_OFFICIAL
    assert no_decay_paths(params, "mamba3", "none") == []
    mask = no_decay_mask(params, "mamba3")
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    decayed = {p for p in _all_paths(params)} - set(MAMBA3_REFERENCE)
    assert decayed == ({"input_proj.kernel"} | set(per_layer(["mixer.in_proj.kernel", "mixer.out_proj.kernel"])))


def test_mamba3_without_output_norm():
    params = mamba3_params(is_outproj_norm=False)
    want = [p for p in MAMBA3_REFERENCE if not p.endswith("mixer.norm.weight")]
    assert sorted(no_decay_paths(params, "mamba3")) == want


def _all_paths(params):
    from jmamba.optim.no_decay_mask import dotted_path
    return [dotted_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


# ---------------------------------------------------------------------------------------- errors
def test_wrong_arch_mode_or_tree_raise():
    m1 = abstract_params(lambda: Mamba1Backbone(M1, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="A_log"):
        no_decay_mask(m1, "mamba3")                  # would silently decay A_log otherwise
    with pytest.raises(ValueError, match="not a parameter of a mamba1 backbone"):
        no_decay_mask(mamba3_params(), "mamba1")
    with pytest.raises(ValueError, match="arch"):
        no_decay_mask(m1, "mamba2")
    with pytest.raises(ValueError, match="mode"):
        no_decay_mask(m1, "mamba1", mode="torch")
    with pytest.raises(ValueError, match="params"):
        no_decay_mask({"w": jnp.zeros(3)}, "mamba1")
    with pytest.raises(ValueError, match="params"):
        no_decay_mask({}, "mamba1")


# --------------------------------------------------------------------------- effect of one step
@pytest.mark.parametrize("which", ["fused_adamw", "optax.adamw"])
def test_one_step_masked_param_differs_by_lr_wd_w0(which):
    lr, wd = 1e-3, 0.1
    params = mamba3_params(as_nnx_state=True)
    mask = no_decay_mask(params, "mamba3")
    r = np.random.default_rng(1)
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


def test_real_mamba3_backbone_if_present():
    """The Mamba-3 module is written concurrently; when it exists its paths must match the contract."""
    mamba3 = pytest.importorskip("jmamba.mamba3")
    for outproj_norm in (False, True):
        cfg = mamba3.Mamba3Config(d_model=16, n_layers=N_LAYERS, d_state=8, headdim=8, input_dim=3,
                                  is_outproj_norm=outproj_norm)
        params = abstract_params(lambda: mamba3.Mamba3Backbone(cfg, rngs=nnx.Rngs(0)))
        want = [p for p in MAMBA3_REFERENCE if outproj_norm or not p.endswith("mixer.norm.weight")]
        assert sorted(no_decay_paths(params, "mamba3")) == want
        assert sorted(no_decay_paths(params, "mamba3", "official")) == MAMBA3_OFFICIAL


def test_reference_mask_on_the_real_mamba3_module():
    """The Mamba-3 paths the mask relies on are the module's real parameter paths."""
    import jmamba
    from flax import nnx
    cfg = jmamba.Mamba3Config(d_model=16, n_layers=2, d_state=8, headdim=8, input_dim=3, is_outproj_norm=True)
    params = nnx.state(jmamba.Mamba3Backbone(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    got = sorted(no_decay_paths(params, "mamba3", "reference"))
    per_layer = ["B_bias", "B_norm.weight", "C_bias", "C_norm.weight", "D", "dt_bias", "norm.weight"]
    want = sorted(["input_proj.bias", "norm_f.weight"] + [f"layers.{i}.norm.weight" for i in range(2)] +
                  [f"layers.{i}.mixer.{k}" for i in range(2) for k in per_layer])
    assert got == want
    assert sorted(no_decay_paths(params, "mamba3", "official")) == sorted(
        f"layers.{i}.mixer.{k}" for i in range(2) for k in ("D", "dt_bias"))
