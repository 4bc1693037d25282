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

The non-finite guard (`guard`, on by default; docs/numerics.md §10, `jmamba.training.guard`): a step
whose loss, gradients or update is non-finite is skipped (params, optimizer state, step counters and
accumulator stay bit-identical; `metrics["skipped"]`, `TrainState.consecutive_skips`), in every
precision; a recurrent-state row that leaves the window non-finite restarts from zeros
(`metrics["state_rows_reset"]`). float16: the caller's d_out is multiplied by the loss scale before
the backward pass; a step whose gradients hold inf/NaN is skipped with or without the guard and the
scale halves. The recurrent state advances on every step, skipped or not: the window was consumed,
and the next window continues the stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jmamba.core.precision import as_precision
from jmamba.lm import MambaLM
from jmamba.optim.fused_adamw import FusedAdamWState
from jmamba.training import accumulation
from jmamba.training.clipping import clip_coefficient, global_norm
from jmamba.training.guard import all_finite, restart_nonfinite_rows
from jmamba.training.loss_scale import scale_cotangent, unscale_factor, update_loss_scale
from jmamba.training.optimizer_update import OptimizerPlan
from jmamba.training.train_state import TrainState

f32 = jnp.float32


def forward_with_vjp(graphdef, params, recurrent_state, batch, *, precision, truncate_bptt, guard=True,
                     remat=None, narrow_outputs=False):
    """Runs the model on batch["inputs"] from `recurrent_state`.

    `narrow_outputs=True` returns the outputs in the dtype the model computed them in (a `MambaLM`'s
    logits before their exact widening to float32, see `MambaLM.__call__(widen_logits=)`); the
    caller widens them with `.astype(float32)` (same values) and hands `vjp_fn` a cotangent of the
    outputs' dtype. The fused train step does this so that what it keeps of a [B, T, V] logits
    tensor between its forward and its loss is in the compute dtype.

    Returns:
      (outputs float32 (or as computed with `narrow_outputs`), vjp_fn (a pytree holding the
      residuals), (new recurrent state, number of its rows restarted from zeros because they were
      non-finite; always 0 without the guard)).
    """
    precision = as_precision(precision)

    def run(p):
        model = nnx.merge(graphdef, p)
        extra = {} if remat is None else {"remat": remat}
        if narrow_outputs and isinstance(model, MambaLM):
            extra["widen_logits"] = False
        out, new_state = model(batch["inputs"], recurrent_state, reset=batch.get("reset"),
                               precision=precision, truncate_bptt=truncate_bptt, **extra)
        new_state = jax.lax.stop_gradient(new_state)
        if guard:
            new_state, n_reset = restart_nonfinite_rows(new_state)
        else:
            n_reset = jnp.zeros((), jnp.int32)
        return (out if narrow_outputs else out.astype(f32)), (new_state, n_reset)

    outputs, vjp_fn, aux = jax.vjp(run, params, has_aux=True)
    return outputs, vjp_fn, aux


