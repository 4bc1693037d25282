"""`fused_adamw`: AdamW with torch numerics as an optax transformation that can also apply itself in place.

    m_t = b1 · m_{t−1} + (1 − b1) · g_t
    v_t = b2 · v_{t−1} + (1 − b2) · g_t²
    p_t = p_{t−1} − lr_t · wd · p_{t−1} − (lr_t / (1 − b1^t)) · m_t / (√v_t / √(1 − b2^t) + eps)

(torch.optim.AdamW / Loshchilov & Hutter 2019: the decay is decoupled and uses the old parameter;
eps is added after the square root.) The bias corrections are float32 values accurate to a few ulp,
computed as −expm1(t · log b) with log b from float64 on the host (see `jmamba.ops.adamw.numerics`), so they
need no float64 and no host callback inside `jit`. lr_t is `learning_rate` or, for a schedule,
`learning_rate(count)` with the count before this update (optax's convention); it is a traced
value, so a schedule never recompiles the step.

Two ways to use it (the numerics are the same; tests/test_fused_adamw.py checks both against
`optax.adamw` and a float64 torch-AdamW oracle):

1. As an optax transformation (`init`/`update`, composable in `optax.chain`, with
   `optax.inject_hyperparams`): `update` returns `updates = p_t − p_{t−1}` (exact by Sterbenz's
   lemma for ordinary steps, so `optax.apply_updates` reproduces p_t). This path is pure JAX; XLA
   fuses it with `apply_updates`.

2. In place, for the train step: `new_params, new_state, compute_params = opt.apply(grads,
   opt_state, params)` instead of `update` + `apply_updates`. On GPU it runs the Pallas kernel
   (the `jmamba.ops.adamw_update` op; on a CUDA GPU its Pallas kernel): a few launches for the whole tree (up to 32 leaves each),
   each leaf's p, m, v aliased input→output, one HBM pass of 28 bytes per parameter
   (30 with a bf16/f16 compute copy). The leaves stay separate buffers (no arena, no concatenate,
   no per-leaf slicing); called inside a `jit` that donates the TrainState, the update is in place.
   Optional runtime `grad_scale` (a clipping factor or 1/loss_scale, multiplied into g inside the
   kernel: no extra pass over the gradients) and `skip` (a bool: keep p, m, v and the count
   unchanged, for non-finite gradients under dynamic loss scaling, like torch's `found_inf`).
   In a train step, with clipping and loss scaling costing one read of the gradients in all:

       norm = optax.global_norm(grads) / loss_scale          # unscaled; inf/nan if any grad is
       scale = jnp.minimum(1.0, max_norm / (norm + 1e-6)) / loss_scale
       params, opt_state, compute_params = opt.apply(grads, opt_state, params,
                                                     grad_scale=scale, skip=~jnp.isfinite(norm))

Rounding: the decay and the Adam step are summed before the single rounding at the parameter's
scale (torch rounds twice, which biases the result; see pallas_kernels/fused_adamw/kernel.py).

State: `FusedAdamWState(count, mu, nu)`; mu and nu are float32 pytrees shaped like the params.
Master params must be float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jmamba import ops
from jmamba.core.flat_buffers import FlatTree
from jmamba.core.validation import is_static_number
from jmamba.optim.fused_apply import FUSED_APPLY

f32 = jnp.float32
IMPLEMENTATIONS = (None, "reference", "xla", "pallas")
COMPUTE_DTYPES = (jnp.bfloat16, jnp.float16)


class FusedAdamWState(NamedTuple):
    """State of `fused_adamw`.

    Attributes:
      count: int32 scalar, the number of updates applied (t − 1 during step t).
      mu: first moments, float32, shaped like the params.
      nu: second moments, float32, shaped like the params.
    """

    count: jax.Array
    mu: Any
    nu: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _Hyperparams:
    learning_rate: Any
    b1: Any
    b2: Any
    eps: Any
    weight_decay: Any
    mask: Any
    implementation: Optional[str]
    compute_dtype: Any
    tuning: Any          # an ops.AdamWTuning, or None (the op's current tuning)


class FusedAdamW(optax.GradientTransformationExtraArgs):
    """An `optax.GradientTransformation` (init, update) with an extra in-place `apply` method.

    It offers the fused-apply protocol (`jmamba.optim.fused_apply`): `update.fused_apply` is
    `apply` without the compute copy, so the train step runs the fused kernel, also when this
    transformation is the last element of an `optax.chain`. (It is an ExtraArgs transformation so
    that `optax.chain` keeps its `update` as is.)"""

    __slots__ = ()

    def apply(self, grads, state: FusedAdamWState, params, *, grad_scale=None, skip=None):
        """One AdamW step applied directly: the fused replacement of `update` + `apply_updates`.

        Args:
          grads: gradients, the structure of `params` (any float dtype).
          state: this optimizer's state (`init(params)`).
          params: float32 master parameters.
          grad_scale: optional float32 scalar multiplying the gradients (e.g. a global-norm clip
            factor, or 1/loss_scale); fused into the same pass.
          skip: optional bool scalar; True returns params and moments unchanged and does not
            advance the count (compute_params is then a fresh cast of the unchanged params).

        Returns:
          (new_params, new_state, compute_params): compute_params is None, or the new params cast
          to `compute_dtype`, written in the same pass.
        """
        return self.update.apply(grads, state, params, grad_scale=grad_scale, skip=skip)


class _Update:
    """The optax `update` function of `fused_adamw`, which also carries the fused `apply`."""

    def __init__(self, hp: _Hyperparams):
        self.hp = hp

    def __call__(self, updates, state: FusedAdamWState, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("fused_adamw.update needs params (the decoupled weight decay reads them)")
        new_params, new_state, _, lr_ok = _step(self.hp, updates, state, params, implementation="xla",
                                                compute_dtype=None)
        # a refused learning rate changes nothing: zero updates, moments and count unchanged (only the
        # fused apply can also report the step as skipped)
        deltas = jax.tree.map(lambda new, old: jnp.where(lr_ok, new - old, 0.0), new_params, params)
        return deltas, new_state

    def apply(self, grads, state, params, *, grad_scale=None, skip=None):
        return _step(self.hp, grads, state, params, implementation=self.hp.implementation,
                     compute_dtype=self.hp.compute_dtype, grad_scale=grad_scale, skip=skip)[:3]

    def fused_apply(self, grads, state, params, *, grad_scale=None, skip=None):
        """The fused-apply protocol: (new_params, new_state, applied) of `update` + `apply_updates` on
        `grads · grad_scale`, unchanged when `skip` or when the learning rate is refused; one pass
        over p, g, m, v."""
        new_params, new_state, _, lr_ok = _step(self.hp, grads, state, params, implementation=self.hp.implementation,
                                                compute_dtype=None, grad_scale=grad_scale, skip=skip)
        return new_params, new_state, lr_ok

    def fused_apply_flat(self, grads, state, params, *, params_tree, grad_scale=None, skip=None):
        """`fused_apply` for a flat TrainState (`TrainState.create(..., flat=True)`): `params` and the
        moments are FlatTrees, updated in place in one pass; `params_tree` is the params as a tree
        (for the decay mask). Returns (new flat params, new state, applied)."""
        return _flat_step(self.hp, grads, state, params, params_tree=params_tree, grad_scale=grad_scale, skip=skip)


assert FUSED_APPLY == "fused_apply"   # the protocol's attribute name is the method above


def fused_adamw(learning_rate: Union[float, optax.Schedule], b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 1e-2,
                mask: Optional[Union[Any, Callable[[Any], Any]]] = None, *,
                implementation: Optional[str] = None, compute_dtype=None,
                kernel_config=None) -> FusedAdamW:
    """AdamW with torch.optim.AdamW numerics (see the module docstring for the math).

    Args:
      learning_rate: a float, a float32 scalar, or a schedule `count -> lr` (count before the update).
        A step whose learning rate is non-finite or negative is refused: nothing changes (the
        fused apply of the train step also reports it as skipped; through `update`, e.g. inside an
        `optax.MultiSteps`, it is a zero update and the count does not advance).
      b1, b2: moment decay rates in [0, 1). Python floats keep the bias corrections accurate.
      eps: added to √v̂ (after the square root), > 0.
      weight_decay: decoupled decay coefficient, ≥ 0.
      mask: like `optax.adamw`: a pytree of bools with the structure of the params (or a prefix of
        it), or a callable `params -> that pytree`; True = this leaf is decayed. See
        `jmamba.optim.no_decay_mask`.
      implementation: for `apply` only: None (Pallas kernel on GPU, plain JAX elsewhere),
        "reference"/"xla" (plain JAX) or "pallas" (the kernel; interpreted on CPU); the
        `jmamba.ops.adamw_update` dispatch. `update` is always plain JAX.
      compute_dtype: None, jnp.bfloat16 or jnp.float16: `apply` also returns the new params in this
        dtype, written in the same pass.
      kernel_config: launch shape of the Pallas kernel, a `jmamba.optim.KernelConfig` (None: the
        `adamw_update` op's current tuning).

    Returns:
      A `FusedAdamW`: an `optax.GradientTransformation` whose state is `FusedAdamWState`, plus
      `apply(grads, state, params, *, grad_scale=None, skip=None) -> (params, state, compute_params)`.
    """
    if not callable(learning_rate):
        _check_scalar("learning_rate", learning_rate, lo=0.0)
    else:
        _check_schedule(learning_rate)
    for name, v in (("b1", b1), ("b2", b2)):
        _check_scalar(name, v, lo=0.0, hi_open=1.0)
    _check_scalar("eps", eps, lo=0.0)
    if is_static_number(eps) and float(eps) == 0.0:
        raise ValueError("eps must be > 0 (with eps = 0 a zero second moment divides 0 by 0)")
    _check_scalar("weight_decay", weight_decay, lo=0.0)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if compute_dtype is not None and jnp.dtype(compute_dtype) not in [jnp.dtype(d) for d in COMPUTE_DTYPES]:
        raise ValueError(f"compute_dtype must be None, jnp.bfloat16 or jnp.float16, got {compute_dtype!r}")
    try:
        tuning = None if kernel_config is None else ops.AdamWTuning(pallas_config=kernel_config)   # validates it
    except TypeError:
        raise TypeError(f"kernel_config must be a jmamba.optim.KernelConfig or None, got "
                        f"{type(kernel_config).__name__}") from None
    hp = _Hyperparams(learning_rate, b1, b2, eps, weight_decay, mask, implementation,
                      None if compute_dtype is None else jnp.dtype(compute_dtype), tuning)

    def init(params) -> FusedAdamWState:
        leaves = jax.tree_util.tree_leaves_with_path(params)
        bad = [jax.tree_util.keystr(p) for p, x in leaves if jnp.result_type(x) != f32]
        if bad:
            raise TypeError(f"params must be float32 master weights; these are not: {bad[:5]}")
        zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), f32), params)
        return FusedAdamWState(count=jnp.zeros((), jnp.int32), mu=zeros,
                               nu=jax.tree.map(jnp.copy, zeros))

    return FusedAdamW(init, _Update(hp))


# ------------------------------------------------------------------------------------------ step
def _step(hp: _Hyperparams, grads, state, params, *, implementation, compute_dtype,
          grad_scale=None, skip=None):
    if not isinstance(state, FusedAdamWState):
        raise TypeError(f"state must be the FusedAdamWState from init(params), got {type(state).__name__}")
    p_leaves, treedef = jax.tree.flatten(params)
    g_leaves = _leaves_like("grads", grads, treedef, p_leaves)
    m_leaves = _leaves_like("state.mu", state.mu, treedef, p_leaves)
    v_leaves = _leaves_like("state.nu", state.nu, treedef, p_leaves)
    for k, p in enumerate(p_leaves):
        if jnp.result_type(p) != f32:
            raise TypeError(f"params must be float32 master weights; leaf {k} is {jnp.result_type(p)}")
    decay = decay_flags(hp.mask, params, len(p_leaves))
    scalars, count, skip, lr_ok = _step_scalars(hp, state.count, grad_scale, skip)
    new_p, new_m, new_v, new_c = ops.adamw_update(p_leaves, g_leaves, m_leaves, v_leaves, scalars, decay,
                                                  compute_dtype=compute_dtype, implementation=implementation,
                                                  tuning=hp.tuning)
    count = jnp.where(skip, state.count, count)
    new_state = FusedAdamWState(count=count, mu=treedef.unflatten(new_m), nu=treedef.unflatten(new_v))
    compute_params = None if new_c is None else treedef.unflatten(new_c)
    return treedef.unflatten(new_p), new_state, compute_params, lr_ok


def _step_scalars(hp: _Hyperparams, count, grad_scale, skip):
    """(this step's AdamWStepScalars, the advanced count, the skip flag, lr_ok)."""
    for name, x in (("grad_scale", grad_scale), ("skip", skip)):
        if x is not None and jnp.shape(x) != ():
            raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(x)}")
    new_count = optax.safe_increment(count)
    lr = hp.learning_rate(count) if callable(hp.learning_rate) else hp.learning_rate
    lr = jnp.asarray(lr, f32)
    # A schedule that returns a non-finite or negative value would write NaN weights or climb the
    # loss: such a step is refused (nothing changes, the count stays) and reported as not applied.
    lr_ok = jnp.isfinite(lr) & (lr >= 0)
    skip = jnp.logical_not(lr_ok) if skip is None else jnp.logical_or(jnp.asarray(skip, bool), ~lr_ok)
    scalars = ops.step_scalars(learning_rate=jnp.where(lr_ok, lr, 0.0), b1=hp.b1, b2=hp.b2, eps=hp.eps,
                               weight_decay=hp.weight_decay, step=new_count, grad_scale=grad_scale, skip=skip)
    return scalars, new_count, skip, lr_ok


def _flat_step(hp: _Hyperparams, grads, state, params, *, params_tree, grad_scale=None, skip=None):
    """`_step` on flat buffers: `params`, `state.mu`, `state.nu` are FlatTrees of one float32 buffer
    (jmamba.core.flat_buffers), `grads` and `params_tree` (read for the decay mask only) have the
    params' tree structure. Returns (new flat params, new state with flat moments, lr_ok)."""
    if not isinstance(state, FusedAdamWState):
        raise TypeError(f"state must be the FusedAdamWState from init(params), got {type(state).__name__}")
    for name, x in (("params", params), ("state.mu", state.mu), ("state.nu", state.nu)):
        if not isinstance(x, FlatTree) or x.spec is not params.spec or len(x.buffers) != 1 \
                or x.buffers[0].dtype != f32:
            raise TypeError(f"{name} must be a FlatTree of one float32 buffer in the params' layout")
    g_leaves = jax.tree.leaves(grads)
    spec = params.spec
    if len(g_leaves) != spec.num_leaves:
        raise ValueError(f"grads must have one leaf per parameter ({spec.num_leaves}), got {len(g_leaves)}")
    for k, g in enumerate(g_leaves):
        if tuple(jnp.shape(g)) != spec.shapes[k]:
            raise ValueError(f"grads leaf {k} has shape {jnp.shape(g)}, params has {spec.shapes[k]}")
    decay = decay_flags(hp.mask, params_tree, spec.num_leaves)
    scalars, count, skip, lr_ok = _step_scalars(hp, state.count, grad_scale, skip)
    p, m, v = ops.adamw_update_flat(params.buffers[0], g_leaves, state.mu.buffers[0], state.nu.buffers[0],
                                    scalars, decay, offsets=params.offsets(), implementation=hp.implementation,
                                    tuning=hp.tuning)
    count = jnp.where(skip, state.count, count)
    return (FlatTree([p], spec), FusedAdamWState(count=count, mu=FlatTree([m], spec), nu=FlatTree([v], spec)),
            lr_ok)


def _leaves_like(name, tree, treedef, p_leaves):
    try:
        leaves = treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} must have the structure of params: {e}") from None
    for k, (x, p) in enumerate(zip(leaves, p_leaves)):
        if jnp.shape(x) != jnp.shape(p):
            raise ValueError(f"{name} leaf {k} has shape {jnp.shape(x)}, params has {jnp.shape(p)}")
    return leaves


