"""`StreamBatcher`: B parallel streams over one token array, for training with carried state.

Row b reads consecutive windows starting at offset b·len/B, so the recurrent state carried by the
train step from one window to the next is the true history of that row. When a row wraps around to
the start of the data it is flagged in `reset` (its state is zeroed before the window).
"""

from __future__ import annotations

import numpy as np


class StreamBatcher:
    """Yields `{"inputs": [B, T] int32, "targets": [B, T] int32, "reset": [B] bool}` windows."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, *, position=None):
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if len(tokens) < seq_len + 2:
            raise ValueError(f"need more than seq_len + 1 = {seq_len + 1} tokens, got {len(tokens)}")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        span = len(tokens) - 1
        self.position = (np.arange(batch_size) * (span // batch_size) if position is None
                         else np.asarray(position, np.int64).copy())
        self.fresh = np.ones(batch_size, bool)

    def next(self) -> dict:
        T, span = self.seq_len, len(self.tokens) - 1
        wrap = self.position + T > span
        self.position = np.where(wrap, 0, self.position)
        reset = wrap | self.fresh
        idx = self.position[:, None] + np.arange(T)[None]
        batch = {"inputs": self.tokens[idx], "targets": self.tokens[idx + 1], "reset": reset}
        self.position = self.position + T
        self.fresh[:] = False
        return batch
