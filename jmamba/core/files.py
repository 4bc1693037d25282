"""Reading small files the loaders share, with errors that name the file."""

from __future__ import annotations

import json


def read_json(path):
    """The parsed contents of the JSON file at `path`; ValueError naming the file when it is not valid
    JSON (a missing file raises FileNotFoundError as usual)."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
