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
