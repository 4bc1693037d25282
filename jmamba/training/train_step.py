"""`make_train_step`: forward + loss + backward + clip + optimizer update as one jitted XLA program.

The returned function is pure, `(TrainState, batch) -> (TrainState, metrics)`; XLA compiles the
whole step once (this stands where mamba-rs captures a CUDA graph). The recurrent state is read
from the TrainState, the window runs from it, and the state after the window is stored back.

Two ways to give the objective:
  * `loss_fn(outputs, batch) -> loss` (or `(loss, aux_metrics)`): differentiated inside the step.
  * `loss_fn=None`: the batch carries `d_out`, the gradient of the caller's loss w.r.t. the model
    outputs (the mamba-rs `step(input, d_temporal)` contract); the step back-propagates it.

Batch (a dict): `inputs` (the model input: [B, T, input_dim] floats for a backbone, [B, T] token
ids for `MambaLM`), optional `reset` ([B] or [B, T] bool), `d_out` in the second mode, and whatever
else `loss_fn` reads (e.g. `targets`).

Order inside the step: forward (compute dtype) -> loss -> d_out · loss_scale -> backward -> finite
check -> unscale -> global norm -> clip -> optimizer. Metrics: `step`, `updates`, `loss` (loss_fn
mode), `grad_norm` (pre-clip, unscaled), `skipped`, `consecutive_skips`, `state_rows_reset`,
`invalid_tokens` (MambaLM), `loss_scale` and `overflow_skipped` (f16).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint

from jmamba.core.validation import check_bool, shape_of
from jmamba.backbone import check_remat
from jmamba.lm import MambaLM
from jmamba.training.clipping import check_max_norm
from jmamba.training.optimizer_update import check_optimizer
from jmamba.training.step_core import apply_gradients, forward_with_vjp
from jmamba.training.train_state import TrainState, check_precision

f32 = jnp.float32


def make_train_step(model: nnx.Module, optimizer, *,
                    loss_fn: Optional[Callable] = None, precision="f32",
                    clip_max_norm: Optional[float] = None, truncate_bptt: bool = True,
                    donate: bool = True, jit: bool = True, mesh=None, fsdp: bool = False,
                    nonfinite_guard: bool = True, remat=None, compiler_options=None):
    """Builds the training step for `model` (its structure; parameters come from the TrainState).

    Args:
      model: an nnx module called as `model(inputs, state, reset=..., precision=...,
        truncate_bptt=...) -> (outputs, new_state)` (a backbone or `MambaLM`).
      optimizer: the optax transformation (or `optax.MultiSteps`) whose state is in
        `TrainState.opt_state`. One that offers a fused apply (`jmamba.fused_adamw`, alone or last
        in an `optax.chain`) runs its fused kernel with the unscale and clip factors folded in.
      loss_fn: `loss_fn(outputs, batch) -> loss | (loss, aux)`; None = the batch holds `d_out`.
      precision: compute precision "f32", "bf16" or "f16" (or a `jmamba.Precision`; f16 needs a
        TrainState created with precision="f16", which holds the dynamic loss scale). Master params
        stay float32.
      clip_max_norm: global-norm clipping threshold (torch semantics), or None.
      truncate_bptt: no gradient into the carried state (mamba-rs semantics); False keeps the op
        differentiable w.r.t. the incoming state (only matters when windows are chained in one program).
      donate: donate the incoming TrainState's buffers (updates happen in place).
      jit: return the jitted function (False: the plain Python function, for composing in a larger jit).
      mesh: a device mesh with a `data` axis (`jmamba.parallel.make_data_mesh()`): the step runs SPMD,
        batch and recurrent state split over `data`, parameters and optimizer state replicated (or
        split, `fsdp=True`); XLA all-reduces the gradients. With a `seq` axis as well (or alone:
        `jmamba.parallel.make_mesh(data=..., seq=...)`), each window's time axis is split over `seq`
        and the scans pass their states between the shards (docs/sequence_parallel.md). Input arrays
        should be uncommitted or placed with `jmamba.parallel.shard_state` / `shard_batch`.
      fsdp: with `mesh`, shard parameters and optimizer state over `data` as well.
      nonfinite_guard: skip steps whose loss, gradients or update are non-finite and restart
        non-finite recurrent-state rows from zeros (default; `jmamba.training.guard`). False applies
        whatever the step computed, as PyTorch does (float16 overflow steps are still skipped).
      remat: activation memory of the backward pass: None (save everything), "layer" (recompute
        each residual block), or a `jax.checkpoint_policies` policy per block (see
        `ResidualBackbone.__call__`).
      compiler_options: XLA options for this step's compilation only (a dict of option name -> bool,
        int, float or str, given to `jax.jit(..., compiler_options=...)`), e.g.
        `{"xla_gpu_triton_gemm_any": False}` (docs/performance.md, "XLA options"). None: XLA's defaults
        (and whatever XLA_FLAGS sets). An unknown name raises when the step first compiles.

    For a `MambaLM`, token ids outside [0, vocab) raise a ValueError naming the batch key and
    position when the batch is a host (numpy) array; on the device they are counted in
    `metrics["invalid_tokens"]`, embed as NaN, and the guard skips the step.

    Returns:
      step(state, batch) -> (new_state, metrics).
    """
    precision = check_precision(precision)
    check_max_norm(clip_max_norm)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    check_optimizer(optimizer, clip_max_norm=clip_max_norm)
    check_bool("nonfinite_guard", nonfinite_guard)
    remat = check_remat(remat)
    compiler_options = check_compiler_options(compiler_options)
    if compiler_options is not None and not jit:
        raise ValueError("compiler_options needs jit=True (they are given to jax.jit; a step composed "
                         "into a larger jit compiles with that jit's options)")
    graphdef = nnx.graphdef(model)
    vocab_size = token_vocab(model)

    def core(state: TrainState, batch):
        # The state arrives with plain-dict params / optimizer state (cheap to pass through the jit
        # boundary); the model and optimizer run on the nnx trees rebuilt here, at trace time.
        layout = state.nnx_layout
        flat_state = state if state.is_flat else None
        state = state.nnx_view()
        outputs, vjp_fn, (new_rec, rows_reset) = forward_with_vjp(
            graphdef, state.params, state.recurrent_state, batch, precision=precision,
            truncate_bptt=truncate_bptt, guard=nonfinite_guard, remat=remat, narrow_outputs=True)
        # Same two halves as the split API; the barrier keeps XLA from fusing across them. The
        # outputs cross it in the dtype they were computed in (bf16 logits: half the bytes of the
        # float32 copy) and are widened after it, which is exact.
        vjp_fn = _row_major_residuals(vjp_fn)
        outputs, vjp_fn, new_rec = jax.lax.optimization_barrier((outputs, vjp_fn, new_rec))
        out_dtype = outputs.dtype
        outputs = outputs.astype(jnp.float32)
        metrics = {"state_rows_reset": rows_reset}
        loss = None
        if vocab_size is not None:
            metrics["invalid_tokens"] = count_invalid_tokens(batch["inputs"], vocab_size)
        if loss_fn is None:
            d_out = batch["d_out"]
            check_d_out(d_out, outputs)
        else:
            def loss_of(out):
                res = loss_fn(out, batch)
                loss, aux = res if isinstance(res, tuple) else (res, {})
                return jnp.asarray(loss, f32), aux

            (loss, aux), d_out = jax.value_and_grad(loss_of, has_aux=True)(outputs)
            metrics.update(aux)
            metrics["loss"] = loss
        new_state, m = apply_gradients(state, vjp_fn, d_out, new_rec, optimizer,
                                       clip_max_norm=clip_max_norm, accumulate_only=False,
                                       guard=nonfinite_guard, loss=loss, out_dtype=out_dtype,
                                       flat_state=flat_state)
        metrics.update(m)
        return TrainState.from_nnx_view(new_state, layout), metrics

    donate_argnums = (0,) if donate else ()
    if mesh is None:
        compiled = (jax.jit(core, donate_argnums=donate_argnums, compiler_options=compiler_options)
                    if jit else core)
    else:
        if not jit:
            raise ValueError("mesh= needs jit=True (the shardings are given to jax.jit)")
        compiled = _sharded_jit(core, mesh, fsdp, donate_argnums, compiler_options)

    def step(state: TrainState, batch):
        check_state_for_step(state, precision)
        if state.accumulating:
            raise RuntimeError("an accumulation window is open (backward_step(accumulate_only=True) ran): "
                               "finish it with backward_step(accumulate_only=False) before the fused step")
        if state.pending_forward is not None:
            raise RuntimeError("a split-API forward is pending: call backward_step for it before the fused step")
        check_batch(batch, need_d_out=loss_fn is None)
        if vocab_size is not None:
            check_host_token_ids(batch, vocab_size)
        return compiled(state, batch)

    step.compiled = compiled   # the jitted core (e.g. for `_cache_size()` or lowering)
    return step


def check_compiler_options(options):
    """None, or a dict of XLA option name (str) -> bool / int / float / str, copied."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise TypeError(f"compiler_options must be a dict of XLA option name -> value or None, "
                        f"got {type(options).__name__}")
    for k, v in options.items():
        if not isinstance(k, str) or not k:
            raise TypeError(f"compiler_options keys must be XLA option names (non-empty str), got {k!r}")
        if not isinstance(v, (bool, int, float, str)):
            raise TypeError(f"compiler_options[{k!r}] must be a bool, int, float or str, "
                            f"got {type(v).__name__}")
    return dict(options)