def decay_flags(mask, params, n_leaves: int) -> list[bool]:
    """Per-leaf Python bools (True = decayed) from an optax-style `mask` (None = every leaf)."""
    if mask is None:
        return [True] * n_leaves
    tree = mask(params) if callable(mask) else mask
    try:
        spread = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, params)
    except (ValueError, TypeError) as e:
        raise ValueError(f"mask must be a pytree of bools with the structure of params (or a prefix "
                         f"of it): {e}") from None
    flags = jax.tree.leaves(spread)
    if len(flags) != n_leaves:
        raise ValueError(f"mask must give one bool per parameter leaf ({n_leaves}), got {len(flags)}")
    out = []
    for f in flags:
        if isinstance(f, jax.core.Tracer) or jnp.shape(f) != () or jnp.result_type(f) != jnp.bool_:
            raise TypeError(f"mask leaves must be concrete Python bools (True = decay), got {f!r}")
        out.append(bool(f))
    return out


def _check_schedule(schedule):
    """A schedule's first value must be a finite number >= 0 (checked once, on the host); later values
    that are not are refused step by step (see `_step`)."""
    try:
        first = schedule(0)
    except Exception as e:   # noqa: BLE001  (any failure means it is not a schedule of the count)
        raise TypeError(f"learning_rate must be a number or a schedule count -> lr; calling it with 0 failed: "
                        f"{type(e).__name__}: {e}") from None
    if not isinstance(first, jax.core.Tracer):
        try:
            x = float(first)
        except (TypeError, ValueError):
            raise TypeError(f"learning_rate schedule must return a scalar, got {type(first).__name__}") from None
        if not (x >= 0.0 and x < float("inf")):
            raise ValueError(f"learning_rate schedule must return finite values >= 0, got {x} at count 0")


def _check_scalar(name, v, *, lo, hi_open=None):
    if not is_static_number(v):
        if isinstance(v, jax.core.Tracer) and jnp.shape(v) == ():
            return   # e.g. optax.inject_hyperparams: traced values are checked by their producer
        raise TypeError(f"{name} must be a number or a scalar array, got {type(v).__name__}")
    x = float(v)
    if not (x >= lo and x < float("inf")) or (hi_open is not None and not x < hi_open):
        rng = f"[{lo}, {hi_open})" if hi_open is not None else f">= {lo} and finite"
        raise ValueError(f"{name} must be {rng}, got {x}")
