"""The README's example runs as written."""

import os
import re

README = os.path.join(os.path.dirname(__file__), "..", "README.md")


def test_readme_example_runs():
    text = open(README).read()
    block = re.search(r"## A short example\s+```python\n(.*?)```", text, re.S)
    assert block, "README has a python example"
    scope = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)
    assert int(scope["train_state"].step) == 2
    assert scope["trained"] is not None and scope["y_trained"].shape == (8, 64, 64)
    assert scope["y"].shape == (8, 64, 64)
