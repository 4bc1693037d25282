"""Gradient accumulation: one job, the float32 sum of micro-batch gradients in `TrainState.grad_accum`.

A window opens with the first `backward_step(..., accumulate_only=True)` (the state is then
`accumulating`), every such call adds its gradients, and the applying call adds its own gradients
and clears the accumulator. A skipped applying step (non-finite gradients) leaves the accumulator
bit-identical, and the window it belonged to is dropped: the next window starts from zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def add(accum, grads):
    """accum + grads, leaf by leaf (float32)."""
    return jax.tree.map(jnp.add, accum, grads)


def window_start(state):
    """The accumulator a micro-batch adds to: the open window's sum, or zeros when a window opens."""
    if state.accumulating:
        return state.grad_accum
    return jax.tree.map(jnp.zeros_like, state.grad_accum)


def total(state, grads):
    """The gradients of the applying call: grads, plus the accumulator when a window is open."""
    return add(state.grad_accum, grads) if state.accumulating else grads


def after_apply(accum, applied):
    """The accumulator after an applying call: zeros, or unchanged where the step was skipped."""
    if accum is None:
        return None
    zeros = jax.tree.map(jnp.zeros_like, accum)
    return jax.tree.map(lambda z, a: jnp.where(applied, z, a), zeros, accum)