def apply_gradients(state: TrainState, vjp_fn, d_out, new_recurrent_state, optimizer, *,
                    clip_max_norm, accumulate_only, guard=True, loss=None, out_dtype=f32, flat_state=None):
    """Back-propagates d_out through vjp_fn and updates the state. Returns (new_state, metrics).

    `out_dtype`: the dtype of the outputs vjp_fn was traced for (float32 unless the forward ran with
    `narrow_outputs`); the cotangent is scaled in its own precision, then cast to it.

    `flat_state`: for a flat TrainState (`TrainState.create(..., flat=True)`), the state in its flat
    form (`state` is its `nnx_view()`). With an optimizer that updates flat buffers in place
    (`jmamba.fused_adamw` alone) the new params and moments are returned as FlatTrees, so packing
    them back costs nothing; other optimizers run on `state`'s trees.

    `loss` (a float32 scalar, or None in the d_out mode) takes part in the guard's finite check.
    """
    metrics = {}
    ls = state.loss_scale
    (grads,) = vjp_fn(scale_cotangent(d_out, ls).astype(out_dtype))
    grads = jax.tree.map(lambda g: g.astype(f32), grads)

    # What makes this step unusable: an f16 overflow (always; checked leaf by leaf, as before), any
    # non-finite value (the guard). The guard reads the global norm it needs anyway: an inf/NaN in any
    # gradient makes it non-finite, so the check costs no extra pass (a finite norm beyond float32
    # range, ~1.8e19, would count as non-finite too: such a step is diverging anyway).
    grads_finite = all_finite(grads) if ls is not None else None
    loss_ok = jnp.isfinite(loss) if (guard and loss is not None) else None

    if accumulate_only:
        ok = _and(grads_finite, loss_ok, all_finite(grads) if guard and ls is None else None)
        # A window opens from zeros: what a skipped applying call left in the accumulator is dropped.
        base = accumulation.window_start(state)
        accum = accumulation.add(base, grads)
        if ok is not None:
            accum = jax.tree.map(lambda new, old: jnp.where(ok, new, old), accum, base)
            metrics["skipped"] = jnp.logical_not(ok)
        return state.replace(grad_accum=accum, recurrent_state=new_recurrent_state, accumulating=True,
                             consecutive_skips=_skips(state, ok)), metrics

    # Loss scales are powers of two, so unscaling (and folding 1/scale into another factor) is exact.
    inv_scale = unscale_factor(ls)
    grads = accumulation.total(state, grads)
    norm = global_norm(grads) if inv_scale is None else global_norm(grads) * inv_scale
    metrics["grad_norm"] = norm
    ok = _and(grads_finite, loss_ok, jnp.isfinite(norm) if guard else None)
    factors = [] if inv_scale is None else [inv_scale]
    if clip_max_norm is not None:
        factors.append(clip_coefficient(norm, clip_max_norm))

    plan = OptimizerPlan.of(optimizer)
    plan.warn_if_unfused(state.opt_state)
    skip = None if ok is None else jnp.logical_not(ok)
    if flat_state is not None and plan.fused_flat is not None and isinstance(flat_state.opt_state, FusedAdamWState):
        params, opt_state, applied, updated = plan.apply_flat(
            grads, flat_state.opt_state, flat_state.params, params_tree=state.params, factors=factors, skip=skip)
    else:
        params, opt_state, applied, updated = plan.apply(
            grads, state.opt_state, state.params, factors=factors, skip=skip, check_update=guard)
    step = state.step + applied.astype(state.step.dtype)
    updates = state.updates + updated.astype(state.updates.dtype)
    if ls is not None:
        metrics["loss_scale"] = ls.scale
        metrics["overflow_skipped"] = jnp.logical_not(grads_finite)
        ls = update_loss_scale(ls, grads_finite)
    metrics["skipped"] = jnp.logical_not(applied)
    new_state = state.replace(params=params, opt_state=opt_state, step=step, updates=updates,
                              grad_accum=accumulation.after_apply(state.grad_accum, applied),
                              recurrent_state=new_recurrent_state, loss_scale=ls, accumulating=False,
                              consecutive_skips=_skips(state, applied))
    metrics["step"] = step
    metrics["updates"] = updates
    metrics["consecutive_skips"] = new_state.consecutive_skips
    return new_state, metrics


def _and(*flags):
    """Logical and of the flags that are not None (None when all are)."""
    flags = [f for f in flags if f is not None]
    if not flags:
        return None
    out = flags[0]
    for f in flags[1:]:
        out = jnp.logical_and(out, f)
    return out


def _skips(state, applied):
    """consecutive_skips after this call: 0 when it applied, +1 when it was skipped."""
    if applied is None:
        return jnp.zeros_like(state.consecutive_skips)
    return jnp.where(applied, 0, state.consecutive_skips + 1).astype(state.consecutive_skips.dtype)
