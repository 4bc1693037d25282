"""jmamba.ops.tuning: per-op settings (keyword > innermost block > default), their validation, and
that they reach the implementation from a model (the scans' own `tuning=` tests are in
tests/test_selective_scan.py and tests/test_mamba3_scan.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from builders import TINY_MAMBA3
from jmamba import Mamba3Backbone
from jmamba.ops import (AdamWTuning, Mamba3ScanTuning, SelectiveScanTuning, current_tuning, set_default_tuning,
                        tuning)
from jmamba.ops.settings import register_tuning
from jmamba.optim import KernelConfig

OPS = {"selective_scan": SelectiveScanTuning, "mamba3_siso_scan": Mamba3ScanTuning, "adamw_update": AdamWTuning}


@pytest.mark.parametrize("op", list(OPS))
def test_defaults_are_the_settings_classes_defaults(op):
    assert current_tuning(op) == OPS[op]()
    assert dataclasses.is_dataclass(OPS[op]) and OPS[op].__dataclass_params__.frozen


def test_blocks_nest_replace_fields_of_the_current_settings_and_end_even_on_error():
    base = current_tuning("mamba3_siso_scan")
    config = object()
    with tuning("mamba3_siso_scan", chunk_size=16) as outer:
        assert outer == current_tuning("mamba3_siso_scan") == Mamba3ScanTuning(chunk_size=16)
        with tuning("mamba3_siso_scan", pallas_config=config):
            # only the named field changes; the chunk size of the enclosing block stays
            assert current_tuning("mamba3_siso_scan") == Mamba3ScanTuning(chunk_size=16, pallas_config=config)
            assert current_tuning("selective_scan") == SelectiveScanTuning(), "per op"
        with tuning("mamba3_siso_scan", Mamba3ScanTuning(chunk_size=8)):
            assert current_tuning("mamba3_siso_scan").chunk_size == 8
        kw = Mamba3ScanTuning(chunk_size=2)
        assert current_tuning("mamba3_siso_scan", kw) is kw, "the keyword wins over the block"
        with pytest.raises(RuntimeError, match="boom"), tuning("mamba3_siso_scan", chunk_size=32):
            raise RuntimeError("boom")
        assert current_tuning("mamba3_siso_scan") == Mamba3ScanTuning(chunk_size=16)
    assert current_tuning("mamba3_siso_scan") == base


def test_set_default_tuning_changes_the_default_for_the_process():
    old = current_tuning("selective_scan")
    try:
        set_default_tuning("selective_scan", SelectiveScanTuning(xla_chunk_size=7))
        assert current_tuning("selective_scan").xla_chunk_size == 7
        with tuning("selective_scan", xla_inner="sequential"):
            assert current_tuning("selective_scan") == SelectiveScanTuning(xla_chunk_size=7, xla_inner="sequential")
    finally:
        set_default_tuning("selective_scan", old)
    assert current_tuning("selective_scan") == old


def test_bad_settings_raise_naming_what_is_wrong():
    with pytest.raises(ValueError, match=r"SelectiveScanTuning has no field\(s\) \['chunk_size'\]"):
        with tuning("selective_scan", chunk_size=4):
            pass
    with pytest.raises(ValueError, match="op must be one of"):
        current_tuning("mamba2_scan")
    with pytest.raises(TypeError, match="tuning for mamba3_siso_scan must be a Mamba3ScanTuning"):
        with tuning("mamba3_siso_scan", SelectiveScanTuning()):
            pass
    with pytest.raises(TypeError, match="must be a SelectiveScanTuning"):
        current_tuning("selective_scan", Mamba3ScanTuning())
    with pytest.raises(TypeError, match="must be a AdamWTuning|must be an AdamWTuning"):
        set_default_tuning("adamw_update", KernelConfig())
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        with tuning("mamba3_siso_scan", chunk_size=-1):
            pass
    with pytest.raises(TypeError, match="dataclass instance"):
        register_tuning("fake_op", dict(chunk_size=4))
    with pytest.raises(TypeError, match="KernelConfig"):
        AdamWTuning(pallas_config="fast")
    with pytest.raises(ValueError, match="block_size"):
        AdamWTuning(pallas_config=KernelConfig(block_size=96))


def test_a_block_reaches_the_scan_inside_a_model(monkeypatch):
    """The chunk size of a block around a Mamba-3 model's forward is what its scans run with."""
    from jmamba.ops.mamba3_siso_scan import xla
    seen = []
    real = xla.mamba3_siso_scan_xla
    monkeypatch.setattr(xla, "mamba3_siso_scan_xla", lambda *a, tuning: seen.append(tuning.chunk_size) or real(*a, tuning=tuning))
    model = Mamba3Backbone(TINY_MAMBA3, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 6, 3))
    with tuning("mamba3_siso_scan", chunk_size=3):
        y3, _ = model(x)
    y, _ = model(x)
    assert seen == [3] * TINY_MAMBA3.n_layers + [Mamba3ScanTuning().chunk_size] * TINY_MAMBA3.n_layers
    assert float(jnp.abs(y3 - y).max()) < 1e-5
