"""Applying the optimizer: one job, given gradients that are already unscaled-and-clipped by factor.

    plan = OptimizerPlan.of(optimizer)                  # once, when the step is built
    params, opt_state, applied, updated = plan.apply(grads, opt_state, params,
                                                     grad_scale=..., skip=...)

`optimizer` is an `optax.GradientTransformation` or an `optax.MultiSteps`. When the transformation
offers a fused apply (`jmamba.optim.fused_apply`: `fused_adamw`, alone or last in an `optax.chain`),
the gradient factor and the skip go into that one pass (the fused apply may refuse a step itself,
e.g. `fused_adamw` with a non-finite or negative learning rate); otherwise the gradients are
multiplied by each factor in turn, then `update` + `apply_updates` run under a `lax.cond` that skips
them, or, under the non-finite guard, are computed and kept only when the update is finite.
A fused transformation that cannot run fused (e.g. inside `optax.MultiSteps`) is reported with one
warning per optimizer, naming why.

`applied` is False on a skipped step; `updated` says whether the parameters were updated (differs
from `applied` only under `optax.MultiSteps`, which updates every k-th micro-step).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from jmamba.optim.fused_adamw import FusedAdamWState
from jmamba.optim.fused_apply import explain_unfused, find_fused_apply
from jmamba.training.guard import all_finite

_WARNED: set = set()


def check_optimizer(optimizer, name: str = "optimizer", *, clip_max_norm=None):
    if not isinstance(optimizer, (optax.GradientTransformation, optax.MultiSteps)):
        raise TypeError(f"{name} must be an optax.GradientTransformation or an optax.MultiSteps, "
                        f"got {type(optimizer).__name__}")
    if isinstance(optimizer, optax.MultiSteps) and clip_max_norm is not None:
        raise ValueError("clip_max_norm with optax.MultiSteps would clip every micro-batch, not the accumulated "
                         "gradient: clip inside it, optax.MultiSteps(optax.chain(optax.clip_by_global_norm(c), opt), k)")


@dataclasses.dataclass(frozen=True, eq=False)
class OptimizerPlan:
    """How a train step applies `optimizer` (built once per optimizer; hashable by identity).

    Attributes:
      tx: the GradientTransformation to run (MultiSteps' own transformation for a MultiSteps).
      fused: the fused apply `tx` offers, or None.
      has_updated: for MultiSteps, `state -> bool` (did the last update change the params), else None.
      fused_flat: the in-place apply on flat buffers `tx` offers (`jmamba.fused_adamw` alone), or None.
    """

    tx: Any
    fused: Optional[Callable]
    has_updated: Optional[Callable]
    fused_flat: Optional[Callable] = None

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(optimizer) -> "OptimizerPlan":
        check_optimizer(optimizer)
        if isinstance(optimizer, optax.MultiSteps):
            return OptimizerPlan(optimizer.gradient_transformation(), None, optimizer.has_updated)
        return OptimizerPlan(optimizer, find_fused_apply(optimizer), None,
                             getattr(optimizer.update, "fused_apply_flat", None))

    def apply_flat(self, grads, flat_opt_state, flat_params, *, params_tree, factors=(), skip=None):
        """`apply` with the flat-buffer fused apply: `flat_params` and the moments in `flat_opt_state`
        are FlatTrees (a flat TrainState's pure form), updated in place; `params_tree` is the params
        as a tree (read for the decay mask). Only when `fused_flat` is not None. Returns as `apply`,
        with params and opt_state in the flat form."""
        applied = jnp.asarray(True) if skip is None else jnp.logical_not(skip)
        grad_scale = functools.reduce(jnp.multiply, factors) if factors else None
        params, opt_state, ok = self.fused_flat(grads, flat_opt_state, flat_params, params_tree=params_tree,
                                                grad_scale=grad_scale, skip=skip)
        applied = jnp.logical_and(applied, ok)
        return params, opt_state, applied, applied

    def warn_if_unfused(self, opt_state) -> None:
        """One warning per optimizer when a fused transformation inside it cannot run fused."""
        if self.fused is not None or id(self) in _WARNED:
            return
        why = explain_unfused(self.tx, opt_state, (FusedAdamWState,))
        if why is not None:
            _WARNED.add(id(self))
            warnings.warn(f"the fused optimizer kernel is not used: {why}", stacklevel=4)

    def apply(self, grads, opt_state, params, *, factors=(), skip=None, check_update=False):
        """One optimizer step on `grads · Π factors`.

        Args:
          grads: float32 gradients (the params' structure).
          factors: float32 scalars multiplying the gradients (e.g. 1/loss_scale, the clip factor),
            applied in this order.
          skip: None or a bool scalar; True leaves params and optimizer state unchanged.
          check_update: also skip when the update itself is non-finite (the non-finite guard). A
            fused apply checks its own inputs (finite gradients and scalars give a finite update).

        Returns:
          (params, opt_state, applied bool scalar, updated bool scalar).
        """
        applied = jnp.asarray(True) if skip is None else jnp.logical_not(skip)
        if self.fused is not None:
            grad_scale = functools.reduce(jnp.multiply, factors) if factors else None
            out = self.fused(grads, opt_state, params, grad_scale=grad_scale, skip=skip)
            params, opt_state = out[:2]
            if len(out) == 3:            # the fused apply refused the step itself (e.g. a bad learning rate)
                applied = jnp.logical_and(applied, out[2])
            return params, opt_state, applied, applied
        for f in factors:
            grads = jax.tree.map(lambda g: g * f, grads)

        if check_update:
            updates, new_state = self.tx.update(grads, opt_state, params)
            applied = jnp.logical_and(applied, all_finite(updates))
            new_params = optax.apply_updates(params, updates)
            params = jax.tree.map(lambda new, old: jnp.where(applied, new, old), new_params, params)
            opt_state = jax.tree.map(lambda new, old: jnp.where(applied, new, old), new_state, opt_state)
        else:
            def update(_):
                updates, new_state = self.tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), new_state

            def keep(_):
                return params, opt_state

            params, opt_state = update(None) if skip is None else jax.lax.cond(applied, update, keep, None)
        updated = applied if self.has_updated is None else jnp.logical_and(applied, self.has_updated(opt_state))
        return params, opt_state, applied, updated
