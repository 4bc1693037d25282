"""The default training corpus: Python standard-library sources read from the running interpreter.

Nothing is downloaded: every CPython installation carries these files. The text is treated as bytes
(vocabulary 256), so any file works and no tokenizer is needed.
"""

from __future__ import annotations

import os
import sysconfig

import numpy as np

# Plain, mostly prose-and-code modules present in every CPython >= 3.12.
DEFAULT_MODULES = ("textwrap.py", "string.py", "fractions.py", "heapq.py", "bisect.py", "colorsys.py",
                   "shlex.py", "graphlib.py", "statistics.py", "difflib.py", "calendar.py", "functools.py")
VOCAB_SIZE = 256


def default_corpus_bytes(max_bytes: int | None = None) -> bytes:
    """Concatenated standard-library sources (a few hundred KB)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    parts = []
    for name in DEFAULT_MODULES:
        path = os.path.join(stdlib, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                parts.append(f.read())
    if not parts:
        raise FileNotFoundError(f"no standard-library sources found under {stdlib}")
    data = b"\n".join(parts)
    return data[:max_bytes] if max_bytes else data


def load_text_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 2:
        raise ValueError(f"{path}: need at least 2 bytes of text, got {len(data)}")
    return data


def encode(text: str | bytes) -> np.ndarray:
    """Text -> uint8 token ids."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return np.frombuffer(text, np.uint8).astype(np.int32)


def decode(ids) -> str:
    return bytes(np.asarray(ids, np.uint8).tolist()).decode("utf-8", errors="replace")
