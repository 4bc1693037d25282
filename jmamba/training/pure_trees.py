"""Plain-dict copies of nnx trees, and the `NnxLayout` that turns them back: one job, the form in which
`TrainState` keeps its parameters and optimizer state.

    pure = pure_tree(nnx_tree)              # every nnx.State -> dict, every nnx.Variable -> its value
    layout = NnxLayout.of(params, opt_state)   # the nnx trees' structures (interned)
    params = layout.params_to_nnx(pure_params)  # the nnx.State again (Variables with their metadata)

A pure tree holds the same leaf objects in the same order as the nnx tree it was made from (nnx.State
flattens its keys sorted, as jax flattens a dict; a Variable is one leaf), so converting either way
is an unflatten of the other structure with the same leaves: no copy, no compute. `NnxLayout.of`
checks that order once, when the layout is made.

With `flat=True` (`TrainState.create(..., flat=True)`), the pure form goes one step further: the
params, every params-shaped `nnx.State` inside the optimizer state (e.g. AdamW's moments) and the
gradient accumulator become `FlatTree`s (jmamba/core/flat_buffers.py: one flat buffer per
dtype). Converting to the nnx form then slices the buffers (free inside a traced step), and back
concatenates, except where a tree is a FlatTree already (what an in-place flat optimizer returns):
it passes as it is.

The layout is a static (hashable) part of the TrainState's pytree structure. Layouts are interned:
two states made from the same model and optimizer structure hold the same layout object, so its
equality test (the jit cache compares it on every call) is an identity test.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
from flax import nnx

from jmamba.core.flat_buffers import FlatSpec, FlatTree, is_flat
from jmamba.core.interned import Interned


def _is_nnx(x) -> bool:
    return isinstance(x, (nnx.State, nnx.Variable))


def _pure_node(x):
    if isinstance(x, nnx.Variable):
        return x.get_value()
    if isinstance(x, nnx.State):
        return nnx.to_pure_dict(x)
    return x   # an array (or other leaf) outside any nnx node, e.g. an optimizer's count


def pure_tree(tree: Any) -> Any:
    """`tree` with every `nnx.State` replaced by its plain nested dict (`nnx.to_pure_dict`) and every
    bare `nnx.Variable` by its value; other nodes (tuples, NamedTuples, dicts, None) are kept."""
    return jax.tree.map(_pure_node, tree, is_leaf=_is_nnx)


class NnxLayout(Interned):
    """The pytree structures of a TrainState's nnx trees (params, opt_state) and of their pure copies.

    Attributes:
      params_def / pure_params_def: structure of the params as an `nnx.State` / as a dict.
      opt_def / pure_opt_def: structure of the optimizer state as the optimizer made it / pure (in the
        flat layout, with FlatTree nodes).
      flat: the `FlatSpec` of the params (flat layout), or None.

    Make it with `NnxLayout.of`; instances are immutable and compared by identity (see the module
    docstring).
    """

    __slots__ = ("params_def", "pure_params_def", "opt_def", "pure_opt_def", "flat", "_hash", "__weakref__")
    _interned: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __init__(self, params_def, pure_params_def, opt_def, pure_opt_def, flat=None):
        self.params_def, self.pure_params_def = params_def, pure_params_def
        self.opt_def, self.pure_opt_def = opt_def, pure_opt_def
        self.flat = flat
        key = (params_def, pure_params_def, opt_def, pure_opt_def, flat)
        try:
            self._hash = hash(key)
        except TypeError:   # unhashable metadata somewhere: this layout is not interned
            self._hash = id(self)

    @classmethod
    def of(cls, params, opt_state, *, flat: bool = False) -> "NnxLayout":
        """The layout of the nnx trees `params` (an `nnx.State`) and `opt_state` (the optimizer's state
        for them); their leaves may be arrays, tracers or shape structs. `flat`: keep the pure
        params (and the params-shaped parts of opt_state) as `FlatTree`s."""
        defs = []
        for name, tree in (("params", params), ("opt_state", opt_state)):
            pure = pure_tree(tree)
            leaves, pure_leaves = jax.tree.leaves(tree), jax.tree.leaves(pure)
            if len(leaves) != len(pure_leaves) or any(a is not b for a, b in zip(leaves, pure_leaves)):
                raise ValueError(f"{name}: its plain-dict copy does not hold the same leaves in the same order "
                                 "(an nnx.State with keys that do not sort?)")
            defs += [jax.tree.structure(tree), jax.tree.structure(pure)]
        spec = FlatSpec.of(jax.tree.leaves(params)) if flat else None
        if spec is not None:   # the pure optimizer state holds FlatTrees where it has params-shaped States
            holder = FlatTree([0] * len(spec.buffers), spec)
            params_def = defs[0]
            defs[3] = jax.tree.structure(jax.tree.map(
                lambda x: holder if isinstance(x, nnx.State) and jax.tree.structure(x) == params_def
                else _pure_node(x), opt_state, is_leaf=_is_nnx))
        defs.append(spec)
        key = tuple(defs)
        try:
            found = cls._interned.get(key)
        except TypeError:
            return cls(*defs)
        if found is None:
            found = cls(*defs)
            cls._interned[key] = found
        return found

    def __repr__(self):
        return (f"NnxLayout({self.params_def.num_leaves} parameter leaves, "
                f"{self.opt_def.num_leaves} optimizer-state leaves{', flat' if self.flat else ''})")

    # ---------------------------------------------------------------- conversions (either input form)
    @staticmethod
    def _convert(tree, to_def, other_def, name):
        if tree is None:
            return None
        leaves, tdef = jax.tree.flatten(tree)
        if tdef != to_def and tdef != other_def:
            raise ValueError(f"{name} does not have the structure this TrainState was created with "
                             f"(another model or optimizer?): {tdef.num_leaves} leaves, expected "
                             f"{to_def.num_leaves} in the structure of TrainState.create")
        return to_def.unflatten(leaves)

    def _unflat(self, tree, name):
        """The leaves of the FlatTree `tree` as the pure params dict."""
        if tree.spec is not self.flat:
            raise ValueError(f"{name} is a flat tree of another layout ({tree.spec!r}; expected {self.flat!r})")
        return self.pure_params_def.unflatten(tree.unpack())

    def params_to_nnx(self, params, name="params"):
        """The `nnx.State` of `params` (a pure dict or FlatTree, or already the nnx.State); also for
        grad_accum."""
        if is_flat(params):
            params = self._unflat(params, name)
        return self._convert(params, self.params_def, self.pure_params_def, name)

    def params_to_pure(self, params, name="params"):
        """The pure form of `params` (an nnx.State, or already pure): the plain dict, or a FlatTree in
        the flat layout."""
        if self.flat is None or params is None:
            return self._convert(params, self.pure_params_def, self.params_def, name)
        if is_flat(params):
            if params.spec is not self.flat:
                raise ValueError(f"{name} is a flat tree of another layout")
            return params
        return FlatTree.pack(jax.tree.leaves(self._convert(params, self.pure_params_def, self.params_def, name)),
                             self.flat)

    def _is_params_state(self, x) -> bool:
        return isinstance(x, nnx.State) and jax.tree.structure(x) == self.params_def

    def opt_to_nnx(self, opt_state):
        """The optimizer's own form of `opt_state` (pure, or already in that form)."""
        if self.flat is not None and opt_state is not None:
            if jax.tree.structure(opt_state) == self.opt_def:
                return opt_state
            # FlatTrees -> their pure dicts: then the leaves are those of the optimizer's form, in order
            unflat = jax.tree.map(lambda x: self._unflat(x, "opt_state") if is_flat(x) else x,
                                  opt_state, is_leaf=is_flat)
            return self._relabel(unflat)
        return self._convert(opt_state, self.opt_def, self.pure_opt_def, "opt_state")

    def _relabel(self, opt_state):
        """`opt_state` (any form without FlatTrees: nnx, pure dicts, or a mix) in the optimizer's form."""
        leaves = jax.tree.leaves(opt_state)
        if len(leaves) != self.opt_def.num_leaves:
            raise ValueError(f"opt_state does not have the structure this TrainState was created with "
                             f"(another model or optimizer?): {len(leaves)} leaves, expected "
                             f"{self.opt_def.num_leaves}")
        return self.opt_def.unflatten(leaves)

    def opt_to_pure(self, opt_state):
        """The pure form of `opt_state` (the optimizer's form, or already pure). In the flat layout its
        params-shaped nnx.States become FlatTrees, and FlatTrees in it pass as they are."""
        if self.flat is None or opt_state is None:
            return self._convert(opt_state, self.pure_opt_def, self.opt_def, "opt_state")
        if jax.tree.structure(opt_state) == self.pure_opt_def:
            return opt_state
        if not any(is_flat(x) for x in jax.tree.leaves(opt_state, is_leaf=is_flat)):
            opt_state = self._relabel(opt_state)

        def node(x):
            if is_flat(x):
                if x.spec is not self.flat:
                    raise ValueError("opt_state holds a flat tree of another layout")
                return x
            if self._is_params_state(x):
                return FlatTree.pack(jax.tree.leaves(x), self.flat)
            return _pure_node(x)

        out = jax.tree.map(node, opt_state, is_leaf=lambda x: is_flat(x) or _is_nnx(x))
        if jax.tree.structure(out) != self.pure_opt_def:
            raise ValueError("opt_state does not have the structure this TrainState was created with "
                             "(another model or optimizer?)")
        return out

    def fits(self, params, opt_state) -> bool:
        """Whether `params` and `opt_state` have this layout's nnx structures (in the flat layout,
        parts of them may be this layout's FlatTrees)."""
        if is_flat(params):
            if params.spec is not self.flat:
                return False
        elif jax.tree.structure(params) != self.params_def:
            return False
        if self.flat is not None:
            opt_state = jax.tree.map(lambda x: self.params_def.unflatten([0] * self.params_def.num_leaves)
                                     if is_flat(x) and x.spec is self.flat else x, opt_state, is_leaf=is_flat)
        return jax.tree.structure(opt_state) == self.opt_def
