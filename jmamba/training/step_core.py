"""The two halves every training step is made of, shared by the fused step and the split API.

    forward_with_vjp:  params, recurrent state, batch -> outputs (float32), vjp, new recurrent state
    apply_gradients:   backward of d_out (loss-scaled) -> [accumulate] -> finite check -> global norm
                       -> clip factor -> optimizer (fused or update + apply_updates) -> new TrainState

Each piece has one job and its own module: `loss_scale` (scaling the cotangent, the dynamic
scale's update), `accumulation` (the micro-batch sum), `clipping` (global norm and factor),
`optimizer_update` (running the optimizer, fused when it offers a fused apply). The unscale and clip
factors reach the optimizer as factors, so a fused optimizer folds them into its one pass.

Because `make_train_step` and `forward`/`backward_step` run exactly these functions (the fused step
puts an optimization barrier between them so XLA cannot fuse across), the two paths give
bit-identical results.

float16: the caller's d_out is multiplied by the loss scale before the backward pass; a step whose
gradients hold inf/NaN is skipped (params, optimizer state, step counters and accumulator stay
bit-identical; the scale halves). The recurrent state advances on every step, skipped or not: the
window was consumed, and the next window continues the stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmamba.core.precision import as_precision
from jmamba.training import accumulation
from jmamba.training.clipping import clip_coefficient, global_norm
from jmamba.training.loss_scale import all_finite, scale_cotangent, unscale_factor, update_loss_scale
from jmamba.training.optimizer_update import OptimizerPlan
from jmamba.training.train_state import TrainState

f32 = jnp.float32


def forward_with_vjp(graphdef, params, recurrent_state, batch, *, precision, truncate_bptt):
    """Runs the model on batch["inputs"] from `recurrent_state`.

    Returns:
      (outputs float32, vjp_fn (a pytree holding the residuals), new recurrent state).
    """
    precision = as_precision(precision)

    def run(p):
        model = nnx.merge(graphdef, p)
        out, new_state = model(batch["inputs"], recurrent_state, reset=batch.get("reset"),
                               precision=precision, truncate_bptt=truncate_bptt)
        return out.astype(f32), jax.lax.stop_gradient(new_state)

    return jax.vjp(run, params, has_aux=True)


def apply_gradients(state: TrainState, vjp_fn, d_out, new_recurrent_state, optimizer, *,
                    clip_max_norm, accumulate_only):
    """Back-propagates d_out through vjp_fn and updates the state. Returns (new_state, metrics)."""
    metrics = {}
    ls = state.loss_scale
    (grads,) = vjp_fn(scale_cotangent(d_out, ls).astype(f32))
    grads = jax.tree.map(lambda g: g.astype(f32), grads)

    if accumulate_only:
        return state.replace(grad_accum=accumulation.add(state.grad_accum, grads),
                             recurrent_state=new_recurrent_state, accumulating=True), metrics

    # Loss scales are powers of two, so unscaling (and folding 1/scale into another factor) is exact.
    inv_scale = unscale_factor(ls)
    finite = None if ls is None else all_finite(grads)
    grads = accumulation.total(state, grads)
    norm = global_norm(grads) if inv_scale is None else global_norm(grads) * inv_scale
    metrics["grad_norm"] = norm
    factors = [] if inv_scale is None else [inv_scale]
    if clip_max_norm is not None:
        factors.append(clip_coefficient(norm, clip_max_norm))

    plan = OptimizerPlan.of(optimizer)
    plan.warn_if_unfused(state.opt_state)
    params, opt_state, applied, updated = plan.apply(
        grads, state.opt_state, state.params, factors=factors,
        skip=None if finite is None else jnp.logical_not(finite))
    step = state.step + applied.astype(state.step.dtype)
    updates = state.updates + updated.astype(state.updates.dtype)
    if ls is not None:
        metrics["loss_scale"] = ls.scale
        metrics["overflow_skipped"] = jnp.logical_not(finite)
        ls = update_loss_scale(ls, finite)
    new_state = state.replace(params=params, opt_state=opt_state, step=step, updates=updates,
                              grad_accum=accumulation.after_apply(state.grad_accum, applied),
                              recurrent_state=new_recurrent_state, loss_scale=ls, accumulating=False)
    metrics["step"] = step
    metrics["updates"] = updates
    return new_state, metrics
