"""Mamba1Config: official defaults, derived sizes, validate() errors naming the field, init rules."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jmamba import Mamba1Config, Mamba1Mixer


def test_official_defaults_and_derived_sizes():
    cfg = Mamba1Config()
    assert (cfg.d_model, cfg.d_state, cfg.d_conv, cfg.expand, cfg.norm_eps) == (768, 16, 4, 2, 1e-5)
    assert (cfg.dt_min, cfg.dt_max, cfg.dt_init_floor, cfg.dt_scale, cfg.dt_init) == (1e-3, 0.1, 1e-4, 1.0, "random")
    assert cfg.d_inner == 1536 and cfg.resolved_dt_rank == 48
    assert Mamba1Config(d_model=2560).resolved_dt_rank == 160
    assert Mamba1Config(d_model=100, dt_rank=7).resolved_dt_rank == 7


@pytest.mark.parametrize("field,value", [
    ("d_model", 0), ("d_model", -3), ("d_model", 2.5), ("n_layers", 0), ("d_state", 0), ("d_conv", 0),
    ("d_conv", 9), ("expand", 0), ("dt_rank", 0), ("dt_rank", "big"), ("input_dim", 0), ("norm_eps", 0.0),
    ("norm_eps", -1e-5), ("dt_min", 0.0), ("dt_max", -1.0), ("dt_scale", 0.0), ("dt_init", "zeros"),
    ("dt_init_floor", -1.0), ("conv_bias", 1), ("d_model", True),
])
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        Mamba1Config(**{field: value}).validate()


def test_dt_min_above_dt_max_is_rejected():
    with pytest.raises(ValueError, match="dt_min"):
        Mamba1Config(dt_min=0.2, dt_max=0.1).validate()


def test_modules_refuse_an_invalid_config():
    with pytest.raises(ValueError, match="d_state"):
        Mamba1Mixer(Mamba1Config(d_model=8, d_state=0), rngs=nnx.Rngs(0))


def test_official_init_rules():
    cfg = Mamba1Config(d_model=64, n_layers=4, d_state=8)
    m = Mamba1Mixer(cfg, rngs=nnx.Rngs(0))
    E, N, R = cfg.d_inner, cfg.d_state, cfg.resolved_dt_rank
    np.testing.assert_allclose(m.A_log[...], np.log(np.tile(np.arange(1, N + 1), (E, 1))), rtol=1e-6)
    np.testing.assert_array_equal(m.D[...], np.ones(E))
    dt = np.log1p(np.exp(np.asarray(m.dt_proj.bias[...])))           # softplus(bias) = dt
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 0.1 * 1.001
    assert np.abs(m.dt_proj.kernel[...]).max() <= R ** -0.5
    assert np.abs(m.in_proj.kernel[...]).max() <= 1 / math.sqrt(cfg.d_model)
    assert np.abs(m.conv1d.kernel[...]).max() <= 1 / math.sqrt(cfg.d_conv)
    assert np.abs(m.out_proj.kernel[...]).max() <= 1 / math.sqrt(E) / math.sqrt(cfg.n_layers)
    # the rescale is real: without it the bound is reached (up to sampling)
    m2 = Mamba1Mixer(Mamba1Config(d_model=64, n_layers=4, d_state=8, rescale_out_proj=False), rngs=nnx.Rngs(0))
    assert np.abs(m2.out_proj.kernel[...]).max() > 0.9 / math.sqrt(E)
    mc = Mamba1Mixer(Mamba1Config(d_model=64, d_state=8, dt_init="constant"), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(mc.dt_proj.kernel[...], R ** -0.5, rtol=1e-6)
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(nnx.state(m, nnx.Param)))
