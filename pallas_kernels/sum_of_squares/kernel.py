"""The sum-of-squares kernel over many arrays and its launch.

    total = Σ_k Σ_i x_k[i]²          (float32; each x_k of any float dtype, read once, upcast)

Layout ("multi-tensor", as the fused AdamW kernel): each array is viewed as 1-D (a bitcast), cut into
`block_size` pieces, and the pieces of up to `max_leaves_per_call` arrays lie end to end on one 1-D
grid. Program `pid` finds its array by comparing against static start offsets (`pl.when` per array),
loads its piece (the array's last piece masked with zeros), and writes Σ x² of the piece to
partials[pid]. The partials of every launch are then summed by one XLA reduction. So a list of L
arrays costs ceil(L / max_leaves_per_call) kernel launches plus that reduction, where summing each
array with XLA costs one or two reductions per array.

Numerics: float32 squares and sums; the order differs from a per-array `jnp.sum` (pieces of
`block_size` summed inside the program, then the partials), so results agree to float32 rounding, and
a rerun is bit-identical (no atomics: every partial is written by one program, reduced in a fixed
order). A NaN anywhere gives NaN; an inf (or a square beyond float32 range) gives inf.

Backend: GPU through Triton (`pl.pallas_call`, `plt.CompilerParams`); `interpret=True` runs the same
kernel on the CPU for tests. The pure-JAX reference is `jmamba.ops.sum_of_squares(...,
implementation="reference")`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common.dtypes import F32, I32
from pallas_kernels.common.sizes import ceil_div
from pallas_kernels.sum_of_squares.config import DEFAULT_SUM_OF_SQUARES_CONFIG, SumOfSquaresConfig


@dataclasses.dataclass(frozen=True)
class _Slot:
    size: int          # elements of the array
    first_block: int   # its first program id in the launch
    blocks: int        # programs over it


def _kernel(*refs, slots: Sequence[_Slot], block_size: int):
    x_refs, out_ref = refs[:len(slots)], refs[len(slots)]
    pid = pl.program_id(0)
    for x_ref, slot in zip(x_refs, slots):
        @pl.when((pid >= slot.first_block) & (pid < slot.first_block + slot.blocks))
        def _(x_ref=x_ref, slot=slot):
            offset = pl.multiple_of((pid - slot.first_block) * block_size, block_size)
            window = x_ref.at[pl.ds(offset, block_size)]
            if slot.size % block_size:   # only the last piece can run past the end
                mask = offset + jnp.arange(block_size, dtype=I32) < slot.size
                x = plt.load(window, mask=mask, other=0).astype(F32)
            else:
                x = plt.load(window).astype(F32)
            out_ref[pl.ds(pid, 1)] = jnp.sum(x * x, keepdims=True)


def _one_launch(xs, cfg: SumOfSquaresConfig, interpret: bool):
    slots, first = [], 0
    for x in xs:
        blocks = ceil_div(int(x.size), cfg.block_size)
        slots.append(_Slot(size=int(x.size), first_block=first, blocks=blocks))
        first += blocks
    return pl.pallas_call(
        functools.partial(_kernel, slots=tuple(slots), block_size=cfg.block_size),
        out_shape=jax.ShapeDtypeStruct((first,), F32),
        grid=(first,),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="sum_of_squares",
    )(*xs)


def sum_of_squares_leaves(leaves: Sequence[jax.Array], *, config: Optional[SumOfSquaresConfig] = None,
                          interpret: bool = False) -> jax.Array:
    """Σ over every element of every array of x², float32 scalar (module docstring).

    Args:
      leaves: float arrays (float16, bfloat16 or float32; any shapes, empty ones allowed).
      config: launch shape (`DEFAULT_SUM_OF_SQUARES_CONFIG` when None).
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      float32 scalar; 0.0 when there is no element.
    """
    cfg = (config or DEFAULT_SUM_OF_SQUARES_CONFIG).validate()
    for k, x in enumerate(leaves):
        dtype = jnp.dtype(x.dtype)
        if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 4:
            raise TypeError(f"leaves[{k}] must be float16, bfloat16 or float32, got {dtype}")
        if x.size >= 2 ** 31 - cfg.block_size:
            raise ValueError(f"leaves[{k}] has {x.size} elements; int32 offsets allow < 2**31")
    live = [x.reshape(-1) for x in leaves if x.size > 0]       # row-major: a bitcast
    if not live:
        return jnp.zeros((), F32)
    partials = [_one_launch(live[i:i + cfg.max_leaves_per_call], cfg, interpret)
                for i in range(0, len(live), cfg.max_leaves_per_call)]
    return jnp.sum(partials[0] if len(partials) == 1 else jnp.concatenate(partials))
