"""Tokenizers for the main job: bytes (vocabulary 256) or a Hugging Face `tokenizer.json`.

    tok = load_tokenizer(None)                 # ByteTokenizer: text -> UTF-8 bytes
    tok = load_tokenizer("tokenizer.json")     # HFTokenizer (needs the `jmamba[hf]` extra: tokenizers)
    ids = tok.encode("def f():")               # int32 [n]
    text = tok.decode(ids)

Both have `vocab_size`, `name`, `encode(text | bytes) -> int32 array`, `decode(ids) -> str`,
`eos_id` (None for bytes; the tokenizer's end-of-text token when it has one of the usual names)
and `fingerprint()`, a small JSON-able dict the main job stores in its checkpoints so that a resume
with another tokenizer is refused.

An HF tokenizer encodes without adding special tokens (the text is raw training data; a
post-processor's BOS/EOS would land in the middle of the stream); its vocabulary size includes the
added tokens. Bytes given to `HFTokenizer.encode` are decoded as UTF-8 (invalid bytes replaced).
"""

from __future__ import annotations

import hashlib

import numpy as np

VOCAB_BYTES = 256
# the names end-of-text tokens usually have, in the order they are looked for
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255."""

    name = "bytes"
    vocab_size = VOCAB_BYTES
    eos_id = None
    unit = "byte"

    def encode(self, text) -> np.ndarray:
        if isinstance(text, str):
            text = text.encode("utf-8")
        return np.frombuffer(bytes(text), np.uint8).astype(np.int32)

    def decode(self, ids) -> str:
        return bytes(np.asarray(ids, np.int64).astype(np.uint8).tolist()).decode("utf-8", errors="replace")

    def fingerprint(self) -> dict:
        return {"kind": "bytes", "vocab_size": VOCAB_BYTES}


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from a `tokenizer.json` file."""

    unit = "token"

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(f"reading {path} needs the tokenizers package: pip install 'jmamba[hf]' "
                              "(or pip install tokenizers)") from None
        self.path = str(path)
        try:
            self._tok = Tokenizer.from_file(self.path)
        except Exception as e:   # noqa: BLE001 - tokenizers raises its own Exception type
            raise ValueError(f"{path} is not a tokenizers tokenizer.json ({type(e).__name__}: {e})") from None
        with open(self.path, "rb") as f:
            self._sha256 = hashlib.sha256(f.read()).hexdigest()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        if self.vocab_size < 1:
            raise ValueError(f"{path}: the tokenizer has an empty vocabulary")
        self.eos_id = next((self._tok.token_to_id(t) for t in EOS_NAMES if self._tok.token_to_id(t) is not None),
                           None)
        self.name = f"tokenizer.json ({self.vocab_size} tokens)"

    def encode(self, text) -> np.ndarray:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def fingerprint(self) -> dict:
        return {"kind": "hf", "vocab_size": self.vocab_size, "sha256": self._sha256}


def load_tokenizer(path=None):
    """`ByteTokenizer()` for None (or "bytes"), else an `HFTokenizer` of the tokenizer.json at `path`."""
    if path is None or path == "bytes":
        return ByteTokenizer()
    return HFTokenizer(path)
