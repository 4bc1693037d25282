"""`pack_documents`: tokenized documents packed into fixed [B, T] windows, a `reset` at each document start.

    batches = pack_documents(docs, window=T, batch_size=B, eos_id=tok.eos_id)
    for batch in batches:                      # in order: row b of batch k+1 continues row b of batch k
        state, m = train_step(state, batch)    # loss_fn=jmamba.training.losses.next_token_loss

Each batch is `{"inputs", "targets": [B, T] int32, "reset", "loss_mask": [B, T] bool}`.

Layout. The documents are dealt, whole and in the given order, to B streams: each goes to the stream
that is shortest so far (the lowest index on a tie), so the streams end within one document of each
other. A document of n tokens (n + 1 with `eos_id`, which is appended to each) contributes n - 1
positions to its stream: inputs `doc[:-1]`, targets `doc[1:]`; `reset` is True at its first position,
so the recurrent state (SSM state and convolution window) of the previous document is zeroed there.
Stream b is cut into consecutive windows of T positions and window k of it is row b of batch k. A
document longer than the rest of a window continues in the same row of the next batch, which is
exact when the train step carries the recurrent state between batches (it does: `TrainState`). The
end of every stream is padded to the last window: `inputs = targets = pad_id`, `reset` False,
`loss_mask` False; every other position has `loss_mask` True.

Targets at document ends. No position predicts across a boundary: the last token of a document is
only a target (of the token before it), never an input whose target would be the next document's
first token. With `eos_id`, each document ends in EOS, so its last real token learns to predict the
end. Documents of fewer than 2 tokens (after the EOS) have nothing to predict and are left out.

Exactness. A mixer's state entering position t is zeroed where reset[b, t] (both architectures, every
layer, the convolution's left context included), so the outputs at a document's positions are those
of running the document alone from a zero state, and the masked mean of the per-token losses is the
mean over all documents' tokens (tests/test_packing.py checks both, across window boundaries).
"""

from __future__ import annotations

import heapq
import math

import numpy as np


def _check_id(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} must be a token id (an int >= 0), got {v!r}")
    return int(v)


def _check_positive(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def pack_documents(docs, window: int, batch_size: int, *, eos_id=None, pad_id: int = 0) -> list[dict]:
    """Packs documents into windows; returns the list of batches in training order (see the module doc).

    Args:
      docs: a sequence of 1-D integer arrays (token ids >= 0), one per document.
      window: T, positions per row of a batch.
      batch_size: B, rows (parallel streams) of a batch.
      eos_id: appended to every document when given (the last token then predicts it).
      pad_id: the id at padding positions (masked out of the loss; any valid id).

    Raises:
      ValueError when a document is not a 1-D integer array of ids >= 0, or no document has 2 tokens.
    """
    T, B = _check_positive("window", window), _check_positive("batch_size", batch_size)
    eos = None if eos_id is None else _check_id("eos_id", eos_id)
    pad = _check_id("pad_id", pad_id)
    if isinstance(docs, np.ndarray) and docs.ndim == 1 and docs.dtype != object:
        raise ValueError("docs must be a sequence of documents (1-D arrays), got one 1-D array: "
                         "wrap a single document in a list")

    rows = [[] for _ in range(B)]
    heap = [(0, b) for b in range(B)]   # (positions so far, row)
    for i, doc in enumerate(docs):
        d = np.asarray(doc)
        if d.ndim != 1 or (d.size and not np.issubdtype(d.dtype, np.integer)):
            raise ValueError(f"docs[{i}] must be a 1-D integer array of token ids, got shape {d.shape} "
                             f"dtype {d.dtype}")
        if d.size and d.min() < 0:
            raise ValueError(f"docs[{i}] holds a negative token id ({int(d.min())})")
        d = d.astype(np.int32)
        if eos is not None:
            d = np.concatenate([d, np.asarray([eos], np.int32)])
        if len(d) < 2:
            continue
        n, b = heapq.heappop(heap)
        rows[b].append(d)
        heapq.heappush(heap, (n + len(d) - 1, b))
    longest = max(n for n, _ in heap)
    if longest == 0:
        raise ValueError("no document has 2 or more tokens: nothing to predict")

    n_windows = math.ceil(longest / T)
    L = n_windows * T
    inputs = np.full((B, L), pad, np.int32)
    targets = np.full((B, L), pad, np.int32)
    reset = np.zeros((B, L), bool)
    mask = np.zeros((B, L), bool)
    for b, row in enumerate(rows):
        pos = 0
        for d in row:
            n = len(d) - 1
            inputs[b, pos:pos + n] = d[:-1]
            targets[b, pos:pos + n] = d[1:]
            reset[b, pos] = True
            mask[b, pos:pos + n] = True
            pos += n
    cut = lambda a, k: np.ascontiguousarray(a[:, k * T:(k + 1) * T])   # noqa: E731
    return [{"inputs": cut(inputs, k), "targets": cut(targets, k), "reset": cut(reset, k),
             "loss_mask": cut(mask, k)} for k in range(n_windows)]
