"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus).

Order (as mamba-rs): temperature → top-k (−inf outside) → softmax → top-p (smallest prefix of the
sorted distribution whose mass reaches p, renormalised) → sample. Temperature 0 is greedy (argmax,
ties to the lowest index).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def check_sampling_args(temperature, top_k, top_p, vocab_size):
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0
            or not math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, {vocab_size}], got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and not isinstance(top_p, bool) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")


def sample_next(logits, rng, *, temperature=0.0, top_k=None, top_p=None):
    """logits [B, V] float32 -> token ids [B] int32."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        sorted_logits = jnp.where(mass_before < top_p, sorted_logits, -jnp.inf)   # keeps at least the top token
        inverse = jnp.argsort(order, axis=-1)
        logits = jnp.take_along_axis(sorted_logits, inverse, axis=-1)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)
