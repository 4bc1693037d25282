"""Language-model losses for `make_train_step(loss_fn=...)`.

`next_token_loss(logits, batch)`: mean cross entropy (nats per token) of `batch["targets"]`, over
the positions where `batch["loss_mask"]` is True when the batch has one (the padding that
`jmamba.data.packing.pack_documents` adds at the end of its streams), else over all positions.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

f32 = jnp.float32


def per_token_loss(logits, targets):
    """[B, T] float32 cross entropy of the integer `targets` under `logits [B, T, V]`."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(f32), targets)


def next_token_loss(logits, batch):
    """Mean next-token cross entropy over the batch's (unmasked) positions.

    With a `loss_mask`, the mean is sum(ce · mask) / max(sum(mask), 1): a window of padding only has
    loss 0 and zero gradients (the optimizer still takes its step: weight decay and moments move).
    """
    ce = per_token_loss(logits, batch["targets"])
    mask = batch.get("loss_mask")
    if mask is None:
        return ce.mean()
    mask = jnp.asarray(mask, f32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