def _sharded_jit(core, mesh, fsdp, donate_argnums, compiler_options=None):
    """jax.jit(core) with explicit state/batch shardings (built from the first state's structure),
    traced and run under `jax.set_mesh(mesh)` so the ops shard their kernels over the batch."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jmamba.parallel import batch_shardings, state_shardings
    cache = {}

    def call(state, batch):
        if isinstance(state, TrainState) and state.is_flat:
            raise ValueError("a flat TrainState (TrainState.create(..., flat=True)) runs on one device: "
                             "create the state with flat=False to train with mesh=")
        key = (jax.tree.structure(state), jax.tree.structure(batch))
        if key not in cache:
            st_sh = state_shardings(state, mesh, fsdp=fsdp)
            cache[key] = jax.jit(core, in_shardings=(st_sh, batch_shardings(batch, mesh)),
                                 out_shardings=(st_sh, NamedSharding(mesh, PartitionSpec())),
                                 donate_argnums=donate_argnums, compiler_options=compiler_options)
        with jax.set_mesh(mesh):
            return cache[key](state, batch)

    call._cache_size = lambda: sum(f._cache_size() for f in cache.values())
    return call


def check_state_for_step(state, precision):
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be a jmamba.TrainState, got {type(state).__name__}")
    if check_precision(precision).needs_loss_scale and state.loss_scale is None:
        raise ValueError("precision='f16' needs the dynamic loss scale: create the state with "
                         "TrainState.create(..., precision='f16')")


def check_batch(batch, need_d_out):
    if not isinstance(batch, dict):
        raise TypeError(f"batch must be a dict with 'inputs' (and 'd_out' or what loss_fn reads), "
                        f"got {type(batch).__name__}")
    if "inputs" not in batch:
        raise ValueError("batch must contain 'inputs' (the model input)")
    if need_d_out and "d_out" not in batch:
        raise ValueError("batch must contain 'd_out' (gradient of the loss w.r.t. the model outputs) "
                         "when make_train_step was built without loss_fn")


def _row_major_residuals(vjp_fn):
    """vjp_fn with every residual array of rank ≥ 2 constrained to the row-major layout.

    Without it XLA:GPU is free to pick any layout for the arrays that cross the barrier, and for some
    of Mamba-3's [B, T, H, P] sequences it picked time-minor: one transpose on the way in and one
    back before the backward kernels (which need row-major), ~0.1 ms per layer at B=8 T=2048. The
    constraint changes no value.
    """
    def constrain(x):
        if not isinstance(x, jax.Array) or x.ndim < 2:
            return x
        return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))

    return jax.tree.map(constrain, vjp_fn)


def check_d_out(d_out, outputs):
    if shape_of(d_out) != shape_of(outputs):
        raise ValueError(f"d_out must have the shape of the model outputs {shape_of(outputs)}, "
                         f"got {shape_of(d_out)}")
    if not jnp.issubdtype(jnp.result_type(d_out), jnp.floating):
        raise TypeError(f"d_out must be floating, got dtype {jnp.result_type(d_out)}")


def token_vocab(model):
    """The vocabulary size when `model` reads token ids (a `MambaLM`), else None."""
    return model.config.vocab_size if isinstance(model, MambaLM) else None


def count_invalid_tokens(ids, vocab_size):
    """int32 count of ids outside [0, vocab_size) (traceable)."""
    ids = jnp.asarray(ids)
    return jnp.sum((ids < 0) | (ids >= vocab_size)).astype(jnp.int32)


def check_host_token_ids(batch, vocab_size, key="inputs"):
    """ValueError naming the first out-of-range id when batch[key] is a host (numpy) array.

    Device arrays are not read back here (that would stall the step); the step counts them instead."""
    ids = batch.get(key)
    if not isinstance(ids, np.ndarray) or not np.issubdtype(ids.dtype, np.integer):
        return
    bad = np.argwhere((ids < 0) | (ids >= vocab_size))
    if len(bad):
        pos = tuple(int(i) for i in bad[0])
        raise ValueError(f"batch[{key!r}]{list(pos)} = {int(ids[pos])} is not a token id in [0, {vocab_size}) "
                         f"({len(bad)} such ids in the batch)")
