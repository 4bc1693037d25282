"""Robust training: each failure a new user hit (the issue's probe list) with the test that catches it.

Nothing non-finite reaches the weights or the carried state, every bad input gets a ValueError /
TypeError naming the argument before anything changes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmamba
from jmamba.io.safetensors_io import flatten_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M1 = jmamba.Mamba1Config(d_model=8, n_layers=2, d_state=4)
M1_IN = jmamba.Mamba1Config(d_model=8, n_layers=1, d_state=4, input_dim=3)
VOCAB = 11


def tiny_lm(seed=0, cfg=M1):
    return jmamba.MambaLM(cfg, VOCAB, rngs=nnx.Rngs(seed))


def ce(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def host_batch(seed=0, bsz=2, T=6):
    ids = np.random.default_rng(seed).integers(0, VOCAB, (bsz, T + 1)).astype(np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def snapshot(state):
    return [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state, state.step, state.updates,
                                                    state.grad_accum))]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def all_params_finite(state):
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.params))


# ------------------------------------------------------------------ 1. token ids out of range
@pytest.mark.parametrize("bad_id", [VOCAB, -1])
def test_out_of_range_ids_raise_on_eager_call_and_host_batch(bad_id):
    lm = tiny_lm()
    ids = np.zeros((2, 5), np.int32)
    ids[1, 3] = bad_id
    with pytest.raises(ValueError, match=r"input_ids\[1, 3\]"):
        lm(jnp.asarray(ids))
    opt = optax.adam(1e-2)
    state = jmamba.TrainState.create(lm, opt, 2)
    step = jmamba.make_train_step(lm, opt, loss_fn=ce, donate=False)
    before = snapshot(state)
    with pytest.raises(ValueError, match=r"batch\['inputs'\]\[1, 3\]"):
        step(state, {"inputs": ids, "targets": np.zeros_like(ids)})
    assert same(snapshot(state), before)


@pytest.mark.parametrize("bad_id", [VOCAB, -1])
def test_out_of_range_ids_on_device_are_skipped_never_wrapped(bad_id):
    lm = tiny_lm()
    opt = jmamba.fused_adamw(1e-2)
    state = jmamba.TrainState.create(lm, opt, 2)
    step = jmamba.make_train_step(lm, opt, loss_fn=ce, donate=False)
    batch = {k: jnp.asarray(v) for k, v in host_batch().items()}
    batch["inputs"] = batch["inputs"].at[0, 2].set(bad_id)
    before = snapshot(state)
    state2, m = step(state, batch)
    assert bool(m["skipped"]) and int(m["invalid_tokens"]) == 1
    assert same(snapshot(state2), before) and int(state2.consecutive_skips) == 1
    assert all_params_finite(state2)
    # the row with the bad id restarts from zeros, the other row carries on
    assert int(m["state_rows_reset"]) == 1
    for leaf in jax.tree.leaves(state2.recurrent_state):
        assert bool(jnp.all(leaf[0] == 0)) and bool(jnp.all(jnp.isfinite(leaf)))
    # a good batch afterwards is applied and resets the skip count
    state3, m3 = step(state2, {k: jnp.asarray(v) for k, v in host_batch(1).items()})
    assert not bool(m3["skipped"]) and int(state3.consecutive_skips) == 0 and int(state3.step) == 1


# ------------------------------------------------------------------ 2./3. NaN in the batch
@pytest.mark.parametrize("precision", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("optimizer", ["fused", "optax"])
def test_one_nan_in_the_batch_skips_the_step_and_restarts_only_that_row(precision, optimizer):
    model = jmamba.Mamba1Backbone(M1_IN, rngs=nnx.Rngs(0))
    opt = jmamba.fused_adamw(1e-2) if optimizer == "fused" else optax.adamw(1e-2)
    state = jmamba.TrainState.create(model, opt, 3, precision=precision)
    step = jmamba.make_train_step(model, opt, loss_fn=lambda y, b: jnp.mean(y ** 2), precision=precision,
                                  clip_max_norm=1.0, donate=False)
    r = np.random.default_rng(0)
    good = lambda: {"inputs": jnp.asarray(r.normal(size=(3, 5, 3)), jnp.float32)}   # noqa: E731
    state, _ = step(state, good())                      # a carried state to keep
    before = snapshot(state)
    carried = [np.asarray(x) for x in jax.tree.leaves(state.recurrent_state)]
    bad = good()
    bad["inputs"] = bad["inputs"].at[1, 2, 0].set(jnp.nan)
    state2, m = step(state, bad)
    assert bool(m["skipped"]) and same(snapshot(state2), before)
    assert int(m["state_rows_reset"]) == 1 and int(state2.consecutive_skips) == 1
    for leaf, old in zip(jax.tree.leaves(state2.recurrent_state), carried):
        leaf = np.asarray(leaf)
        assert np.all(np.isfinite(leaf)) and np.all(leaf[1] == 0)
        assert not np.array_equal(leaf[0], old[0])      # the good rows advanced through the window
    if precision == "f16":
        assert bool(m["overflow_skipped"]) and float(state2.loss_scale.scale) == float(state.loss_scale.scale) / 2
    # training goes on: the next clean window is applied
    state3, m3 = step(state2, good())
    assert not bool(m3["skipped"]) and int(state3.step) == int(state.step) + 1 and all_params_finite(state3)


def test_guard_off_gives_the_raw_behaviour():
    model = jmamba.Mamba1Backbone(M1_IN, rngs=nnx.Rngs(0))
    opt = optax.sgd(0.1)
    state = jmamba.TrainState.create(model, opt, 2)
    step = jmamba.make_train_step(model, opt, loss_fn=lambda y, b: jnp.mean(y ** 2), nonfinite_guard=False,
                                  donate=False)
    x = jnp.ones((2, 4, 3)).at[0, 0, 0].set(jnp.nan)
    state2, m = step(state, {"inputs": x})
    assert not bool(m["skipped"]) and not all_params_finite(state2)   # NaN went into the weights, as in PyTorch
    with pytest.raises(TypeError, match="nonfinite_guard"):
        jmamba.make_train_step(model, opt, nonfinite_guard="yes")


def test_split_api_guard_and_accumulation_keep_the_accumulator():
    model = jmamba.Mamba1Backbone(M1_IN, rngs=nnx.Rngs(0))
    opt = optax.adam(1e-2)
    state = jmamba.TrainState.create(model, opt, 2, accumulate=True)
    x = jnp.ones((2, 4, 3))
    out, ctx, state = jmamba.forward(model, state, {"inputs": x})
    state, _ = jmamba.backward_step(opt, state, ctx, out / 8, accumulate_only=True)
    accum = [np.asarray(a) for a in jax.tree.leaves(state.grad_accum)]
    out, ctx, state = jmamba.forward(model, state, {"inputs": x.at[0, 1, 1].set(jnp.inf)})
    assert int(ctx.state_rows_reset) == 1
    state, m = jmamba.backward_step(opt, state, ctx, out / 8, accumulate_only=True)
    assert bool(m["skipped"]) and same([np.asarray(a) for a in jax.tree.leaves(state.grad_accum)], accum)


# ------------------------------------------------------------------ 4. strict weight loading
def test_load_weights_is_strict_and_leaves_the_model_untouched_on_error(tmp_path):
    src, dst = tiny_lm(0), tiny_lm(1)
    path = str(tmp_path / "w.safetensors")
    jmamba.save_safetensors(path, nnx.state(src, nnx.Param), src.config)
    before = flatten_params(nnx.state(dst, nnx.Param))
    flat = flatten_params(nnx.state(src, nnx.Param))
    cases = {
        "missing": ({k: v for k, v in flat.items() if k != "embedding"}, "missing 1: \\['embedding'\\]"),
        "unexpected": ({**flat, "extra.weight": np.zeros(2, np.float32)}, "unexpected 1: \\['extra.weight'\\]"),
        "shape": ({**flat, "embedding": np.zeros((3, 3), np.float32)}, "embedding: shape \\(3, 3\\)"),
        "dtype": ({**flat, "embedding": flat["embedding"].astype(np.float16)}, "embedding: dtype float16"),
        "nan": ({**flat, "embedding": np.full_like(flat["embedding"], np.nan)}, "embedding: holds non-finite"),
    }
    for name, (tensors, msg) in cases.items():
        with pytest.raises(ValueError, match=msg):
            jmamba.load_weights(dst, tensors)
        after = flatten_params(nnx.state(dst, nnx.Param))
        assert all(np.array_equal(after[k], before[k]) for k in before), name
    report = jmamba.load_weights(dst, path)
    after = flatten_params(nnx.state(dst, nnx.Param))
    assert len(report.loaded) == len(flat) and all(np.array_equal(after[k], flat[k]) for k in flat)
    # strict=False: a documented partial load; a wrong shape still refuses
    dst2 = tiny_lm(2)
    keep = flatten_params(nnx.state(dst2, nnx.Param))["embedding"]
    report = jmamba.load_weights(dst2, cases["missing"][0] | {"extra": np.zeros(1, np.float32)}, strict=False)
    assert report.missing == ("embedding",) and report.unexpected == ("extra",)
    assert np.array_equal(flatten_params(nnx.state(dst2, nnx.Param))["embedding"], keep)
    with pytest.raises(ValueError, match="shape"):
        jmamba.load_weights(dst2, cases["shape"][0], strict=False)
    with pytest.raises(TypeError, match="source"):
        jmamba.load_weights(dst2, 3)


# ------------------------------------------------------------------ 5. empty windows
@pytest.mark.parametrize("arch", ["mamba1", "mamba3"])
def test_empty_window_passes_the_state_through(arch):
    cfg = (jmamba.Mamba1Config(d_model=8, n_layers=1, d_state=4) if arch == "mamba1"
           else jmamba.Mamba3Config(d_model=8, n_layers=1, d_state=4, headdim=4))
    model = jmamba.get_architecture(arch).backbone_cls(cfg, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 8)), jnp.float32)
    _, state = model(x)
    y, state2 = model(jnp.zeros((2, 0, 8)), state)
    assert y.shape == (2, 0, 8)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state2)):
        assert np.array_equal(a, b)


# ------------------------------------------------------------------ 6. values that used to pass
def test_nan_and_inf_settings_are_refused():
    lm = tiny_lm()
    with pytest.raises(ValueError, match="temperature"):
        jmamba.generate(lm, jnp.zeros((1, 2), jnp.int32), 3, temperature=float("nan"), rng=jax.random.key(0))
    with pytest.raises(ValueError, match="dt_init_floor"):
        jmamba.Mamba1Config(dt_init_floor=float("inf")).validate()
    with pytest.raises(ValueError, match="learning_rate schedule"):
        jmamba.fused_adamw(lambda count: jnp.nan)
    with pytest.raises(ValueError, match="learning_rate schedule"):
        jmamba.fused_adamw(lambda count: -1.0)
    with pytest.raises(ValueError, match="eps"):
        jmamba.fused_adamw(1e-3, eps=0.0)


@pytest.mark.parametrize("bad", [float("nan"), -1e-3])
@pytest.mark.parametrize("fused_path", [True, False])
def test_a_schedule_that_turns_bad_later_changes_nothing(bad, fused_path):
    schedule = lambda count: jnp.where(count == 1, bad, 1e-2)   # noqa: E731  (good at 0 and 2)
    model = jmamba.Mamba1Backbone(M1_IN, rngs=nnx.Rngs(0))
    fused = jmamba.fused_adamw(schedule)
    opt = fused if fused_path else optax.chain(fused, optax.identity())   # not last in a chain: update path
    for guard in (True, False):
        state = jmamba.TrainState.create(model, opt, 2)
        step = jmamba.make_train_step(model, opt, loss_fn=lambda y, b: jnp.mean(y ** 2), donate=False,
                                      nonfinite_guard=guard)
        x = {"inputs": jnp.ones((2, 4, 3))}
        state, m0 = step(state, x)
        before = [np.asarray(a) for a in jax.tree.leaves((state.params, state.opt_state))]
        state, m1 = step(state, x)
        after = [np.asarray(a) for a in jax.tree.leaves((state.params, state.opt_state))]
        assert not bool(m0["skipped"]) and same(after, before) and all_params_finite(state)
        # the fused apply also reports it; through `update` it is a zero update (the count stays)
        assert bool(m1["skipped"]) == fused_path
        # the optimizer's count did not advance, so the schedule is asked again for the same count:
        # refused again, and the fused path counts the skips in a row
        state, m2 = step(state, x)
        assert same([np.asarray(a) for a in jax.tree.leaves((state.params, state.opt_state))], before)
        assert int(m2["consecutive_skips"]) == (2 if fused_path else 0)


def test_a_skipped_applying_call_drops_its_window_and_the_next_window_starts_from_zeros():
    model = jmamba.Mamba1Backbone(M1_IN, rngs=nnx.Rngs(0))
    opt = optax.sgd(0.1)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 3)), jnp.float32)

    def window(state, d_out_last):
        out, ctx, state = jmamba.forward(model, state, {"inputs": x})
        state, _ = jmamba.backward_step(opt, state, ctx, out / 8, accumulate_only=True)
        out, ctx, state = jmamba.forward(model, state, {"inputs": x})
        return jmamba.backward_step(opt, state, ctx, d_out_last(out))

    state = jmamba.TrainState.create(model, opt, 2, accumulate=True)
    before = [np.asarray(p) for p in jax.tree.leaves(state.params)]
    state, m = window(state, lambda out: (out / 8).at[0, 0, 0].set(jnp.nan))
    assert bool(m["skipped"]) and same([np.asarray(p) for p in jax.tree.leaves(state.params)], before)
    carried = jax.tree.map(jnp.copy, state.recurrent_state)
    state, m = window(state, lambda out: out / 8)          # must not include the dropped window
    fresh = jmamba.TrainState.create(model, opt, 2, accumulate=True).replace(recurrent_state=carried)
    fresh, m_fresh = window(fresh, lambda out: out / 8)
    assert abs(float(m["grad_norm"]) - float(m_fresh["grad_norm"])) <= 1e-6 * float(m_fresh["grad_norm"])


def test_multisteps_with_clip_max_norm_is_refused_with_the_fix():
    model = jmamba.Mamba1Backbone(M1_IN, rngs=nnx.Rngs(0))
    opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    with pytest.raises(ValueError, match="clip_by_global_norm"):
        jmamba.make_train_step(model, opt, clip_max_norm=1.0)


def test_main_job_survives_skipped_steps_and_resumes_where_it_stopped(tmp_path, monkeypatch):
    from jmamba import train_char_lm
    from jmamba.data.streams import StreamBatcher

    real_next = StreamBatcher.next
    calls = {"n": 0}

    def poisoned_next(self):
        calls["n"] += 1
        batch = real_next(self)
        if calls["n"] == 3:                              # an id the device-side guard must skip
            batch["inputs"] = batch["inputs"].copy()
            batch["inputs"][0, 0] = 10_000
        return batch

    monkeypatch.setattr(StreamBatcher, "next", poisoned_next)
    out = str(tmp_path / "run")
    flags = ["--out", out, "--batch-size", "2", "--seq-len", "8", "--d-model", "8", "--n-layers", "1",
             "--sample-tokens", "2", "--ckpt-every", "1", "--eval-every", "0"]
    assert train_char_lm.main(flags + ["--steps", "4"]) == 0
    assert train_char_lm.main(flags + ["--steps", "6"]) == 0
    from jmamba.training.metrics_log import read_metrics
    rows = [r for r in read_metrics(os.path.join(out, "metrics.jsonl"), split="train")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert calls["n"] == 6                                 # exactly --steps train calls over both runs


# ------------------------------------------------------------------ 7. the main job's flags
@pytest.mark.parametrize("flags, flag", [(["--steps", "-5"], "--steps"), (["--lr", "-1"], "--lr"),
                                         (["--temperature", "-1"], "--temperature"),
                                         (["--batch-size", "0"], "--batch-size"),
                                         (["--arch", "mamba3", "--headdim", "7"], "headdim"),
                                         (["--eval-every", "-1"], "--eval-every"),
                                         (["--tokenizer", "no_such_tokenizer.json"], "--tokenizer")])
def test_cli_validates_every_flag_before_any_work(tmp_path, flags, flag, capsys):
    """The command line's `main` in this process (a subprocess per flag would spend its time importing
    JAX; the `python -m jmamba.train_char_lm` entry point itself runs in the next test): exit status 2,
    the flag named on stderr, nothing written."""
    from jmamba import train_char_lm
    out = tmp_path / "run"
    try:
        code = train_char_lm.main(["--out", str(out), *flags])
    except SystemExit as e:   # argparse's parser.error
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and flag in err, err
    assert not out.exists()


def test_cli_resume_with_another_config_says_how_in_one_line(tmp_path):
    out = str(tmp_path / "run")
    common = ["--out", out, "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--d-model", "8",
              "--n-layers", "1", "--sample-tokens", "2", "--ckpt-every", "0"]
    r = subprocess.run([sys.executable, "-m", "jmamba.train_char_lm", *common], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "jmamba.train_char_lm", *common, "--d-model", "16"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(err) == 1 and "--fresh" in err[0] and "Traceback" not in r.stderr


# ------------------------------------------------------------------ 8. corrupt checkpoints
def test_corrupt_or_incomplete_checkpoints_raise_one_named_error(tmp_path):
    model = jmamba.Mamba1Backbone(M1_IN, rngs=nnx.Rngs(0))
    state = jmamba.TrainState.create(model, optax.sgd(0.1), 2)
    d = str(tmp_path / "ck")

    def fresh():
        shutil.rmtree(d, ignore_errors=True)
        return jmamba.save_checkpoint(d, state, config=M1_IN)

    def broken_json(p):
        with open(os.path.join(p, "meta", "metadata"), "w") as f:
            f.write("{not json")

    def no_leaves(p):
        path = os.path.join(p, "meta", "metadata")
        meta = json.load(open(path))
        meta.pop("leaves")
        json.dump(meta, open(path, "w"))

    def truncated_arrays(p):
        for root, _, files in os.walk(os.path.join(p, "state")):
            if os.path.basename(root) == "d":
                for f in files:
                    with open(os.path.join(root, f), "wb") as fh:
                        fh.write(b"xx")

    for damage, what in ((broken_json, "metadata"), (no_leaves, "incomplete"), (truncated_arrays, "arrays")):
        p = fresh()
        damage(p)
        with pytest.raises(jmamba.CheckpointError, match=f"step 0 .*{what}|{what}.*step 0|step 0"):
            jmamba.restore_checkpoint(d, state, config=M1_IN)
    assert issubclass(jmamba.CheckpointError, ValueError)
    fresh()
    with pytest.raises(jmamba.CheckpointMismatchError, match="d_state"):
        jmamba.restore_checkpoint(d, state, config=jmamba.Mamba1Config(d_model=8, n_layers=1, d_state=8, input_dim=3))
