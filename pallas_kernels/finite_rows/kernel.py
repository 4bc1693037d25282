"""The finite-rows kernel over many arrays and its launch.

    ok[b] = every element of row b of every array x_k is finite        (x_k [B, ...], any float dtype)

Layout: each array is viewed as [B, R_k] (a row-major bitcast), each row cut into `block_size`
pieces (the last one masked), and the pieces of up to `max_leaves_per_call` arrays side by side as the
J columns of a [B, J] grid of programs (flattened to 1-D: program pid = b·J + j). Program (b, j) finds
its array by comparing j against static column ranges (`pl.when` per array), loads its piece of row b
and writes Σ x·0 of it to partials[b, j]: 0 when every element is finite, NaN when any is NaN or ±inf
(inf·0 = NaN). The partials of every launch are then summed over j by one XLA reduction, and a row is
finite when its sum is 0. So L arrays cost ceil(L / max_leaves_per_call) launches plus that reduction,
where checking each array with XLA costs one row reduction per array.

Numerics: exact (the products are ±0 or NaN; no rounding can turn one into the other). Deterministic:
no atomics, each partial written by one program.

Backend: GPU through Triton (`pl.pallas_call`, `plt.CompilerParams`); `interpret=True` runs the same
kernel on the CPU for tests. The pure-JAX reference is `jmamba.ops.finite_rows(...,
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
from pallas_kernels.finite_rows.config import DEFAULT_FINITE_ROWS_CONFIG, FiniteRowsConfig


@dataclasses.dataclass(frozen=True)
class _Slot:
    row: int            # elements per row of the array (R_k)
    first_column: int   # its first column of the launch's grid
    columns: int        # pieces per row: ceil(R_k / block_size)


def _kernel(*refs, slots: Sequence[_Slot], columns: int, block_size: int):
    x_refs, out_ref = refs[:len(slots)], refs[len(slots)]
    pid = pl.program_id(0)
    b, j = pid // columns, pid % columns
    for x_ref, slot in zip(x_refs, slots):
        @pl.when((j >= slot.first_column) & (j < slot.first_column + slot.columns))
        def _(x_ref=x_ref, slot=slot):
            start = (j - slot.first_column) * block_size          # within the row
            window = x_ref.at[pl.ds(b * slot.row + start, block_size)]
            if slot.row % block_size:      # only a row's last piece can run past the row's end
                mask = start + jnp.arange(block_size, dtype=I32) < slot.row
                x = plt.load(window, mask=mask, other=0).astype(F32)
            else:
                x = plt.load(window).astype(F32)
            out_ref[pl.ds(pid, 1)] = jnp.sum(x * 0.0, keepdims=True)


def _one_launch(xs, batch: int, cfg: FiniteRowsConfig, interpret: bool):
    """[B, J] float32 partials (0 or NaN) for the arrays xs (each 1-D, B·R_k elements)."""
    slots, first = [], 0
    for x in xs:
        row = int(x.size) // batch
        pieces = ceil_div(row, cfg.block_size)
        slots.append(_Slot(row=row, first_column=first, columns=pieces))
        first += pieces
    partials = pl.pallas_call(
        functools.partial(_kernel, slots=tuple(slots), columns=first, block_size=cfg.block_size),
        out_shape=jax.ShapeDtypeStruct((batch * first,), F32),
        grid=(batch * first,),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="finite_rows",
    )(*xs)
    return partials.reshape(batch, first)


def finite_rows_leaves(leaves: Sequence[jax.Array], batch_size: int, *,
                       config: Optional[FiniteRowsConfig] = None, interpret: bool = False) -> jax.Array:
    """[B] bool: True where row b of every array is finite (module docstring).

    Args:
      leaves: float arrays (float16, bfloat16 or float32), each with leading axis `batch_size`.
      batch_size: B >= 1.
      config: launch shape (`DEFAULT_FINITE_ROWS_CONFIG` when None).
      interpret: run the kernel in the Pallas interpreter (CPU tests).

    Returns:
      [B] bool; all True when no array has an element.
    """
    cfg = (config or DEFAULT_FINITE_ROWS_CONFIG).validate()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for k, x in enumerate(leaves):
        dtype = jnp.dtype(x.dtype)
        if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 4:
            raise TypeError(f"leaves[{k}] must be float16, bfloat16 or float32, got {dtype}")
        if x.ndim < 1 or x.shape[0] != batch_size:
            raise ValueError(f"leaves[{k}] must have leading axis batch_size = {batch_size}, got shape {x.shape}")
        if x.size >= 2 ** 31 - cfg.block_size:
            raise ValueError(f"leaves[{k}] has {x.size} elements; int32 offsets allow < 2**31")
    live = [x.reshape(-1) for x in leaves if x.size > 0]       # row-major: a bitcast
    if not live:
        return jnp.ones((batch_size,), bool)
    partials = [_one_launch(live[i:i + cfg.max_leaves_per_call], batch_size, cfg, interpret)
                for i in range(0, len(live), cfg.max_leaves_per_call)]
    total = jnp.sum(partials[0] if len(partials) == 1 else jnp.concatenate(partials, axis=1), axis=1)
    return total == 0.0
