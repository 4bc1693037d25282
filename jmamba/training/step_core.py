"""The two halves every training step is made of, shared by the fused step and the split API.

    forward_with_vjp:  params, recurrent state, batch -> outputs (float32), vjp, new recurrent state
    apply_gradients:   vjp(d_out · loss_scale) -> finite check -> unscale -> [accumulate] ->
                       global norm -> clip -> optimizer -> new TrainState

With `jmamba.fused_adamw` the unscale and clip factors are folded into the fused kernel's one pass
over the parameters (`FusedAdamW.apply`), and an overflow is skipped inside it; any other optax
transformation runs as `update` + `apply_updates` under a `lax.cond` that skips on overflow.

Because `make_train_step` and `forward`/`backward_step` run exactly these functions (the fused step
puts an optimization barrier between them so XLA cannot fuse across), the two paths give
bit-identical results.

float16: the caller's d_out is multiplied by the loss scale before the backward pass; a step whose
gradients hold inf/NaN is skipped (params, optimizer state, step counter and accumulator stay
bit-identical; the scale halves). The recurrent state advances on every step, skipped or not: the
window was consumed, and the next window continues the stream.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmamba.optim.fused_adamw import FusedAdamW
from jmamba.training.clipping import clip_coefficient, global_norm
from jmamba.training.loss_scale import all_finite, update_loss_scale
from jmamba.training.train_state import PRECISIONS, TrainState

f32 = jnp.float32


def forward_with_vjp(graphdef, params, recurrent_state, batch, *, precision, truncate_bptt):
    """Runs the model on batch["inputs"] from `recurrent_state`.

    Returns:
      (outputs float32, vjp_fn (a pytree holding the residuals), new recurrent state).
    """
    compute_dtype = PRECISIONS[precision]

    def run(p):
        model = nnx.merge(graphdef, p)
        out, new_state = model(batch["inputs"], recurrent_state, reset=batch.get("reset"),
                               compute_dtype=compute_dtype, truncate_bptt=truncate_bptt)
        return out.astype(f32), jax.lax.stop_gradient(new_state)

    return jax.vjp(run, params, has_aux=True)


def apply_gradients(state: TrainState, vjp_fn, d_out, new_recurrent_state, optimizer, *,
                    clip_max_norm, accumulate_only):
    """Back-propagates d_out through vjp_fn and updates the state. Returns (new_state, metrics)."""
    metrics = {}
    ls = state.loss_scale
    if ls is not None:
        d_out = d_out * ls.scale
    (grads,) = vjp_fn(d_out.astype(f32))
    grads = jax.tree.map(lambda g: g.astype(f32), grads)

    if accumulate_only:
        accum = jax.tree.map(jnp.add, state.grad_accum, grads)
        return state.replace(grad_accum=accum, recurrent_state=new_recurrent_state, accumulating=True), metrics

    # Loss scales are powers of two, so unscaling (and folding 1/scale into another factor) is exact.
    inv_scale = None if ls is None else 1.0 / ls.scale
    finite = None if ls is None else all_finite(grads)
    if state.accumulating:
        grads = jax.tree.map(jnp.add, state.grad_accum, grads)
    coef = None
    if clip_max_norm is not None:
        norm = global_norm(grads) if inv_scale is None else global_norm(grads) * inv_scale
        metrics["grad_norm"] = norm
        coef = clip_coefficient(norm, clip_max_norm)
    accum = None if state.grad_accum is None else jax.tree.map(jnp.zeros_like, state.grad_accum)

    if isinstance(optimizer, FusedAdamW):
        # Unscale and clip inside the fused kernel's single pass; `skip` keeps p, m, v on overflow.
        factors = [f for f in (coef, inv_scale) if f is not None]
        grad_scale = None if not factors else functools.reduce(jnp.multiply, factors)
        params, opt_state, _ = optimizer.apply(grads, state.opt_state, state.params, grad_scale=grad_scale,
                                               skip=None if finite is None else jnp.logical_not(finite))
        step = state.step + 1 if finite is None else jnp.where(finite, state.step + 1, state.step)
        if finite is not None and accum is not None:
            accum = jax.tree.map(lambda z, a: jnp.where(finite, z, a), accum, state.grad_accum)
    else:
        if inv_scale is not None:
            grads = jax.tree.map(lambda g: g * inv_scale, grads)
        if coef is not None:
            grads = jax.tree.map(lambda g: g * coef, grads)

        def update(_):
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state, state.step + 1, accum

        def skip(_):
            return state.params, state.opt_state, state.step, state.grad_accum

        if finite is None:
            params, opt_state, step, accum = update(None)
        else:
            params, opt_state, step, accum = jax.lax.cond(finite, update, skip, None)
    if ls is not None:
        metrics["loss_scale"] = ls.scale
        metrics["overflow_skipped"] = jnp.logical_not(finite)
        ls = update_loss_scale(ls, finite)
    new_state = state.replace(params=params, opt_state=opt_state, step=step, grad_accum=accum,
                              recurrent_state=new_recurrent_state, loss_scale=ls, accumulating=False)
    metrics["step"] = step
    return new_state, metrics
