"""`make_train_step`: forward + loss + backward + optimizer update as one jitted XLA program.

The returned function is pure, `(TrainState, batch) -> (TrainState, metrics)`; XLA compiles the
whole step once (this stands where mamba-rs captures a CUDA graph). The recurrent state is read
from the TrainState, the window runs from it, and the state after the window is stored back.

Two ways to give the objective:
  * `loss_fn(outputs, batch) -> loss` (or `(loss, aux_metrics)`): the loss is differentiated inside.
  * `loss_fn=None`: the batch carries `d_out`, the gradient of the caller's loss w.r.t. the model
    outputs (the mamba-rs `step(input, d_temporal)` contract); the step back-propagates it.

Batch (a dict): `inputs` (the model input: [B, T, input_dim] floats for a backbone, [B, T] token
ids for `MambaLM`), optional `reset` ([B] or [B, T] bool), `d_out` in the second mode, and whatever
else `loss_fn` reads (e.g. `targets`).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jmamba.ops.validation import shape_of
from jmamba.training.train_state import TrainState

f32 = jnp.float32
PRECISIONS = {"f32": jnp.float32}


def make_train_step(model: nnx.Module, optimizer: optax.GradientTransformation, *,
                    loss_fn: Optional[Callable] = None, precision: str = "f32",
                    truncate_bptt: bool = True, donate: bool = True, jit: bool = True):
    """Builds the training step for `model` (its structure; parameters come from the TrainState).

    Args:
      model: an nnx module called as `model(inputs, state, reset=..., compute_dtype=...,
        truncate_bptt=...) -> (outputs, new_state)` (a backbone or `MambaLM`).
      optimizer: the optax transformation whose state is in `TrainState.opt_state`.
      loss_fn: `loss_fn(outputs, batch) -> loss | (loss, aux)`; None = the batch holds `d_out`.
      precision: compute precision of the forward/backward ("f32").
      truncate_bptt: no gradient into the carried state (mamba-rs semantics); False keeps the op
        differentiable w.r.t. the incoming state (only matters when windows are chained in one program).
      donate: donate the incoming TrainState's buffers (updates happen in place).
      jit: return the jitted function (False: the plain Python function, for composing in a larger jit).

    Returns:
      step(state, batch) -> (new_state, metrics) with metrics {"step", "loss" (loss_fn mode), ...}.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
    graphdef = nnx.graphdef(model)
    compute_dtype = PRECISIONS[precision]

    def forward(params, recurrent_state, batch):
        m = nnx.merge(graphdef, params)
        return m(batch["inputs"], recurrent_state, reset=batch.get("reset"),
                 compute_dtype=compute_dtype, truncate_bptt=truncate_bptt)

    def step(state: TrainState, batch):
        _check_batch(batch, loss_fn)
        metrics = {}
        if loss_fn is not None:
            def objective(params):
                outputs, new_rec = forward(params, state.recurrent_state, batch)
                res = loss_fn(outputs, batch)
                loss, aux = res if isinstance(res, tuple) else (res, {})
                return loss.astype(f32), (new_rec, aux)

            (loss, (new_rec, aux)), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
            metrics.update(aux)
            metrics["loss"] = loss
        else:
            outputs, vjp_fn, new_rec = jax.vjp(lambda p: forward(p, state.recurrent_state, batch),
                                               state.params, has_aux=True)
            d_out = batch["d_out"]
            if shape_of(d_out) != shape_of(outputs):
                raise ValueError(f"batch['d_out'] must have the shape of the model outputs "
                                 f"{shape_of(outputs)}, got {shape_of(d_out)}")
            (grads,) = vjp_fn(d_out.astype(outputs.dtype))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = state.replace(params=params, opt_state=opt_state,
                                  recurrent_state=jax.lax.stop_gradient(new_rec), step=state.step + 1)
        metrics["step"] = new_state.step
        return new_state, metrics

    if not jit:
        return step
    return jax.jit(step, donate_argnums=(0,) if donate else ())


def _check_batch(batch, loss_fn):
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict with 'inputs' (and 'd_out' or what loss_fn reads), "
                        f"got {type(batch).__name__}")
    if "inputs" not in batch:
        raise ValueError("batch must contain 'inputs' (the model input)")
    if loss_fn is None and "d_out" not in batch:
        raise ValueError("batch must contain 'd_out' (gradient of the loss w.r.t. the model outputs) "
                         "when make_train_step was built without loss_fn")
