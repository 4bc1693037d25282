"""The split API (bring your own loss): `forward` then `backward_step`.

    outputs, ctx, state = jmamba.forward(model, state, batch)        # advances the recurrent state
    d_out = my_loss_gradient(outputs)                                 # any code, outside the library
    state, metrics = jmamba.backward_step(optimizer, state, ctx, d_out, clip_max_norm=1.0)

`ctx` (a `ForwardContext`) is the explicit record of what the backward needs: the vjp pytree holding
the forward's residual arrays and the settings the forward ran with; nothing is kept in globals. Both
halves run the same functions as `make_train_step` (see `step_core`), so with the same inputs the
results are bit-identical to the fused step.

Refused with a clear error, before anything changes: a backward whose forward is not the state's
pending one, a second backward on the same forward, a d_out of the wrong shape, clipping or float16
together with `accumulate_only`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Optional

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jmamba.backbone import check_remat
from jmamba.core.validation import check_bool, shape_of
from jmamba.parallel import batch_spec, shard_batch, shard_state
from jmamba.training.clipping import check_max_norm
from jmamba.training.optimizer_update import check_optimizer
from jmamba.training.step_core import apply_gradients, forward_with_vjp
from jmamba.training.train_state import TrainState, check_precision
from jmamba.training.train_step import (check_batch, check_d_out, check_host_token_ids, check_state_for_step,
                                       token_vocab)

_TOKENS = itertools.count(1)


def _on_mesh(mesh):
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


class ForwardContext:
    """What `backward_step` needs from one `forward` call.

    Attributes:
      vjp_fn: the pullback of the forward, a pytree whose leaves are the saved residual arrays.
      outputs_shape: shape of the outputs (d_out must match).
      precision: compute precision the forward ran with.
      token: identifies the forward; the TrainState it returned carries the same token.
      mesh: the device mesh the forward ran on (None: one device).
      consumed: True once a backward_step used it.
      state_rows_reset: int32 count of recurrent-state rows the guard restarted from zeros.
    """

    def __init__(self, vjp_fn, outputs_shape, precision, token, mesh=None):
        self.vjp_fn = vjp_fn
        self.outputs_shape = outputs_shape
        self.precision = precision
        self.token = token
        self.mesh = mesh
        self.consumed = False
        self.state_rows_reset = 0


@functools.partial(jax.jit, static_argnames=("graphdef", "layout", "precision", "truncate_bptt", "guard", "remat"))
def _forward_jit(params, recurrent_state, batch, *, graphdef, layout, precision, truncate_bptt, guard, remat):
    # params arrive as the TrainState keeps them (plain dicts); the model runs on the nnx.State
    if layout is not None:
        params = layout.params_to_nnx(params)
    return forward_with_vjp(graphdef, params, recurrent_state, batch, precision=precision,
                            truncate_bptt=truncate_bptt, guard=guard, remat=remat)


@functools.partial(jax.jit, static_argnames=("optimizer", "clip_max_norm", "accumulate_only", "guard"),
                   donate_argnums=(0,))
def _backward_jit(state, vjp_fn, d_out, *, optimizer, clip_max_norm, accumulate_only, guard):
    layout = state.nnx_layout
    view = state.nnx_view()
    new_view, metrics = apply_gradients(view, vjp_fn, d_out, view.recurrent_state, optimizer,
                                        clip_max_norm=clip_max_norm, accumulate_only=accumulate_only, guard=guard,
                                        flat_state=state if state.is_flat else None)
    return TrainState.from_nnx_view(new_view, layout), metrics


def forward(model: nnx.Module, state: TrainState, batch: dict, *, precision="f32",
            truncate_bptt: bool = True, mesh=None, fsdp: bool = False, nonfinite_guard: bool = True,
            remat=None):
    """Training forward from the carried state.

    Args:
      model: the module whose parameters live in `state.params` (its structure is used).
      state: the TrainState (no other forward pending).
      batch: {"inputs": ..., optional "reset": ...}.
      precision: "f32", "bf16" or "f16".
      truncate_bptt: see `make_train_step`.
      mesh, fsdp: run data- (and sequence-) parallel on this mesh (see `make_train_step`); the state and batch are
        placed on it (a no-op when `jmamba.parallel.shard_state`/`shard_batch` already did).
      nonfinite_guard: restart recurrent-state rows that leave the window non-finite from zeros
        (`ctx.state_rows_reset` counts them); see `make_train_step`.
      remat: activation memory (see `make_train_step`).

    Returns:
      (outputs float32 [B, T, ...], ctx: ForwardContext, new_state with the advanced recurrent state).
    """
    precision = check_precision(precision)
    check_state_for_step(state, precision)
    if state.pending_forward is not None:
        raise RuntimeError("another forward is pending: run its backward_step first")
    check_batch(batch, need_d_out=False)
    check_bool("nonfinite_guard", nonfinite_guard)
    vocab_size = token_vocab(model)
    if vocab_size is not None:
        check_host_token_ids(batch, vocab_size)
    if mesh is not None and state.is_flat:
        raise ValueError("a flat TrainState (TrainState.create(..., flat=True)) runs on one device: "
                         "create the state with flat=False to train with mesh=")
    with _on_mesh(mesh):
        if mesh is not None:
            state, batch = shard_state(state, mesh, fsdp=fsdp), shard_batch(batch, mesh)
        outputs, vjp_fn, (new_rec, rows_reset) = _forward_jit(
            state.params, state.recurrent_state, batch, graphdef=nnx.graphdef(model), layout=state.nnx_layout,
            precision=precision, truncate_bptt=truncate_bptt, guard=nonfinite_guard, remat=check_remat(remat))
    token = next(_TOKENS)
    ctx = ForwardContext(vjp_fn, shape_of(outputs), precision, token, mesh)
    ctx.state_rows_reset = rows_reset
    return outputs, ctx, state.replace(recurrent_state=new_rec, pending_forward=token)


def backward_step(optimizer, state: TrainState, ctx: ForwardContext, d_out, *,
                  clip_max_norm: Optional[float] = None, accumulate_only: bool = False,
                  nonfinite_guard: bool = True):
    """Backward for `ctx`'s forward, then clip and optimizer (or only accumulate the gradients).

    Args:
      optimizer: the optax transformation (or `optax.MultiSteps`) whose state is in `state.opt_state`.
      state: the TrainState returned by the matching `forward`.
      ctx: that forward's ForwardContext.
      d_out: ∂loss/∂outputs, the shape of the forward's outputs.
      clip_max_norm: global-norm clipping (torch semantics) on the applying call; None = off.
      accumulate_only: add the gradients to `state.grad_accum` and stop (no clip, no optimizer).
      nonfinite_guard: skip the step (or the accumulation) when the gradients or the update are
        non-finite (see `make_train_step`).

    Returns:
      (new_state, metrics).
    """
    if not isinstance(ctx, ForwardContext):
        raise TypeError(f"ctx must be the ForwardContext returned by forward(), got {type(ctx).__name__}")
    check_optimizer(optimizer, clip_max_norm=clip_max_norm)
    check_state_for_step(state, ctx.precision)
    if ctx.consumed:
        raise RuntimeError("this forward's backward_step already ran (a second backward on the same forward)")
    if state.pending_forward is None:
        raise RuntimeError("backward_step without its forward: the state has no pending forward")
    if state.pending_forward != ctx.token:
        raise RuntimeError("backward_step without its forward: ctx does not belong to this state's pending forward")
    check_max_norm(clip_max_norm)
    check_bool("nonfinite_guard", nonfinite_guard)
    check_d_out(d_out, jax.ShapeDtypeStruct(ctx.outputs_shape, "float32"))
    if accumulate_only:
        if clip_max_norm is not None:
            raise ValueError("clip_max_norm with accumulate_only=True is refused: clipping applies to the "
                             "accumulated gradient, on the applying call")
        if state.loss_scale is not None:
            raise ValueError("accumulate_only=True is refused with float16 (dynamic loss scaling)")
        if state.grad_accum is None:
            raise ValueError("accumulate_only=True needs a gradient accumulator: "
                             "TrainState.create(..., accumulate=True)")
    with _on_mesh(ctx.mesh):
        if ctx.mesh is not None:
            d_out = jax.device_put(d_out, NamedSharding(ctx.mesh, batch_spec(ctx.mesh, shape_of(d_out), "d_out")))
        new_state, metrics = _backward_jit(state.replace(pending_forward=None), ctx.vjp_fn, d_out,
                                           optimizer=optimizer, clip_max_norm=clip_max_norm,
                                           accumulate_only=accumulate_only, guard=nonfinite_guard)
    ctx.consumed = True
    ctx.vjp_fn = None   # release the residuals
    return new_state, metrics
