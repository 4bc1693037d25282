"""Property-based tests (hypothesis) over the public entry points.

Each generated case either raises a ValueError / TypeError that names an argument (before any state
changes) or returns a result consistent with the reference. Shapes come from small pools so compiled
programs are reused; examples are derandomized (the same cases every run) and bounded so the whole
module stays within ~90 s on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

hypothesis = pytest.importorskip("hypothesis", reason="property tests need the `hypothesis` test extra")
from hypothesis import HealthCheck, given, settings, strategies as st   # noqa: E402

import jmamba   # noqa: E402
from jmamba import ops   # noqa: E402

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
WEIRD_FLOATS = st.sampled_from([0.0, -0.0, 1e-30, -1.0, 1e30, float("nan"), float("inf"), -float("inf")])
WEIRD = st.one_of(st.integers(-3, 300), WEIRD_FLOATS, st.booleans(), st.none(), st.just("x"))


def _values(r, shape, special):
    x = r.normal(size=shape).astype(np.float32)
    if special and x.size:
        x.reshape(-1)[r.integers(0, x.size)] = special
    return x


def _nan_consistent(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)), "NaN positions differ from the reference"
    fin = np.isfinite(want)
    assert np.array_equal(np.isfinite(got), fin), "inf positions differ from the reference"
    if fin.any():
        scale = max(np.max(np.abs(want[fin])), 1e-6)
        assert np.max(np.abs(got[fin] - want[fin])) <= tol * scale


# ------------------------------------------------------------------------------------ the ops
@settings(max_examples=12, **SETTINGS)
@given(shape=st.sampled_from([(1, 1, 3, 2, 1), (2, 5, 4, 3, 2), (1, 0, 3, 2, 1), (2, 9, 6, 2, 3)]),
       special=st.sampled_from([None, float("nan"), float("inf")]), seed=st.integers(0, 3),
       reset=st.booleans())
def test_selective_scan_xla_agrees_with_the_reference(shape, special, seed, reset):
    bsz, T, d, n, g = shape
    r = np.random.default_rng(seed)
    args = (_values(r, (bsz, T, d), special), 0.3 * _values(r, (bsz, T, d), None),
            -np.exp(0.3 * _values(r, (d, n), None)), _values(r, (bsz, T, g, n), None),
            _values(r, (bsz, T, g, n), None), _values(r, (d,), None), _values(r, (bsz, T, d), None))
    kw = dict(delta_softplus=True, return_final_state=True,
              reset=jnp.asarray(r.random((bsz, T)) < 0.3) if reset else None)
    want = ops.selective_scan(*map(jnp.asarray, args), implementation="reference", **kw)
    got = ops.selective_scan(*map(jnp.asarray, args), implementation="xla", **kw)
    _nan_consistent(got[0], want[0], 1e-4)
    _nan_consistent(got[1].ssm, want[1].ssm, 1e-4)


@settings(max_examples=10, **SETTINGS)
@given(which=st.sampled_from(["delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state", "reset"]),
       seed=st.integers(0, 5))
def test_selective_scan_names_the_bad_argument(which, seed):
    r = np.random.default_rng(seed)
    bsz, T, d, n = 2, 4, 3, 2
    kw = dict(u=jnp.ones((bsz, T, d)), delta=jnp.ones((bsz, T, d)), A=-jnp.ones((d, n)), B=jnp.ones((bsz, T, n)),
              C=jnp.ones((bsz, T, n)), D=jnp.ones((d,)), z=jnp.ones((bsz, T, d)), delta_bias=jnp.ones((d,)),
              initial_state=ops.SelectiveScanState(jnp.zeros((bsz, d, n))), reset=jnp.zeros((bsz, T), bool))
    x = kw[which]
    if which == "initial_state":
        kw[which] = ops.SelectiveScanState(jnp.zeros((bsz, d + 1, n)))
    elif which == "reset":
        kw[which] = jnp.zeros((bsz, T + 1), bool) if r.random() < 0.5 else jnp.zeros((bsz, T))
    elif which == "A":   # A's n defines n: a wrong d is what A alone can get wrong
        kw[which] = -jnp.ones((d + 1 + int(r.integers(0, 3)), n))
    else:
        kw[which] = jnp.ones(x.shape[:-1] + (x.shape[-1] + 1 + int(r.integers(0, 3)),))
    with pytest.raises((ValueError, TypeError), match=which):
        ops.selective_scan(**kw)


@settings(max_examples=10, **SETTINGS)
@given(shape=st.sampled_from([(1, 3, 2, 1, 4, 2, 1), (2, 6, 2, 2, 6, 3, 2), (1, 0, 2, 1, 4, 2, 1),
                              (2, 7, 3, 1, 8, 2, 4)]),
       special=st.sampled_from([None, float("nan")]), seed=st.integers(0, 3), with_state=st.booleans())
def test_mamba3_scan_xla_agrees_with_the_reference(shape, special, seed, with_state):
    bsz, T, H, G, N, P, S = shape
    r = np.random.default_rng(seed)
    a = lambda s, sp=None: jnp.asarray(_values(r, s, sp))   # noqa: E731
    args = (a((bsz, T, G, N)), a((bsz, T, G, N)), a((bsz, T, H, P), special), -jnp.abs(a((bsz, T, H))) * 0.3,
            jnp.abs(a((bsz, T, H))) * 0.3 + 0.05, a((bsz, T, H)), a((H, N)), a((H, N)), a((bsz, T, S)), a((H,)),
            a((bsz, T, H, P)))
    state = (ops.Mamba3ScanState(a((bsz, H, S)), 0.1 * a((bsz, H, P, N)), a((bsz, H, N)), a((bsz, H, P)))
             if with_state else None)
    kw = dict(initial_state=state, return_final_state=True, tuning=ops.Mamba3ScanTuning(chunk_size=4))
    want = ops.mamba3_siso_scan(*args, implementation="reference", **kw)
    got = ops.mamba3_siso_scan(*args, implementation="xla", **kw)
    if special is None:
        _nan_consistent(got[0], want[0], 1e-4)
        for x, y in zip(got[1], want[1]):
            _nan_consistent(x, y, 1e-4)
    else:   # the chunked form spreads a NaN through its chunk's matmuls: NaN wherever the reference has one
        assert np.all(np.isnan(np.asarray(got[0]))[np.isnan(np.asarray(want[0]))])


# ------------------------------------------------------------------------------------ configs
@settings(max_examples=40, **SETTINGS)
@given(cls=st.sampled_from([jmamba.Mamba1Config, jmamba.Mamba3Config]), data=st.data())
def test_configs_validate_or_name_the_field(cls, data):
    fields = [f.name for f in dataclasses.fields(cls) if f.name != "chunk_size"]
    chosen = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    values = {k: data.draw(WEIRD) for k in chosen}
    try:
        cfg = cls(**values).validate()
    except (ValueError, TypeError) as e:
        named = [k for k in fields if k in str(e)]
        assert named, f"error does not name a field: {e}"
        return
    # a config that validates builds a model whose forward is finite
    if cfg.d_model * cfg.n_layers * max(cfg.d_state, 1) <= 4096 and cfg.n_layers <= 3:
        model = jmamba.get_architecture(cfg).backbone_cls(cfg, rngs=nnx.Rngs(0))
        y, _ = model(jnp.ones((1, 2, cfg.backbone_input_dim)))
        assert y.shape == (1, 2, cfg.d_model) and bool(jnp.all(jnp.isfinite(y)))


# ------------------------------------------------------------------------------------ models
SMALL = {"mamba1": jmamba.Mamba1Config(d_model=8, n_layers=1, d_state=2),
         "mamba3": jmamba.Mamba3Config(d_model=8, n_layers=1, d_state=4, headdim=4)}
LMS = {arch: jmamba.MambaLM(cfg, 7, rngs=nnx.Rngs(0)) for arch, cfg in SMALL.items()}


@settings(max_examples=16, **SETTINGS)
@given(arch=st.sampled_from(sorted(SMALL)), T=st.sampled_from([1, 3]),
       ids=st.lists(st.integers(-2, 9), min_size=6, max_size=6))
def test_lm_raises_on_bad_ids_or_matches_its_decode_steps(arch, T, ids):
    lm = LMS[arch]
    x = np.asarray(ids[:2 * T], np.int32).reshape(2, T)
    if ((x < 0) | (x >= 7)).any():
        with pytest.raises(ValueError, match="input_ids"):
            lm(jnp.asarray(x))
        return
    logits, _ = lm(jnp.asarray(x))
    state = lm.init_state(2)
    for t in range(T):   # the full forward equals the decode steps
        step_logits, state = lm.step(jnp.asarray(x[:, t]), state)
        np.testing.assert_allclose(np.asarray(step_logits), np.asarray(logits[:, t]), rtol=2e-4, atol=2e-5)


# ------------------------------------------------------------------------------------ training
MODEL = jmamba.Mamba1Backbone(jmamba.Mamba1Config(d_model=8, n_layers=1, d_state=2, input_dim=3), rngs=nnx.Rngs(0))
OPT = jmamba.fused_adamw(1e-2)
STEP = jmamba.make_train_step(MODEL, OPT, loss_fn=lambda y, b: jnp.mean((y - b["targets"]) ** 2),
                              clip_max_norm=1.0, donate=False)
SPLIT_OPT = optax.adam(1e-2)


@settings(max_examples=12, **SETTINGS)
@given(specials=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.sampled_from([float("nan"),
                                   float("inf"), 1e30])), max_size=2), seed=st.integers(0, 9))
def test_train_step_never_writes_non_finite_weights(specials, seed):
    r = np.random.default_rng(seed)
    x = r.normal(size=(2, 4, 3)).astype(np.float32)
    for b, t, v in specials:
        x[b, t, 0] = v
    state = jmamba.TrainState.create(MODEL, OPT, 2)
    new, m = STEP(state, {"inputs": jnp.asarray(x), "targets": jnp.zeros((2, 4, 8))})
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(new.params))
    assert all(bool(jnp.all(jnp.isfinite(s))) for s in jax.tree.leaves(new.recurrent_state))
    if not np.all(np.isfinite(x)):
        assert bool(m["skipped"]) and int(new.step) == 0


@settings(max_examples=8, **SETTINGS)
@given(d_out_special=st.sampled_from([None, float("nan"), float("inf")]), seed=st.integers(0, 5))
def test_split_api_skips_a_non_finite_d_out(d_out_special, seed):
    state = jmamba.TrainState.create(MODEL, SPLIT_OPT, 2)
    x = jnp.asarray(np.random.default_rng(seed).normal(size=(2, 4, 3)), jnp.float32)
    out, ctx, state = jmamba.forward(MODEL, state, {"inputs": x})
    d_out = np.asarray(out) / 8
    if d_out_special is not None:
        d_out[0, 0, 0] = d_out_special
    before = [np.asarray(p) for p in jax.tree.leaves(state.params)]
    new, m = jmamba.backward_step(SPLIT_OPT, state, ctx, jnp.asarray(d_out))
    after = [np.asarray(p) for p in jax.tree.leaves(new.params)]
    assert all(np.all(np.isfinite(p)) for p in after)
    assert bool(m["skipped"]) == (d_out_special is not None)
    if d_out_special is not None:
        assert all(np.array_equal(a, b) for a, b in zip(after, before))


@settings(max_examples=30, **SETTINGS)
@given(name=st.sampled_from(["learning_rate", "b1", "b2", "eps", "weight_decay"]), value=WEIRD)
def test_fused_adamw_hyperparameters_are_checked(name, value):
    kw = {name: value}
    try:
        opt = jmamba.fused_adamw(**({"learning_rate": 1e-3} | kw))
    except (ValueError, TypeError) as e:
        assert name in str(e)
        return
    params = {"w": jnp.ones((3,))}
    upd, _ = opt.update({"w": jnp.full((3,), 0.5)}, opt.init(params), params)
    assert bool(jnp.all(jnp.isfinite(upd["w"])))


@settings(max_examples=12, **SETTINGS)
@given(temperature=st.one_of(st.sampled_from([0.0, 0.7]), WEIRD), top_k=st.one_of(st.none(), st.integers(-1, 9)),
       top_p=st.one_of(st.none(), st.sampled_from([0.5, 1.0, 0.0, 1.5, float("nan")])),
       new_tokens=st.sampled_from([0, 2, -1]))
def test_generate_checks_its_settings_or_returns_valid_tokens(temperature, top_k, top_p, new_tokens):
    lm = LMS["mamba1"]
    try:
        out = jmamba.generate(lm, jnp.zeros((1, 2), jnp.int32), new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, rng=jax.random.key(0))
    except (ValueError, TypeError) as e:
        assert any(n in str(e) for n in ("temperature", "top_k", "top_p", "max_new_tokens", "rng"))
        return
    assert out.shape == (1, 2 + new_tokens) and bool(jnp.all((out >= 0) & (out < 7)))


@settings(max_examples=8, **SETTINGS)
@given(drop=st.integers(0, 20), reshape=st.integers(0, 20), scale=st.sampled_from([1.0, float("nan")]))
def test_load_weights_round_trips_or_refuses_without_touching_the_model(drop, reshape, scale):
    from jmamba.io.safetensors_io import flatten_params
    src, dst = jmamba.MambaLM(SMALL["mamba1"], 7, rngs=nnx.Rngs(1)), jmamba.MambaLM(SMALL["mamba1"], 7, rngs=nnx.Rngs(2))
    flat = flatten_params(nnx.state(src, nnx.Param))
    keys = sorted(flat)
    tensors = dict(flat)
    broken = False
    if drop < len(keys):
        tensors.pop(keys[drop])
        broken = True
    if reshape < len(keys) and keys[reshape] in tensors:
        tensors[keys[reshape]] = np.zeros(tensors[keys[reshape]].shape + (1,), np.float32)
        broken = True
    if math.isnan(scale):
        tensors[keys[-1]] = tensors[keys[-1]] * np.float32(scale)
        broken = True
    before = flatten_params(nnx.state(dst, nnx.Param))
    if broken:
        with pytest.raises(ValueError):
            jmamba.load_weights(dst, tensors)
        after = flatten_params(nnx.state(dst, nnx.Param))
        assert all(np.array_equal(after[k], before[k]) for k in before)
    else:
        jmamba.load_weights(dst, tensors)
        after = flatten_params(nnx.state(dst, nnx.Param))
        assert all(np.array_equal(after[k], flat[k]) for k in flat)


@settings(max_examples=4, **SETTINGS)
@given(damage=st.sampled_from(["none", "config", "leaf_shape", "optimizer"]))
def test_checkpoint_round_trips_or_names_the_mismatch(tmp_path_factory, damage):
    d = str(tmp_path_factory.mktemp("ck"))
    cfg = jmamba.Mamba1Config(d_model=8, n_layers=1, d_state=2, input_dim=3)
    state = jmamba.TrainState.create(MODEL, OPT, 2)
    jmamba.save_checkpoint(d, state, config=cfg)
    like, given_cfg = state, cfg
    if damage == "config":
        given_cfg = dataclasses.replace(cfg, norm_eps=1e-6)
    elif damage == "leaf_shape":
        like = jmamba.TrainState.create(MODEL, OPT, 4)
    elif damage == "optimizer":
        like = jmamba.TrainState.create(MODEL, optax.sgd(0.1), 2)
    if damage == "none":
        restored = jmamba.restore_checkpoint(d, like, config=given_cfg)
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
    else:
        with pytest.raises(jmamba.CheckpointMismatchError, match="norm_eps|recurrent_state|structure"):
            jmamba.restore_checkpoint(d, like, config=given_cfg)
