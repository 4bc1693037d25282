"""Plain-dict copies of nnx trees, and the `NnxLayout` that turns them back: one job, the form in which
`TrainState` keeps its parameters and optimizer state.

    pure = pure_tree(nnx_tree)              # every nnx.State -> dict, every nnx.Variable -> its value
    layout = NnxLayout.of(params, opt_state)   # the nnx trees' structures (interned)
    params = layout.params_to_nnx(pure_params)  # the nnx.State again (Variables with their metadata)

A pure tree holds the same leaf objects in the same order as the nnx tree it was made from (nnx.State
flattens its keys sorted, as jax flattens a dict; a Variable is one leaf), so converting either way
is an unflatten of the other structure with the same leaves: no copy, no compute. `NnxLayout.of`
checks that order once, when the layout is made.

The layout is a static (hashable) part of the TrainState's pytree structure. Layouts are interned:
two states made from the same model and optimizer structure hold the same layout object, so its
equality test (the jit cache compares it on every call) is an identity test.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
from flax import nnx


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


class NnxLayout:
    """The pytree structures of a TrainState's nnx trees (params, opt_state) and of their pure copies.

    Attributes:
      params_def / pure_params_def: structure of the params as an `nnx.State` / as a dict.
      opt_def / pure_opt_def: structure of the optimizer state as the optimizer made it / pure.

    Make it with `NnxLayout.of`; instances are immutable and compared by identity (see the module
    docstring).
    """

    __slots__ = ("params_def", "pure_params_def", "opt_def", "pure_opt_def", "_hash", "__weakref__")
    _interned: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __init__(self, params_def, pure_params_def, opt_def, pure_opt_def):
        self.params_def, self.pure_params_def = params_def, pure_params_def
        self.opt_def, self.pure_opt_def = opt_def, pure_opt_def
        key = (params_def, pure_params_def, opt_def, pure_opt_def)
        try:
            self._hash = hash(key)
        except TypeError:   # unhashable metadata somewhere: this layout is not interned
            self._hash = id(self)

    @classmethod
    def of(cls, params, opt_state) -> "NnxLayout":
        """The layout of the nnx trees `params` (an `nnx.State`) and `opt_state` (the optimizer's state
        for them); their leaves may be arrays, tracers or shape structs."""
        defs = []
        for name, tree in (("params", params), ("opt_state", opt_state)):
            pure = pure_tree(tree)
            leaves, pure_leaves = jax.tree.leaves(tree), jax.tree.leaves(pure)
            if len(leaves) != len(pure_leaves) or any(a is not b for a, b in zip(leaves, pure_leaves)):
                raise ValueError(f"{name}: its plain-dict copy does not hold the same leaves in the same order "
                                 "(an nnx.State with keys that do not sort?)")
            defs += [jax.tree.structure(tree), jax.tree.structure(pure)]
        key = tuple(defs)
        try:
            found = cls._interned.get(key)
        except TypeError:
            return cls(*defs)
        if found is None:
            found = cls(*defs)
            cls._interned[key] = found
        return found

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return (f"NnxLayout({self.params_def.num_leaves} parameter leaves, "
                f"{self.opt_def.num_leaves} optimizer-state leaves)")

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

    def params_to_nnx(self, params, name="params"):
        """The `nnx.State` of `params` (a pure dict, or already the nnx.State); also for grad_accum."""
        return self._convert(params, self.params_def, self.pure_params_def, name)

    def params_to_pure(self, params, name="params"):
        """The plain dict of `params` (an nnx.State, or already the dict)."""
        return self._convert(params, self.pure_params_def, self.params_def, name)

    def opt_to_nnx(self, opt_state):
        """The optimizer's own form of `opt_state` (pure, or already in that form)."""
        return self._convert(opt_state, self.opt_def, self.pure_opt_def, "opt_state")

    def opt_to_pure(self, opt_state):
        """The pure form of `opt_state` (the optimizer's form, or already pure)."""
        return self._convert(opt_state, self.pure_opt_def, self.opt_def, "opt_state")

    def fits(self, params, opt_state) -> bool:
        """Whether nnx trees `params` and `opt_state` have this layout's nnx structures."""
        return jax.tree.structure(params) == self.params_def and jax.tree.structure(opt_state) == self.opt_def
