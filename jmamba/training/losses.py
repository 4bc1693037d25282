"""Language-model losses for `make_train_step(loss_fn=...)`.

`next_token_loss(logits, batch)`: mean cross entropy (nats per token) of `batch["targets"]`, over
the positions where `batch["loss_mask"]` is True when the batch has one (the padding that
`jmamba.data.packing.pack_documents` adds at the end of its streams), else over all positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.ops import log_sum_exp

f32 = jnp.float32


def per_token_loss(logits, targets):
    """[B, T] float32 cross entropy of the integer `targets` under `logits [B, T, V]`.

    Computed in float32 whatever the logits' dtype (`jmamba.ops.log_sum_exp`: one pass over the
    logits, the row's running max subtracted), with a
    hand-written backward: d logits = (softmax − onehot(targets))·g formed in float32 and rounded once
    to the logits' dtype, in one pass over the logits (autodiff of the float32 formula wrote a
    [B, T, V] float32 softmax, scattered the one-hot into it and converted it back: 3 passes and
    4 bytes per logit of transient memory, 3.1 GiB at B=8, T=2048, V=50280). Targets outside [0, V)
    give NaN, as `optax.softmax_cross_entropy_with_integer_labels` (its gather fills with NaN).
    """
    if not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
        raise TypeError(f"logits must be a float array, got dtype {jnp.result_type(logits)}")
    if not jnp.issubdtype(jnp.result_type(targets), jnp.integer):
        raise TypeError(f"targets must be an integer array, got dtype {jnp.result_type(targets)}")
    if jnp.shape(targets) != jnp.shape(logits)[:-1]:
        raise ValueError(f"targets must have shape {jnp.shape(logits)[:-1]} (logits without the vocab "
                         f"axis), got {jnp.shape(targets)}")
    return _cross_entropy(logits, targets)


@jax.custom_vjp
def _cross_entropy(logits, targets):
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    lse = log_sum_exp(logits)               # reads the logits in their own dtype, once
    vocab = logits.shape[-1]
    inside = (targets >= 0) & (targets < vocab)
    picked = jnp.take_along_axis(logits, jnp.clip(targets, 0, vocab - 1)[..., None], axis=-1)[..., 0].astype(f32)
    ce = jnp.where(inside, lse - picked, jnp.nan)
    return ce, (logits, targets, lse)


def _cross_entropy_bwd(res, g):
    logits, targets, lse = res
    p = jnp.exp(logits.astype(f32) - lse[..., None])
    hit = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
    d = (jnp.where(hit, p - 1.0, p) * g.astype(f32)[..., None]).astype(logits.dtype)
    return d, None


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


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
