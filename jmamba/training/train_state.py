"""`TrainState`: everything a training step reads and writes, as one pytree.

Fields (arrays):
  params: float32 master parameters as a plain nested dict of arrays (`nnx.to_pure_dict` of the
    model's `nnx.State` of `nnx.Param`s: `params['layers'][0]['mixer']['A_log']`, same leaves in the
    same order). `nnx_params()` gives the `nnx.State` (Variables with their metadata). With
    `create(..., flat=True)` a `FlatTree` instead (one flat buffer; params-shaped parts of opt_state
    and grad_accum likewise): docs/training_loop.md §8.
  opt_state: the optax optimizer state for `params`, with every params-shaped `nnx.State` in it as a
    plain dict too (its NamedTuples, tuples and counts as the optimizer made them: e.g. a
    `FusedAdamWState(count, mu, nu)` whose mu and nu are dicts). `nnx_opt_state()` gives the
    optimizer's own state.
  recurrent_state: the model's recurrent state carried between windows (`model.init_state(B)`).
  step: int32 scalar, the number of applied training steps (train-step calls and applying
    `backward_step`s that were not skipped; the checkpoint number). Under `optax.MultiSteps` each is
    a micro-step.
  updates: int32 scalar, the number of optimizer updates that changed the parameters (equal to
    `step` except under `optax.MultiSteps`, which updates every k-th micro-step).
  consecutive_skips: int32 scalar, how many steps in a row the non-finite guard (or the f16 loss
    scaler) skipped; 0 after an applied step.
  loss_scale: `DynamicLossScale` for float16 training, else None.
  grad_accum: float32 gradient accumulator (a dict like params) when created with `accumulate=True`.

Static fields (host-side bookkeeping, not arrays; checked before anything runs):
  accumulating: an accumulation window is open (micro-batch gradients wait in `grad_accum`).
  pending_forward: token of a split-API `forward` whose `backward_step` has not run yet.
  nnx_layout: the `NnxLayout` that turns params / opt_state / grad_accum back into the nnx trees they
    were made from (None for a state built by hand from nnx trees, which is then used as given).

Why plain dicts: the train step is one jitted call, and jax flattens its arguments and unflattens its
results on every call. Dicts, tuples and NamedTuples are flattened by jax's C++ pytree code, while
each `nnx.Variable` costs a Python callback both ways (and a new Variable object on the way out).
For a 130m-class LM (~780 leaves with AdamW's moments) that was ~2 ms of host time per call on a CPU
(benchmarks/bench_host_dispatch.py). The step rebuilds the nnx trees inside the traced code (free at
run time), so models and optimizers (masks built from `no_decay_mask(model)`, schedules, chains)
see exactly what they saw before, and the results are bit-identical.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jmamba.core.precision import Precision, as_training_precision
from jmamba.core.validation import check_bool
from jmamba.training.loss_scale import DynamicLossScale
from jmamba.training.optimizer_update import check_optimizer
from jmamba.training.pure_trees import NnxLayout

# Kept for code that looked precisions up by name; `jmamba.Precision` is the type.
PRECISIONS = {p.value: p.compute_dtype for p in (Precision.F32, Precision.BF16, Precision.F16)}


def check_precision(precision) -> Precision:
    """The training `Precision` of "f32" / "bf16" / "f16" (or a Precision / dtype); ValueError otherwise."""
    return as_training_precision(precision)


def _placement(kind):
    """Field metadata read by `jmamba.parallel.state_shardings`: "weights" (replicated, or split with
    FSDP), "rows" (split over the batch axis) or "replicated"."""
    return {"placement": kind}


class TrainState(struct.PyTreeNode):
    params: Any = struct.field(metadata=_placement("weights"))
    opt_state: Any = struct.field(metadata=_placement("weights"))
    recurrent_state: Any = struct.field(metadata=_placement("rows"))
    step: jax.Array = struct.field(metadata=_placement("replicated"))
    updates: jax.Array = struct.field(metadata=_placement("replicated"), default=None)
    consecutive_skips: jax.Array = struct.field(metadata=_placement("replicated"), default=None)
    loss_scale: Optional[DynamicLossScale] = struct.field(metadata=_placement("replicated"), default=None)
    grad_accum: Any = struct.field(metadata=_placement("weights"), default=None)
    accumulating: bool = struct.field(pytree_node=False, default=False)
    pending_forward: Optional[int] = struct.field(pytree_node=False, default=None)
    nnx_layout: Optional[NnxLayout] = struct.field(pytree_node=False, default=None)

    # Checkpoints written before a field existed restore it from another leaf, or as zeros for None
    # (see jmamba.io.checkpoint).
    checkpoint_upgrades = {".updates": ".step", ".consecutive_skips": None}

    @classmethod
    def create(cls, model: nnx.Module, optimizer, batch_size: int,
               *, precision="f32", accumulate: bool = False, flat: bool = False) -> "TrainState":
        """Initial state: float32 master copies of the model's parameters, a fresh optimizer, zero state.

        Args:
          model: an nnx module with `init_state(batch)` (a backbone or `MambaLM`).
          optimizer: any optax transformation (e.g. `optax.adamw(...)`, `jmamba.fused_adamw(...)`, an
            `optax.chain`) or an `optax.MultiSteps`.
          batch_size: rows of the carried recurrent state.
          precision: "f32", "bf16" or "f16"; "f16" creates the dynamic loss scale.
          accumulate: allocate a float32 gradient accumulator (for `backward_step(accumulate_only=True)`).
          flat: keep params, the params-shaped optimizer state (AdamW's moments) and the accumulator
            in one flat float32 buffer each (`jmamba.core.flat_buffers`) instead of one array
            per leaf: a jitted step then passes a few dozen buffers instead of hundreds, which cuts
            the host time per call (4.2 -> 0.3 ms to dispatch the 130m LM's state on an H100 host).
            `jmamba.fused_adamw` (alone) updates the buffers in place; other optimizers run on the
            unpacked leaves and the step packs their results (one copy per step). The values are
            bit-identical to the default layout. Single device only (no `mesh=`). `params` is then
            a `FlatTree`; `nnx_params()`, `to_model` and checkpoints give the usual trees.
        """
        precision = check_precision(precision)
        check_bool("flat", flat)
        check_optimizer(optimizer)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not hasattr(model, "init_state"):
            raise TypeError(f"model must have init_state(batch) (a backbone or MambaLM), got {type(model).__name__}")
        bad = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
               if v.dtype != jnp.float32]
        if bad:
            raise TypeError(f"master parameters must be float32; these are not: {bad[:5]}")
        # A copy: the train step donates its input buffers, which must not be the model's own arrays.
        params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
        view = cls(params=params, opt_state=optimizer.init(params),
                   recurrent_state=model.init_state(batch_size),
                   step=jnp.zeros((), jnp.int32), updates=jnp.zeros((), jnp.int32),
                   consecutive_skips=jnp.zeros((), jnp.int32),
                   loss_scale=DynamicLossScale.create() if precision.needs_loss_scale else None,
                   grad_accum=jax.tree.map(jnp.zeros_like, params) if accumulate else None)
        return cls.from_nnx_view(view, NnxLayout.of(view.params, view.opt_state, flat=flat))

    @property
    def is_flat(self) -> bool:
        """Whether params and optimizer state are kept in flat buffers (`create(..., flat=True)`)."""
        return self.nnx_layout is not None and self.nnx_layout.flat is not None

    # ------------------------------------------------------------------ the nnx trees
    def nnx_params(self) -> nnx.State:
        """The parameters as the `nnx.State` of `nnx.Param`s the model has (Variables carrying their
        metadata, e.g. the no-decay tags `jmamba.no_decay_mask` reads); the same arrays, not copies.
        Builds ~one Variable per leaf: for occasional use (`nnx.update(model, ...)` also takes the
        plain `params`)."""
        return self.params if self.nnx_layout is None else self.nnx_layout.params_to_nnx(self.params)

    def nnx_opt_state(self):
        """The optimizer state as the optimizer made it (its params-shaped parts as `nnx.State`s);
        the same arrays, not copies."""
        return self.opt_state if self.nnx_layout is None else self.nnx_layout.opt_to_nnx(self.opt_state)

    def nnx_view(self) -> "TrainState":
        """This state with params, opt_state and grad_accum as the nnx trees the model and optimizer
        use (and `nnx_layout` None): what the training code runs on inside the traced step, and the
        tree checkpoints store (its key paths are those of the original nnx.State layout). Same arrays."""
        layout = self.nnx_layout
        if layout is None:
            return self
        return self.replace(params=layout.params_to_nnx(self.params), opt_state=layout.opt_to_nnx(self.opt_state),
                            grad_accum=layout.params_to_nnx(self.grad_accum, "grad_accum"), nnx_layout=None)

    @classmethod
    def from_nnx_view(cls, view: "TrainState", layout: Optional[NnxLayout]) -> "TrainState":
        """The state `view` (params, opt_state and grad_accum as nnx trees) in the plain-dict form of
        `layout`. With `layout` None, `view` is returned as it is. When the trees no longer have
        `layout`'s structure (an optimizer whose state changed shape), a new layout is made."""
        if layout is None:
            return view
        if not layout.fits(view.params, view.opt_state):
            layout = NnxLayout.of(view.params, view.opt_state, flat=layout.flat is not None)
        return view.replace(params=layout.params_to_pure(view.params), opt_state=layout.opt_to_pure(view.opt_state),
                            grad_accum=layout.params_to_pure(view.grad_accum, "grad_accum"), nnx_layout=layout)

    # jmamba.io.checkpoint stores `checkpoint_tree()` and restores through `like.from_checkpoint_tree`:
    # checkpoints keep the key paths of the nnx.State layout (`.params[...]['kernel'].value`), so
    # checkpoints written before the plain-dict layout restore as they are, and older jmamba reads new ones.
    def checkpoint_tree(self) -> "TrainState":
        """The tree `jmamba.io.checkpoint` stores for this state (`nnx_view()`)."""
        return self.nnx_view()

    def from_checkpoint_tree(self, tree: "TrainState") -> "TrainState":
        """The state restored from `tree` (a `checkpoint_tree()` of the same structure), in this state's form."""
        return type(self).from_nnx_view(tree, self.nnx_layout)

    def to_model(self, model: nnx.Module) -> nnx.Module:
        """A copy of `model` (the same structure) holding this state's trained parameters.

        The arrays are copied, so the returned model stays valid when this state is later donated
        to a train step (which updates the parameters in place). `model` itself is not changed.

        Raises:
          RuntimeError when this TrainState was already donated (use the state the step returned).
        """
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be the nnx.Module this state trains, got {type(model).__name__}")
        leaves = jax.tree.leaves(self.params)
        if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
            raise RuntimeError("this TrainState was donated to a train step and its arrays are gone; call "
                               "to_model on the state the step returned")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        mine = self.nnx_params()
        if jax.tree.structure(params) != jax.tree.structure(mine):
            raise ValueError("model does not have the parameter structure of this TrainState "
                             "(a model of another config or architecture?)")
        return nnx.merge(graphdef, jax.tree.map(jnp.copy, mine), rest)

    def reset_recurrent_state(self, rows=None) -> "TrainState":
        """Zeroes the carried state (all rows, or rows where the [B] bool mask `rows` is True)."""
        if rows is None:
            return self.replace(recurrent_state=jax.tree.map(jnp.zeros_like, self.recurrent_state))
        rows = jnp.asarray(rows, bool)

        def zero(a):
            return jnp.where(rows.reshape((-1,) + (1,) * (a.ndim - 1)), 0, a)

        return self.replace(recurrent_state=jax.tree.map(zero, self.recurrent_state))
