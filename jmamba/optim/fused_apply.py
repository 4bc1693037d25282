"""The fused-apply protocol: how an optimizer offers to update the parameters in one pass.

A train step normally runs `updates, state = tx.update(grads, state, params)` and then
`params = optax.apply_updates(params, updates)`: two passes over the parameters, plus one to scale
the gradients for loss scaling or clipping. A transformation can offer to do all of it at once:

    tx.update.fused_apply(grads, state, params, *, grad_scale=None, skip=None)
        -> (params, state)  or  (params, state, applied)

must return what `update` + `apply_updates` would give for the gradients `grads · grad_scale`
(grad_scale a float32 scalar or None = 1), and `(params, state)` unchanged where the bool scalar
`skip` is True. A third result, a bool scalar, says whether the step was applied (a transformation
may refuse a step itself, e.g. a non-finite learning rate). `jmamba.fused_adamw` offers it (one
Pallas pass over p, g, m, v on GPU).

`find_fused_apply(tx)` finds it on `tx` itself or, when `tx` is an `optax.chain(...)`, on the chain's
last element: the elements before it (e.g. `optax.clip_by_global_norm`, `optax.masked(...)`)
run as usual on the scaled gradients, their states kept on `skip`, then the last element's fused
apply updates the parameters. Anything else (a fused transformation in the middle of a chain,
inside `optax.MultiSteps`, or wrapped by another combinator) runs through `update` +
`apply_updates`; `explain_unfused` says why, so the train step can warn once.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

FUSED_APPLY = "fused_apply"


def _chain_elements(update_fn) -> Optional[tuple]:
    """The element update functions of an `optax.chain` update function, or None if it is not one.

    optax.chain (optax 0.2.x) builds `update_fn` as a closure over the tuple `update_fns`; that closure
    cell is the only thing read here. Any other callable gives None (and so no fused path)."""
    code = getattr(update_fn, "__code__", None)
    closure = getattr(update_fn, "__closure__", None)
    if code is None or not closure or "update_fns" not in code.co_freevars:
        return None
    fns = closure[code.co_freevars.index("update_fns")].cell_contents
    return tuple(fns) if isinstance(fns, (tuple, list)) and all(callable(f) for f in fns) else None


def _find(update_fn) -> Optional[Callable]:
    own = getattr(update_fn, FUSED_APPLY, None)
    if own is not None:
        return own
    elements = _chain_elements(update_fn)
    if not elements:
        return None
    last = _find(elements[-1])
    if last is None:
        return None
    prefix = elements[:-1]
    if not prefix:
        return lambda grads, state, params, **kw: _as_chain_result(last(grads, state[0], params, **kw), ())

    def chain_apply(grads, state, params, *, grad_scale=None, skip=None):
        if grad_scale is not None:   # the elements before the last must see the scaled gradients
            grads = jax.tree.map(lambda g: (g * grad_scale).astype(g.dtype), grads)
        new_states = []
        for fn, s in zip(prefix, state[:-1]):
            grads, s_new = fn(grads, s, params)
            if skip is not None:
                s_new = jax.tree.map(lambda new, old: jnp.where(skip, old, new), s_new, s)
            new_states.append(s_new)
        result = last(grads, state[-1], params, grad_scale=None, skip=skip)
        if len(result) == 3:   # the last element refused the step: the earlier states are kept too
            new_states = [jax.tree.map(lambda new, old: jnp.where(result[2], new, old), s_new, s)
                          for s_new, s in zip(new_states, state[:-1])]
        return _as_chain_result(result, tuple(new_states))

    return chain_apply


def _as_chain_result(result, earlier_states):
    """The last element's (params, state[, applied]) with the chain's state tuple."""
    return (result[0], earlier_states + (result[1],)) + tuple(result[2:])


def find_fused_apply(tx) -> Optional[Callable]:
    """The fused apply `tx` offers (directly or as the last element of an optax.chain), or None."""
    update = getattr(tx, "update", None)
    return None if update is None else _find(update)


def explain_unfused(tx, opt_state, fused_state_types: tuple) -> Optional[str]:
    """Why a fused transformation inside `tx` cannot run fused, or None when there is none to explain.

    `fused_state_types` are the state classes of fused transformations (e.g. `FusedAdamWState`); if
    one appears in `opt_state` but `find_fused_apply(tx)` is None, the fused kernel is not used."""
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, fused_state_types))
             if isinstance(x, fused_state_types)]
    if not found or find_fused_apply(tx) is not None:
        return None
    name = type(found[0]).__name__
    if _chain_elements(getattr(tx, "update", None)) is not None:
        return (f"the optimizer is an optax.chain whose last element is not the fused transformation "
                f"(its {name} sits earlier in the chain); put it last to use its fused kernel")
    return (f"the optimizer wraps a fused transformation ({name} in its state) in a combinator that does "
            f"not pass the fused apply through (e.g. optax.MultiSteps, optax.masked, "
            f"optax.inject_hyperparams); its update runs as update + apply_updates instead")
