"""jmamba.Precision: the one name of the compute precision (a str enum), what it converts from, and
what the models and the train step accept."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from builders import tiny_backbone
from jmamba import Precision, TrainState, make_train_step
from jmamba.core.precision import as_precision, as_training_precision


@pytest.mark.parametrize("value,want", [
    ("f32", Precision.F32), ("bf16", Precision.BF16), ("bfloat16", Precision.BF16), ("f16", Precision.F16),
    ("float64", Precision.F64), (Precision.F16, Precision.F16), (None, Precision.F32),
    (jnp.bfloat16, Precision.BF16), (jnp.float32, Precision.F32), (np.dtype("float16"), Precision.F16),
    (jnp.float64, Precision.F64),
])
def test_as_precision(value, want):
    assert as_precision(value) is want


def test_a_str_enum_with_its_compute_dtype():
    assert Precision.BF16 == "bf16" and str(Precision.BF16) == "bf16" and hash(Precision.BF16) == hash("bf16")
    assert [p.compute_dtype for p in Precision] == [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]
    assert [p.needs_loss_scale for p in Precision] == [False, False, True, False]


@pytest.mark.parametrize("value", ["fp8", "half", 16, jnp.int32, object()])
def test_bad_precision_raises_naming_the_argument(value):
    with pytest.raises(ValueError, match="precision must be one of"):
        as_precision(value)


def test_training_takes_f32_bf16_f16_only():
    assert as_training_precision("bf16") is Precision.BF16
    with pytest.raises(ValueError, match="for training"):
        as_training_precision("f64")
    model = tiny_backbone("mamba1")
    with pytest.raises(ValueError, match="precision"):
        make_train_step(model, optax.sgd(0.1), precision=jnp.float64)
    state = TrainState.create(model, optax.sgd(0.1), 2, precision=Precision.F16)
    assert state.loss_scale is not None
    make_train_step(model, optax.sgd(0.1), precision=jnp.float16)   # a dtype is accepted too
