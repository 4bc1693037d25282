"""One Pallas-Triton launch with named refs: the `pl.pallas_call` every scan kernel goes through.

Kernels are written against a dict of refs keyed by operand name, so an optional operand (absent
bias, no gate, no reset mask) simply has no entry instead of shifting every positional ref after it.
`run_kernel` builds the `pallas_call` (grid, block specs, output shapes, Triton `num_warps` /
`num_stages`, kernel name, interpret flag) and returns the outputs by name.

This is the only module of `pallas_kernels.common` that imports `jax.experimental.pallas`.
"""

from __future__ import annotations

from typing import Callable, Sequence

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def run_kernel(body: Callable[[dict], None], *, grid: tuple[int, ...], inputs: Sequence[tuple],
               outputs: Sequence[tuple], name: str, num_warps: int, num_stages: int, interpret: bool) -> dict:
    """Launches `body` over `grid` with named refs.

    Args:
      body: `body(refs: dict[str, Ref])`, the kernel; the refs of inputs and outputs by name.
      grid: the Pallas grid (the scan kernels use one flat axis, see common/grid.py).
      inputs: (name, array, BlockSpec) per operand; entries whose array is None are left out.
      outputs: (name, ShapeDtypeStruct, BlockSpec) per result.
      name: the kernel name (shows up in profiles and in the lowered module).
      num_warps, num_stages: Triton warps per program and software-pipelining depth.
      interpret: run in the Pallas interpreter (CPU) instead of lowering to Triton.

    Returns:
      dict output name -> array.
    """
    inputs = [i for i in inputs if i[1] is not None]
    in_names = [n for n, _, _ in inputs]
    out_names = [n for n, _, _ in outputs]

    def kernel(*refs):
        body(dict(zip(in_names + out_names, refs)))

    results = pl.pallas_call(
        kernel,
        out_shape=[s for _, s, _ in outputs],
        grid=grid,
        in_specs=[s for _, _, s in inputs],
        out_specs=[s for _, _, s in outputs],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*[a for _, a, _ in inputs])
    return dict(zip(out_names, results))
