"""`FlatTree`: the leaves of a pytree stored in one flat 1-D buffer per dtype.

    spec = FlatSpec.of(leaves)              # static: each leaf's shape, dtype, buffer and offset
    flat = FlatTree.pack(leaves, spec)      # one concatenate per dtype (zero padding between leaves)
    leaves = flat.unpack()                  # a slice + reshape per leaf (free inside a jitted step)

Why: a jitted call pays host time per argument and result buffer. A TrainState of the 130m LM holds
~750 buffers (params and both AdamW moments); on the H100 host, dispatching a call with them took
4.2 ms and waiting for them 2.5 ms more, against 0.3 + 0.1 ms for the same state in flat buffers
(benchmarks/bench_host_dispatch.py, BENCHMARKS.md). `TrainState.create(..., flat=True)` keeps
params, optimizer moments and the gradient accumulator as FlatTrees; the step unpacks them inside
the traced code, and `jmamba.fused_adamw` updates the flat buffers in place (one kernel pass, the
same per-element arithmetic), so no concatenate runs per step.

Layout: leaves are laid out in pytree-flatten order, each starting at a multiple of `ALIGN`
elements (512 bytes of float32: aligned vector loads), row-major (`x.reshape(-1)`); the gaps are
zeros and are never read as part of a leaf.

A `FlatSpec` is interned (two equal specs are one object) and compared by identity: the jit cache
compares it on every call, as part of the TrainState's pytree structure.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jmamba.core.interned import Interned

ALIGN = 128   # elements; each leaf starts at a multiple of it


class FlatSpec(Interned):
    """Where each leaf of a flat tree lives.

    Attributes:
      shapes / dtypes: per leaf, in flatten order.
      buffers: per buffer, (dtype, length in elements); one buffer per distinct leaf dtype, in order
        of first appearance.
      places: per leaf, (buffer index, offset in elements).
      sizes: per leaf, its number of elements.
    """

    __slots__ = ("shapes", "dtypes", "buffers", "places", "sizes", "_hash", "__weakref__")
    _interned: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()

    def __init__(self, shapes, dtypes, buffers, places, key):
        self.shapes, self.dtypes, self.buffers, self.places = shapes, dtypes, buffers, places
        self.sizes = tuple(int(np.prod(s, dtype=np.int64)) for s in shapes)
        self._hash = hash(key)

    @classmethod
    def of(cls, leaves: Sequence) -> "FlatSpec":
        """The spec for `leaves` (arrays, tracers or shape structs), interned."""
        shapes = tuple(tuple(int(d) for d in jnp.shape(x)) for x in leaves)
        dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
        key = (shapes, tuple(str(d) for d in dtypes))
        found = cls._interned.get(key)
        if found is not None:
            return found
        order, lengths, places = [], {}, []
        for shape, dtype in zip(shapes, dtypes):
            if dtype not in lengths:
                order.append(dtype)
                lengths[dtype] = 0
            offset = lengths[dtype]
            places.append((order.index(dtype), offset))
            lengths[dtype] = offset + -(-int(np.prod(shape, dtype=np.int64)) // ALIGN) * ALIGN
        spec = cls(shapes, dtypes, tuple((d, lengths[d]) for d in order), tuple(places), key)
        cls._interned[key] = spec
        return spec

    @property
    def num_leaves(self) -> int:
        return len(self.shapes)

    def __repr__(self):
        return (f"FlatSpec({self.num_leaves} leaves in "
                + ", ".join(f"{d}[{n}]" for d, n in self.buffers) + ")")


@jax.tree_util.register_pytree_node_class
class FlatTree:
    """The leaves of a tree as flat buffers (children) with their `FlatSpec` (static).

    Attributes:
      buffers: tuple of 1-D arrays, one per `spec.buffers` entry.
      spec: the `FlatSpec`.
    """

    __slots__ = ("buffers", "spec")

    def __init__(self, buffers, spec: FlatSpec):
        self.buffers, self.spec = tuple(buffers), spec

    def tree_flatten(self):
        return self.buffers, self.spec

    @classmethod
    def tree_unflatten(cls, spec, buffers):
        return cls(buffers, spec)

    @classmethod
    def pack(cls, leaves: Sequence, spec: FlatSpec) -> "FlatTree":
        """`leaves` (in flatten order, with `spec`'s shapes and dtypes) copied into flat buffers."""
        leaves = list(leaves)
        if len(leaves) != spec.num_leaves:
            raise ValueError(f"expected {spec.num_leaves} leaves for this flat layout, got {len(leaves)}")
        parts = [[] for _ in spec.buffers]
        ends = [0] * len(spec.buffers)
        for k, (x, (b, off)) in enumerate(zip(leaves, spec.places)):
            if tuple(jnp.shape(x)) != spec.shapes[k] or jnp.dtype(x.dtype) != spec.dtypes[k]:
                raise ValueError(f"leaf {k} is {jnp.dtype(x.dtype)}{list(jnp.shape(x))}; this flat layout "
                                 f"holds {spec.dtypes[k]}{list(spec.shapes[k])} there")
            if off > ends[b]:
                parts[b].append(jnp.zeros((off - ends[b],), spec.buffers[b][0]))
            parts[b].append(jnp.reshape(x, (-1,)))
            ends[b] = off + spec.sizes[k]
        buffers = []
        for b, (dtype, length) in enumerate(spec.buffers):
            if length > ends[b]:
                parts[b].append(jnp.zeros((length - ends[b],), dtype))
            buffers.append(jnp.concatenate(parts[b]) if len(parts[b]) > 1 else parts[b][0])
        return cls(buffers, spec)

    def leaf(self, k: int):
        """Leaf k (a slice of its buffer, reshaped: a copy outside jit, free inside a traced step)."""
        b, off = self.spec.places[k]
        return jax.lax.slice(self.buffers[b], (off,), (off + self.spec.sizes[k],)).reshape(self.spec.shapes[k])

    def unpack(self) -> list:
        """All leaves, in flatten order."""
        return [self.leaf(k) for k in range(self.spec.num_leaves)]

    def offsets(self, buffer: int = 0) -> tuple:
        """The static offsets of the leaves (all of them must live in `buffer`)."""
        if any(b != buffer for b, _ in self.spec.places):
            raise ValueError("not every leaf lives in buffer %d (leaves of several dtypes)" % buffer)
        return tuple(off for _, off in self.spec.places)

    def __repr__(self):
        return f"FlatTree({self.spec!r})"


def is_flat(x) -> bool:
    return isinstance(x, FlatTree)
