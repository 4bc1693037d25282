"""The examples run and learn (short budgets)."""

import importlib.util
import os

import numpy as np

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_custom_loss_example_learns_through_the_split_api():
    losses = load("custom_loss").main(["--steps", "150"])
    assert np.mean(losses[-20:]) < 0.3 * np.mean(losses[:20])


def test_selective_copying_accuracy_rises_well_above_chance():
    # a shorter task than the example's default (16 positions, 16 sequences a step): ~0.56-0.65 after
    # 160 steps over seeds 0-3 (chance 0.125)
    acc = load("selective_copying").main(["--steps", "160", "--batch-size", "16", "--length", "16"])
    assert acc > 3 * (1 / 8), acc


def test_finetune_hf_example(tmp_path):
    from flax import nnx

    import jmamba
    base = os.path.join(tmp_path, "base")
    jmamba.save_hf_mamba(base, jmamba.MambaLM(jmamba.Mamba1Config(d_model=32, n_layers=2, d_state=8), 256,
                                              rngs=nnx.Rngs(0)))
    text = os.path.join(tmp_path, "t.txt")
    with open(text, "w") as f:
        f.write(open(os.path.join(EXAMPLES, "..", "README.md")).read())
    out = os.path.join(tmp_path, "ft")
    losses = load("finetune_hf").main(["--model", base, "--text", text, "--out", out, "--steps", "40",
                                       "--seq-len", "64", "--lr", "3e-3"])
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0
    tuned = jmamba.load_hf_mamba(out)
    assert tuned.config == jmamba.load_hf_mamba(base).config
