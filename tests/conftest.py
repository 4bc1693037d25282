import os
import sys

import jax
import pytest

# numpy references and helpers live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.gpu` tests need a CUDA GPU: they are skipped (and reported as skipped) elsewhere."""
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python3 -m pytest -m gpu tests` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
