"""The old spellings of the redesigned API still work, give the same values, and warn
(DeprecationWarning naming the new spelling). Everywhere else the tests use the new spellings
(tests/conftest.py turns a DeprecationWarning raised from a test module into an error)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmamba
from builders import (MAMBA1_TIME_ARRAYS, TINY, TINY_MAMBA1, TINY_MAMBA3, abstract_params, at_time, mamba1_scan_inputs,
                      mamba3_scan_inputs, tiny_backbone)
from jmamba import ops
from jmamba.configs import config_from_dict, config_to_json
from jmamba.ops import Mamba3ScanState, Mamba3ScanTuning, SelectiveScanState
from jmamba.optim import no_decay_mask, no_decay_paths


def same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -------------------------------------------------------------------------------- selective scan
def test_selective_scan_bare_array_initial_state():
    kw, _ = mamba1_scan_inputs((2, 5, 4, 3, 1), jnp.float32)
    new = ops.selective_scan(**kw, delta_softplus=True, return_final_state=True)
    with pytest.warns(DeprecationWarning, match="bare .* array is deprecated.*SelectiveScanState"):
        old = ops.selective_scan(**dict(kw, initial_state=kw["initial_state"].ssm), delta_softplus=True,
                                 return_final_state=True)
    assert isinstance(old[1], SelectiveScanState)     # the result is the new state type either way
    same(old, new)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="initial_state must have shape"):
        ops.selective_scan(**dict(kw, initial_state=jnp.ones((2, 4, 5))))


def test_selective_scan_options_passed_positionally():
    kw, _ = mamba1_scan_inputs((1, 5, 4, 3, 1), jnp.float32)
    arrays = [kw[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    new = ops.selective_scan(*arrays, delta_softplus=True, initial_state=kw["initial_state"],
                             return_final_state=True, implementation="reference")
    with pytest.warns(DeprecationWarning, match="positionally to selective_scan is deprecated"):
        old = ops.selective_scan(*arrays, True, kw["initial_state"], True, "reference")
    same(old, new)


def test_selective_scan_step_bare_array_state():
    kw, _ = mamba1_scan_inputs((2, 1, 4, 3, 1), jnp.float32)
    token = at_time(kw, 0, MAMBA1_TIME_ARRAYS)
    new = ops.selective_scan_step(**token, delta_softplus=True)
    with pytest.warns(DeprecationWarning, match="SelectiveScanState"):
        old = ops.selective_scan_step(**dict(token, initial_state=token["initial_state"].ssm), delta_softplus=True)
    same(old, new)


# ------------------------------------------------------------------------------- Mamba-3 scan
@pytest.fixture(scope="module")
def mamba3_call():
    arrays, state = mamba3_scan_inputs((2, 9, 4, 2, 8, 3, 2), jnp.float32)
    new = ops.mamba3_siso_scan(**arrays, initial_state=state, return_final_state=True,
                               tuning=Mamba3ScanTuning(chunk_size=4), implementation="xla")
    return arrays, state, new


def test_mamba3_renamed_keywords_and_chunk_size(mamba3_call):
    arrays, state, new = mamba3_call
    old_kw = {k: v for k, v in arrays.items() if k != "z"}
    with pytest.warns(DeprecationWarning, match="Z=, initial_states=, return_final_states=, chunk_size= deprecated"):
        old = ops.mamba3_siso_scan(**old_kw, Z=arrays["z"], initial_states=state, return_final_states=True,
                                   chunk_size=4, implementation="xla")
    assert isinstance(old[1], Mamba3ScanState)
    same(old, new)


def test_mamba3_options_passed_positionally_and_tuples_as_state(mamba3_call):
    arrays, state, new = mamba3_call
    positional = [arrays[k] for k in ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "z")]
    with pytest.warns(DeprecationWarning, match="initial_state \\(positional\\)"):
        old = ops.mamba3_siso_scan(*positional, tuple(state), True, 4, "xla")
    same(old, new)


def test_mamba3_old_and_new_spelling_together_is_an_error(mamba3_call):
    arrays, state, _ = mamba3_call
    with pytest.raises(TypeError, match="both z= and its deprecated spelling Z="):
        ops.mamba3_siso_scan(**arrays, Z=arrays["z"])
    with pytest.raises(TypeError, match="both tuning= and the deprecated chunk_size="):
        with pytest.warns(DeprecationWarning):
            ops.mamba3_siso_scan(**arrays, chunk_size=4, tuning=Mamba3ScanTuning(chunk_size=4))
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        with pytest.warns(DeprecationWarning):
            ops.mamba3_siso_scan(**arrays, chunk_size=0)


def test_renamed_state_class():
    with pytest.warns(DeprecationWarning, match="Mamba3ScanStates is deprecated; use jmamba.ops.Mamba3ScanState"):
        assert ops.Mamba3ScanStates is Mamba3ScanState
    assert jmamba.Mamba3LayerState is Mamba3ScanState
    with pytest.raises(AttributeError):
        ops.no_such_name


# ------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("arch", ["mamba1", "mamba3"])
def test_models_compute_dtype_keyword(arch):
    model = tiny_backbone(arch, cfg=dataclasses.replace(TINY[arch], n_layers=1))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 3)), jnp.float32)
    name = type(model).__name__
    with pytest.warns(DeprecationWarning, match=f"{name}.__call__\\(compute_dtype=...\\) is deprecated; use precision="):
        old = model(x, compute_dtype=jnp.bfloat16)
    same(old, model(x, precision="bf16"))
    state = model.init_state(2)
    with pytest.warns(DeprecationWarning, match=f"{name}.step\\(compute_dtype=...\\)"):
        old = model.step(x[:, 0], state, compute_dtype=jnp.bfloat16)
    same(old, model.step(x[:, 0], state, precision=jmamba.Precision.BF16))
    with pytest.raises(TypeError, match="both precision= and its deprecated spelling compute_dtype="):
        model(x, precision="bf16", compute_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="unexpected keyword"):
        model(x, dtype=jnp.bfloat16)


def test_lm_and_generate_compute_dtype_keyword():
    lm = jmamba.MambaLM(jmamba.Mamba1Config(d_model=8, n_layers=1, d_state=2), 7, rngs=nnx.Rngs(0))
    ids = jnp.asarray([[1, 2, 3]], jnp.int32)
    with pytest.warns(DeprecationWarning, match="MambaLM.__call__\\(compute_dtype"):
        old = lm(ids, compute_dtype=jnp.bfloat16)
    same(old, lm(ids, precision="bf16"))
    with pytest.warns(DeprecationWarning, match="generate\\(compute_dtype"):
        old = jmamba.generate(lm, ids, 2, compute_dtype=jnp.bfloat16)
    same(old, jmamba.generate(lm, ids, 2, precision="bf16"))


# ------------------------------------------------------------------------------ no_decay_mask
def test_no_decay_mask_with_an_architecture_name():
    params = abstract_params(lambda: jmamba.Mamba1Backbone(TINY_MAMBA1, rngs=nnx.Rngs(0)))
    with pytest.warns(DeprecationWarning, match="arch argument is deprecated and ignored"):
        old = no_decay_mask(params, "mamba1")
    assert jax.tree.leaves(old) == jax.tree.leaves(no_decay_mask(params))
    with pytest.warns(DeprecationWarning):
        old = no_decay_paths(params, "mamba1", "official")
    assert old == no_decay_paths(params, "official")
    # the arch is ignored: the groups come from the parameters' tags (this once raised)
    with pytest.warns(DeprecationWarning):
        assert no_decay_paths(params, "mamba3") == no_decay_paths(params)


# --------------------------------------------------------------------------------- Mamba3Config
def test_mamba3_config_chunk_size():
    with pytest.warns(DeprecationWarning, match="Mamba3Config\\(chunk_size=...\\) is deprecated"):
        cfg = jmamba.Mamba3Config(d_model=16, n_layers=2, d_state=8, headdim=8, input_dim=3, chunk_size=3)
    assert cfg.chunk_size == 3 and cfg == TINY_MAMBA3, "not compared"
    assert "chunk_size" not in json.loads(config_to_json(cfg)) and "chunk_size" not in repr(cfg)
    # a config dict saved before the change (with chunk_size) still loads, silently
    saved = dict(json.loads(config_to_json(TINY_MAMBA3)), chunk_size=64)
    assert config_from_dict(saved) == TINY_MAMBA3


def test_mamba3_config_chunk_size_still_sets_the_models_chunk(monkeypatch):
    from jmamba.ops.mamba3_siso_scan import xla
    seen = []
    real = xla.mamba3_siso_scan_xla
    monkeypatch.setattr(xla, "mamba3_siso_scan_xla", lambda *a, tuning: seen.append(tuning.chunk_size) or real(*a, tuning=tuning))
    with pytest.warns(DeprecationWarning):
        cfg = jmamba.Mamba3Config(d_model=16, n_layers=1, d_state=8, headdim=8, input_dim=3, chunk_size=3)
    model = jmamba.Mamba3Backbone(cfg, rngs=nnx.Rngs(0))
    with ops.tuning("mamba3_siso_scan", chunk_size=5):     # the deprecated field wins, as before
        model(jnp.ones((1, 7, 3)))
    assert seen == [3]


@pytest.mark.parametrize("module, name", [("jmamba.dtypes", "accum_dtype"), ("jmamba.ops.validation", "check_array"),
                                          ("jmamba.optim.adamw_numerics", "step_scalars")])
def test_moved_modules_still_import_and_warn(module, name):
    import importlib
    import sys

    sys.modules.pop(module, None)
    with pytest.warns(DeprecationWarning, match=module):
        mod = importlib.import_module(module)
    assert callable(getattr(mod, name))


def test_removed_tables_still_answer_and_warn():
    import jmamba.configs
    import jmamba.lm

    with pytest.warns(DeprecationWarning, match="CONFIG_CLASSES"):
        assert jmamba.configs.CONFIG_CLASSES["mamba3"] is jmamba.Mamba3Config
    with pytest.warns(DeprecationWarning, match="BACKBONES"):
        assert jmamba.lm.BACKBONES[jmamba.Mamba1Config] is jmamba.Mamba1Backbone


def test_selective_scan_xla_old_knobs_still_work_and_warn():
    from jmamba.ops.selective_scan.common import SelectiveScanTuning
    from jmamba.ops.selective_scan.xla import selective_scan_xla

    r = np.random.default_rng(0)
    a = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)   # noqa: E731
    args = (a(1, 9, 3), a(1, 9, 3), -jnp.exp(a(3, 2)), a(1, 9, 1, 2), a(1, 9, 1, 2), None, None, None, None, None)
    with pytest.warns(DeprecationWarning, match="tuning"):
        old = selective_scan_xla(*args, delta_softplus=True, chunk_size=4, inner="sequential")
    new = selective_scan_xla(*args, delta_softplus=True, tuning=SelectiveScanTuning(xla_chunk_size=4,
                                                                                  xla_inner="sequential"))
    assert np.array_equal(old[0], new[0]) and np.array_equal(old[1], new[1])
