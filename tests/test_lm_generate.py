"""MambaLM (tied / untied head), generate (greedy, sampling filters), weight files, the main job."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import numpy_mamba1 as npm
from helpers import assert_close
from jmamba import Mamba1Config, Mamba3Config, MambaLM, generate, load_safetensors, save_safetensors
from jmamba.sampling import sample_next

CFG = Mamba1Config(d_model=8, n_layers=2, d_state=4, d_conv=3)


@pytest.mark.parametrize("tie", [True, False])
def test_lm_logits_match_numpy(tie):
    lm = MambaLM(CFG, 11, tie_embeddings=tie, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 11, size=(2, 7)))
    logits, _ = nnx.jit(lambda m, i: m(i))(lm, ids)
    p = nnx.to_pure_dict(nnx.state(lm, nnx.Param))
    emb = np.asarray(p["embedding"], np.float64)
    y, _ = npm.backbone_forward(p["backbone"], emb[np.asarray(ids)], CFG)
    head = emb.T if tie else np.asarray(p["lm_head"]["kernel"], np.float64)
    assert logits.shape == (2, 7, 11) and logits.dtype == jnp.float32
    assert_close("logits", logits, y @ head, 1e-5)
    assert ("lm_head" in p) == (not tie)


CFG3 = Mamba3Config(d_model=16, n_layers=2, d_state=8, headdim=8)


@pytest.mark.parametrize("cfg", [CFG, CFG3], ids=["mamba1", "mamba3"])
def test_lm_step_matches_call(cfg):
    lm = MambaLM(cfg, 11, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 11, size=(2, 6)))
    full, _ = lm(ids)
    state = lm.init_state(2)
    for t in range(6):
        lt, state = lm.step(ids[:, t], state)
        assert_close(f"step {t}", lt, full[:, t], 1e-5)


def manual_greedy(lm, prompt, n):
    """Greedy by full recomputation: the whole (zero-padded) sequence is re-run for every token.

    Causality makes the padding after position t irrelevant to the logits at t, so one compiled
    forward of fixed length serves every step."""
    bsz, p = prompt.shape
    ids = jnp.zeros((bsz, p + n), jnp.int32).at[:, :p].set(prompt)
    fwd = nnx.jit(lambda m, x: m(x)[0])
    for t in range(p, p + n):
        logits = fwd(lm, ids)
        ids = ids.at[:, t].set(jnp.argmax(logits[:, t - 1], -1).astype(jnp.int32))
    return ids


@pytest.mark.parametrize("cfg", [CFG, CFG3], ids=["mamba1", "mamba3"])
def test_generate_greedy_equals_full_recompute(cfg):
    lm = MambaLM(cfg, 13, rngs=nnx.Rngs(2))
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, 13, size=(3, 4)), jnp.int32)
    out = generate(lm, prompt, 6)
    assert out.shape == (3, 10)
    np.testing.assert_array_equal(out, manual_greedy(lm, prompt, 6))
    np.testing.assert_array_equal(generate(lm, prompt, 0), prompt)


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    draw = lambda **kw: np.array([int(sample_next(logits, k, **kw)[0]) for k in keys[:200]])
    assert set(draw(temperature=1.0, top_k=1)) == {0}
    assert set(draw(temperature=1.0, top_k=2)) <= {0, 1}
    assert set(draw(temperature=1.0, top_p=0.7)) <= {0, 1}          # 0.5 + 0.3 reaches 0.7
    assert set(draw(temperature=1.0, top_p=0.4)) == {0}
    assert len(set(draw(temperature=1.0))) >= 3
    assert int(sample_next(logits, keys[0], temperature=0.0)[0]) == 0


def test_generate_sampling_is_reproducible_and_validated():
    lm = MambaLM(CFG, 13, rngs=nnx.Rngs(2))
    prompt = jnp.zeros((2, 3), jnp.int32)
    a = generate(lm, prompt, 5, temperature=0.9, top_k=5, top_p=0.9, rng=jax.random.PRNGKey(7))
    b = generate(lm, prompt, 5, temperature=0.9, top_k=5, top_p=0.9, rng=jax.random.PRNGKey(7))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="rng"):
        generate(lm, prompt, 5, temperature=0.9)
    with pytest.raises(ValueError, match="top_k"):
        generate(lm, prompt, 5, temperature=0.9, top_k=0, rng=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="top_p"):
        generate(lm, prompt, 5, temperature=0.9, top_p=1.5, rng=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="prompt_ids"):
        generate(lm, jnp.zeros((3,), jnp.int32), 5)
    with pytest.raises(ValueError, match=r"prompt_ids must lie in \[0, 13\)"):
        generate(lm, jnp.full((1, 2), 13, jnp.int32), 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(lm, prompt, -1)


def test_lm_config_validation():
    with pytest.raises(ValueError, match="input_dim"):
        MambaLM(Mamba1Config(d_model=8, input_dim=3), 10, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="vocab_size"):
        MambaLM(CFG, 0, rngs=nnx.Rngs(0))
    lm = MambaLM(CFG, 10, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="input_ids"):
        lm(jnp.zeros((2, 3), jnp.float32))


def test_safetensors_round_trip(tmp_path):
    lm = MambaLM(CFG, 10, tie_embeddings=False, rngs=nnx.Rngs(0))
    params = nnx.state(lm, nnx.Param)
    path = os.path.join(tmp_path, "w.safetensors")
    save_safetensors(path, params, lm.config)
    loaded, cfg = load_safetensors(path)
    assert cfg == lm.config
    lm2 = MambaLM(cfg.backbone, cfg.vocab_size, tie_embeddings=cfg.tie_embeddings, rngs=nnx.Rngs(5))
    p2 = nnx.state(lm2, nnx.Param)
    nnx.replace_by_pure_dict(p2, loaded)
    nnx.update(lm2, p2)
    ids = jnp.zeros((1, 4), jnp.int32)
    np.testing.assert_array_equal(lm2(ids)[0], lm(ids)[0])
    assert not any(name.startswith(".") for name in os.listdir(tmp_path)) and len(os.listdir(tmp_path)) == 1
    with pytest.raises(FileNotFoundError):
        load_safetensors(os.path.join(tmp_path, "missing.safetensors"))


def test_main_job_trains_checkpoints_and_resumes(tmp_path, capsys):
    from jmamba.train_char_lm import main
    from jmamba.training.metrics_log import read_metrics
    out = os.path.join(tmp_path, "run")
    common = ["--d-model", "32", "--seq-len", "32", "--batch-size", "8", "--sample-tokens", "20", "--out", out,
              "--eval-every", "20"]
    assert main(["--steps", "40", "--ckpt-every", "15", *common]) == 0
    text = capsys.readouterr().out
    for name in ("model.safetensors", "config.json", "loss.png", "metrics.jsonl"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert sorted(os.listdir(os.path.join(out, "checkpoints")), key=int) == ["15", "30", "40"]
    first, last = [float(v) for v in text.split("loss: first step ")[1].split(" nats")[0].split(" -> last ")]
    assert last < first - 0.8, text
    assert "---- sample ----" in text
    train, evals = read_metrics(out, split="train"), read_metrics(out, split="eval")
    assert [r["step"] for r in train] == list(range(1, 41)) and [r["step"] for r in evals] == [20, 40]
    for key in ("loss", "lr", "grad_norm", "skipped", "updates"):
        assert all(isinstance(r[key], float) for r in train), key
    assert all(isinstance(r["tokens_per_s"], float) for r in train[1:])
    assert train[0]["lr"] == 0.0 and train[-1]["lr"] > 0   # warm-up from 0
    assert evals[-1]["loss"] < evals[0]["loss"] and f"held-out loss: {evals[-1]['loss']:.3f}" in text
    # the saved pretrained model is the trained one
    lm = MambaLM.from_pretrained(out)
    ckpt = MambaLM.from_pretrained(os.path.join(out, "checkpoints"))
    ids = jnp.asarray(np.arange(12, dtype=np.int32).reshape(1, 12))
    np.testing.assert_array_equal(lm(ids)[0], ckpt(ids)[0])

    assert main(["--steps", "45", *common]) == 0
    text = capsys.readouterr().out
    assert "resumed from" in text and "at step 40" in text
    assert "45" in os.listdir(os.path.join(out, "checkpoints"))
    assert [r["step"] for r in read_metrics(out, split="eval")] == [20, 40, 45]
    assert [r["step"] for r in read_metrics(out, split="train")] == list(range(1, 46))
    assert main(["--steps", "80", *[c if c != "32" else "48" for c in common[:2]], *common[2:]]) == 2
    err = capsys.readouterr().err
    assert "d_model" in err and "--fresh" in err


def test_main_job_mamba3(tmp_path, capsys):
    from jmamba.train_char_lm import main
    out = os.path.join(tmp_path, "run3")
    assert main(["--arch", "mamba3", "--steps", "40", "--d-model", "32", "--d-state", "16", "--headdim", "16",
                 "--seq-len", "32", "--batch-size", "8", "--sample-tokens", "10", "--out", out]) == 0
    text = capsys.readouterr().out
    first, last = [float(v) for v in text.split("loss: first step ")[1].split(" nats")[0].split(" -> last ")]
    assert last < first - 1.0, text
