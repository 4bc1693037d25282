"""MetricsLogger (JSONL always, TensorBoard through tensorboardX) and the learning-rate helpers."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jmamba import Mamba1Config, MambaLM, TrainState, make_train_step
from jmamba.training import metrics_log
from jmamba.training.losses import next_token_loss
from jmamba.training.metrics_log import (MetricsLogger, learning_rate, learning_rate_from_opt_state, read_metrics,
                                         to_float)


def lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_rows_are_json_objects_of_floats_flushed_at_once(tmp_path):
    log = MetricsLogger(tmp_path / "run")
    row = log.log(jnp.asarray(3, jnp.int32), {"step": jnp.asarray(3), "loss": jnp.asarray(2.5, jnp.float32),
                                              "grad_norm": np.float32(0.25), "skipped": jnp.asarray(False),
                                              "updates": np.int32(3), "lr": 1e-3, "bad": float("nan"),
                                              "one": jnp.ones((1,))})
    # flushed: readable before close, as a killed run would leave it
    (got,) = lines(log.path)
    assert got == row
    assert got["step"] == 3 and isinstance(got["step"], int) and got["split"] == "train"
    assert isinstance(got["time"], float)
    assert got["loss"] == 2.5 and got["grad_norm"] == 0.25 and got["skipped"] == 0.0 and got["updates"] == 3.0
    assert got["bad"] is None   # non-finite -> null: strict JSON
    assert all(isinstance(got[k], float) for k in ("loss", "grad_norm", "skipped", "updates", "lr", "one"))
    log.log(3, {"loss": 2.0}, split="eval")
    log.close()
    rows = lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["split"] for r in rows] == ["train", "eval"]
    with pytest.raises(RuntimeError, match="closed"):
        log.log(4, {"loss": 1.0})
    with open(log.path) as f:
        assert all(line.endswith("\n") and "NaN" not in line for line in f)


def test_bad_metrics_are_refused_with_their_name(tmp_path):
    with MetricsLogger(tmp_path) as log:
        with pytest.raises(ValueError, match="'vec'.*shape"):
            log.log(1, {"vec": np.ones(3)})
        with pytest.raises(TypeError, match="'name'"):
            log.log(1, {"name": "text"})
        with pytest.raises(ValueError, match="'split'"):
            log.log(1, {"split": 1.0})
        with pytest.raises(ValueError, match="integer"):
            log.log(1.5, {"loss": 1.0})
    assert os.path.getsize(log.path) == 0   # nothing half-written
    assert to_float("x", np.bool_(True)) == 1.0


def test_resume_drops_rows_after_the_checkpoint_and_read_metrics_keeps_the_last(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for s in range(1, 6):
            log.log(s, {"loss": float(s)})
        log.log(4, {"loss": 0.5}, split="eval")
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss"')   # cut short by a kill
    with MetricsLogger(tmp_path, resume_step=3) as log:
        log.log(4, {"loss": 40.0})
    rows = read_metrics(tmp_path)
    assert [(r["split"], r["step"], r["loss"]) for r in rows] == [
        ("train", 1, 1.0), ("train", 2, 2.0), ("train", 3, 3.0), ("train", 4, 40.0)]
    assert read_metrics(tmp_path, split="eval") == []
    with MetricsLogger(tmp_path, resume_step=0):
        pass
    assert os.path.getsize(tmp_path / "metrics.jsonl") == 0
    with pytest.raises(ValueError, match="resume_step"):
        MetricsLogger(tmp_path, resume_step=-1)


def test_tensorboard_needs_tensorboardx_and_names_the_extra(tmp_path, monkeypatch):
    def missing():
        raise ImportError("MetricsLogger(tensorboard=True) needs the tensorboardX package: "
                          "pip install 'jmamba[tensorboard]'")
    monkeypatch.setattr(metrics_log, "_tensorboardx_writer", missing)
    with pytest.raises(ImportError, match=r"jmamba\[tensorboard\]"):
        MetricsLogger(tmp_path / "tb", tensorboard=True)
    assert not (tmp_path / "tb").exists()


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboardX", reason="the jmamba[tensorboard] extra (tensorboardX) is not installed")
    with MetricsLogger(tmp_path, tensorboard=True) as log:
        log.log(1, {"loss": 3.0, "lr": 0.1})
        log.log(2, {"loss": 2.0})
        log.log(2, {"loss": 2.5}, split="eval")
    files = os.listdir(tmp_path / "tensorboard")
    assert any(f.startswith("events.out.tfevents") for f in files), files
    scalars = {}
    for name in files:
        for event in read_events(tmp_path / "tensorboard" / name):
            for v in event.summary.value:
                scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    assert scalars == {"train/loss": [(1, 3.0), (2, 2.0)], "train/lr": [(1, pytest.approx(0.1))],
                       "eval/loss": [(2, 2.5)]}


def read_events(path):
    """The Event protos of a TFRecord events file (length, crc, data, crc), read with tensorboardX's proto."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    data = open(path, "rb").read()
    i = 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        event = Event()
        event.ParseFromString(data[i + 12:i + 12 + n])
        yield event
        i += 12 + n + 4


def test_learning_rate_is_the_one_the_last_update_used():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 10, end_value=1e-3)
    assert learning_rate(schedule, 0) == float(schedule(0))
    assert learning_rate(schedule, jnp.asarray(4)) == float(schedule(3))
    assert learning_rate(0.5, 7) == 0.5
    assert learning_rate_from_opt_state(optax.adamw(1e-3).init({"w": jnp.ones(2)})) is None

    # cross-check against optax.inject_hyperparams, which stores the rate each update used, through
    # the train step (a skipped step advances neither)
    lm = MambaLM(Mamba1Config(d_model=8, n_layers=1, d_state=4, d_conv=2), 11, rngs=nnx.Rngs(0))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=schedule))
    state = TrainState.create(lm, opt, 2)
    step = make_train_step(lm, opt, loss_fn=next_token_loss)
    ids = np.arange(12, dtype=np.int32).reshape(2, 6) % 11
    for i in range(5):
        batch = {"inputs": ids, "targets": np.roll(ids, -1, 1)}
        if i == 2:   # a non-finite loss: skipped
            batch["loss_mask"] = np.full(ids.shape, np.nan, np.float32)
        state, m = step(state, batch)
        assert bool(m["skipped"]) == (i == 2)
        np.testing.assert_allclose(learning_rate(schedule, m["updates"]),
                                   learning_rate_from_opt_state(state.opt_state), rtol=1e-6)
    assert int(state.updates) == 4
