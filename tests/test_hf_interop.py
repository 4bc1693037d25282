"""transformers MambaForCausalLM interop: goldens from transformers 5.17, released configs, bad files."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jmamba import generate
from jmamba.ops import dispatch
from jmamba.interop.hf_mamba import hf_config_to_mamba1, load_hf_mamba, save_hf_mamba
from jmamba.lm import MambaLM

GOLDENS = os.path.join(os.path.dirname(__file__), "goldens")


@pytest.mark.parametrize("case", ["hf_mamba_tied", "hf_mamba_untied"])
@pytest.mark.parametrize("mixer_core", [None, "pallas"], ids=["automatic", "fused-pallas"])
def test_logits_and_greedy_tokens_match_transformers(case, mixer_core):
    """Also through the fused mixer core's Pallas implementation (interpreted on CPU)."""
    path = os.path.join(GOLDENS, case)
    golden = np.load(os.path.join(path, "golden.npz"))
    lm = load_hf_mamba(path)
    assert lm.config.tie_embeddings == (case == "hf_mamba_tied")
    with contextlib.ExitStack() as stack:
        if mixer_core:
            stack.enter_context(dispatch.prefer("mamba1_mixer_core", mixer_core))
        logits, _ = nnx.jit(lambda m, i: m(i))(lm, jnp.asarray(golden["input_ids"]))
    err = float(np.abs(np.asarray(logits) - golden["logits"]).max())
    assert err <= 1e-4, f"max |logit error| {err:.2e}"
    new = golden["greedy"].shape[1] - golden["prompt"].shape[1]
    out = generate(lm, jnp.asarray(golden["prompt"]), new)
    np.testing.assert_array_equal(np.asarray(out), golden["greedy"])


def released_config(d_model, n_layer):
    """config.json of the state-spaces/mamba-*-hf releases (docs/mamba1.md §6.2, §6.7)."""
    return {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": d_model,
            "num_hidden_layers": n_layer, "intermediate_size": 2 * d_model, "state_size": 16, "conv_kernel": 4,
            "expand": 2, "time_step_rank": -(-d_model // 16), "layer_norm_epsilon": 1e-5, "vocab_size": 50280,
            "use_bias": False, "use_conv_bias": True, "residual_in_fp32": True, "hidden_act": "silu",
            "d_model": d_model, "n_layer": n_layer, "rms_norm": True, "fused_add_norm": True,
            "pad_vocab_size_multiple": 8, "ssm_cfg": {}}


@pytest.mark.parametrize("d_model,n_layer,params", [
    (768, 24, 129_135_360), (1024, 48, 371_516_416), (1536, 48, 793_204_224),
    (2048, 48, 1_372_178_432), (2560, 64, 2_768_345_600)])
def test_released_configs_build_with_the_right_parameter_count(d_model, n_layer, params):
    cfg, vocab, tie = hf_config_to_mamba1(released_config(d_model, n_layer))
    assert tie and vocab == 50280 and cfg.resolved_dt_rank == -(-d_model // 16)
    abstract = nnx.eval_shape(lambda: MambaLM(cfg, vocab, tie_embeddings=tie, rngs=nnx.Rngs(0)))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert n == params


def test_save_then_load_round_trips(tmp_path):
    src = load_hf_mamba(os.path.join(GOLDENS, "hf_mamba_untied"))
    save_hf_mamba(tmp_path, src)
    again = load_hf_mamba(tmp_path)
    for a, b in zip(jax.tree.leaves(nnx.state(src, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    ours, theirs = load_file(os.path.join(tmp_path, "model.safetensors")), load_file(
        os.path.join(GOLDENS, "hf_mamba_untied", "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


def copy_case(tmp_path, case="hf_mamba_tied"):
    dst = os.path.join(tmp_path, case)
    shutil.copytree(os.path.join(GOLDENS, case), dst)
    return dst


def edit_tensors(path, fn):
    file = os.path.join(path, "model.safetensors")
    t = dict(load_file(file))
    fn(t)
    save_file(t, file)


def edit_config(path, fn):
    file = os.path.join(path, "config.json")
    cfg = json.load(open(file))
    fn(cfg)
    json.dump(cfg, open(file, "w"))




@pytest.mark.parametrize("mutate,match", [
    (lambda p: os.remove(os.path.join(p, "config.json")), "no config.json"),
    (lambda p: os.remove(os.path.join(p, "model.safetensors")), "no model.safetensors"),
    (lambda p: open(os.path.join(p, "model.safetensors"), "wb").write(b"garbage!"), "not a readable safetensors"),
    (lambda p: open(os.path.join(p, "config.json"), "w").write("{not json"), "not valid JSON"),
    (lambda p: edit_tensors(p, lambda t: t.pop("backbone.layers.1.mixer.D")), "missing tensor 'backbone.layers.1.mixer.D'"),
    (lambda p: edit_tensors(p, lambda t: t.update(extra=np.zeros(3, np.float32))), "unexpected tensors.*extra"),
    (lambda p: edit_tensors(p, lambda t: t.update({"backbone.layers.0.mixer.A_log": np.zeros((32, 5), np.float32)})),
     "A_log must have shape"),
    (lambda p: edit_tensors(p, lambda t: t.update({"backbone.layers.0.mixer.in_proj.bias": np.zeros(64, np.float32)})),
     "use_bias"),
    (lambda p: edit_config(p, lambda c: c.update(tie_word_embeddings=False)), "no 'lm_head.weight'"),
    (lambda p: edit_config(p, lambda c: c.update(intermediate_size=7)), "intermediate_size"),
    (lambda p: edit_config(p, lambda c: c.update(hidden_act="gelu")), "hidden_act"),
    (lambda p: edit_config(p, lambda c: c.update(model_type="falcon_mamba")), "model_type"),
    (lambda p: edit_config(p, lambda c: c.update(num_hidden_layers=3)), "missing tensor 'backbone.layers.2"),
])
def test_bad_checkpoints_raise_clear_errors(tmp_path, mutate, match):
    path = copy_case(tmp_path)
    mutate(path)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load_hf_mamba(path)


def write_bf16_safetensors(file, tensors):
    """Minimal safetensors writer storing float32 arrays as BF16 (truncated), independent of jmamba."""
    import struct
    header, blobs, offset = {}, [], 0
    for k, v in tensors.items():
        bits = (np.ascontiguousarray(v, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        header[k] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [offset, offset + len(bits)]}
        blobs.append(bits)
        offset += len(bits)
    h = json.dumps(header).encode()
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def test_bf16_checkpoint_is_read_and_upcast(tmp_path):
    path = copy_case(tmp_path)
    file = os.path.join(path, "model.safetensors")
    f32 = dict(load_file(file))
    write_bf16_safetensors(file, f32)
    lm = load_hf_mamba(path)
    emb = np.asarray(lm.embedding[...])
    assert emb.dtype == np.float32
    want = (f32["backbone.embeddings.weight"].view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_array_equal(emb, want)
