"""`Interned`: a base for immutable static objects that are interned and compared by identity.

Static parts of a pytree's structure (a TrainState's `NnxLayout`, a flat tree's `FlatSpec`) are
compared by the jit cache on every call. Interning them (one object per distinct value) makes that
comparison an identity test; copies (`copy`, `deepcopy`) return the object itself, so it stays true.
Subclasses set `self._hash` in `__init__`.
"""

from __future__ import annotations


class Interned:
    __slots__ = ()

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self
