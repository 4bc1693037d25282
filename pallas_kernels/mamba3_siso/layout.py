"""HBM layouts, program grids and block specs of the Mamba-3 SISO kernels: how each array is cut.

The arrays the kernels see are already padded by `scan.py`: T is a multiple of the chunk L, headdim
is Pp and d_state Np (powers of two, d_state in the kernel layout of config.py). The chunk kernels
read per-head queries / keys (biased, rotated, keys scaled, in the dot operand dtype) formed by the
query/key kernel from the per-group Q, K.

Layouts (HBM):
  group rows     [Bt, Tp, G, Np]      Q, K (activation dtype) and dQ, dK (float32, per head slice)
  head rows      [Bt, Tp, H, w]       w = Np: queries q, keys k̃ and their float32 gradients;
                                      w = Pp: V, Z, out, d_out, dV, dZ
  sequences      [Bt, H, Tp]          ADT, skip D + γ⟨q̄, k̄⟩ and their gradients (float32)
  chunk states   [Bt, H, nc, Pp, Np]  a per-chunk state: a chunk's own contribution, the state entering
                                      it (forward) or the adjoint of the state leaving it (backward)
  chunk scalars  [Bt, H, nc]          e^{Σ ADT} of each chunk (float32)
  states         [Bt, H, Pp, Np]      the initial / final state and their adjoints (float32)

Grids are flattened to one axis, so that every `vmap` of a `pallas_call` (which prepends a grid axis)
still fits Triton's three:
  chunk grid  program (b, c, h), h fastest: one chunk of one head per program;
  state grid  program (b, h, j): j = block of `state_block_p` headdim rows; each walks all chunks
              (the combine of state_passes.py);
  group grid  program (b, c, g, j): c = chunk, g = group, j = one of `qk_splits` slices of the
              group's heads; each walks the heads of its slice (the query/key kernels). Per-head
              arrays are viewed as [Bt, Tp, G, splits, heads per slice, ...] (a free reshape); that
              last axis of a block need not be a power of two, since a program only ever loads one
              head of it (a dynamic index).
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.mamba3_siso.config import ScanGeometry


@dataclasses.dataclass(frozen=True)
class ChunkGrid:
    """Programs (b, c, h) over batch rows, chunks and heads; each owns one chunk of one head."""

    geo: ScanGeometry

    @property
    def size(self):
        g = self.geo
        return (g.batch * g.n_chunks * g.heads,)

    def head(self, p):
        return p % self.geo.heads

    def chunk(self, p):
        return (p // self.geo.heads) % self.geo.n_chunks

    def row(self, p):
        return p // (self.geo.heads * self.geo.n_chunks)

    # ---- block specs (index maps get the flat program id)
    def head_rows(self, width):
        return pl.BlockSpec((None, self.geo.chunk, None, width),
                            lambda p: (self.row(p), self.chunk(p), self.head(p), 0))

    def sequence(self):
        return pl.BlockSpec((None, None, self.geo.chunk), lambda p: (self.row(p), self.head(p), self.chunk(p)))

    def chunk_state(self):
        return pl.BlockSpec((None, None, None, self.geo.padded_headdim, self.geo.padded_state),
                            lambda p: (self.row(p), self.head(p), self.chunk(p), 0, 0))


@dataclasses.dataclass(frozen=True)
class StateGrid:
    """Programs (b, h, j) over batch rows, heads and blocks of headdim rows; each walks all chunks."""

    geo: ScanGeometry

    @property
    def n_row_blocks(self):
        return self.geo.padded_headdim // self.geo.state_block_p

    @property
    def size(self):
        g = self.geo
        return (g.batch * g.heads * self.n_row_blocks,)

    def row_block(self, p):
        return p % self.n_row_blocks

    def head(self, p):
        return (p // self.n_row_blocks) % self.geo.heads

    def row(self, p):
        return p // (self.n_row_blocks * self.geo.heads)

    def chunk_scalars(self):
        return pl.BlockSpec((None, None, self.geo.n_chunks), lambda p: (self.row(p), self.head(p), 0))

    def chunk_states(self):
        return pl.BlockSpec((None, None, self.geo.n_chunks, self.geo.state_block_p, self.geo.padded_state),
                            lambda p: (self.row(p), self.head(p), 0, self.row_block(p), 0))

    def state(self):
        return pl.BlockSpec((None, None, self.geo.state_block_p, self.geo.padded_state),
                            lambda p: (self.row(p), self.head(p), self.row_block(p), 0))


@dataclasses.dataclass(frozen=True)
class GroupGrid:
    """Programs (b, c, g, j) over batch rows, chunks, groups and slices of the group's heads; each walks
    the heads of its slice."""

    geo: ScanGeometry

    @property
    def blocks(self):
        return self.geo.n_chunks

    @property
    def splits(self):
        return self.geo.qk_splits

    @property
    def heads_per_slice(self):
        return self.geo.heads_per_group // self.splits

    @property
    def size(self):
        return (self.geo.batch * self.blocks * self.geo.groups * self.splits,)

    def index(self, p):
        """(batch row, chunk, group, slice) of program p."""
        g, j = self.geo.groups, self.splits
        return p // (self.blocks * g * j), (p // (g * j)) % self.blocks, (p // j) % g, p % j

    def per_head(self, x):
        """[Bt, Tp (or nc), H, ...] -> [Bt, Tp, G, splits, heads per slice, ...] (free reshape)."""
        return x.reshape(x.shape[:2] + (self.geo.groups, self.splits, self.heads_per_slice) + x.shape[3:])

    # ---- block specs
    def group_rows(self):
        """[Bt, Tp, G, Np] (Q, K): the chunk's [L, Np] block (shared by the slices)."""
        return pl.BlockSpec((None, self.geo.chunk, None, self.geo.padded_state), lambda p: self.index(p)[:3] + (0,))

    def slice_rows(self):
        """[Bt, Tp, G, splits, Np] (partial group sums of dQ, dK): the program's [L, Np] block."""
        return pl.BlockSpec((None, self.geo.chunk, None, None, self.geo.padded_state), lambda p: self.index(p) + (0,))

    def head_rows(self, width):
        """per_head([Bt, Tp, H, width]): a [L, heads per slice, width] block."""
        return pl.BlockSpec((None, self.geo.chunk, None, None, self.heads_per_slice, width),
                            lambda p: self.index(p) + (0, 0))

    def head_scalars(self):
        """per_head([Bt, Tp, H]): a [L, heads per slice] block."""
        return pl.BlockSpec((None, self.geo.chunk, None, None, self.heads_per_slice), lambda p: self.index(p) + (0,))

    def biases(self):
        """[G, splits, heads per slice, Np] (the biases): the slice's [heads per slice, Np] block."""
        return pl.BlockSpec((None, None, self.heads_per_slice, self.geo.padded_state),
                            lambda p: self.index(p)[2:] + (0, 0))

    def per_chunk(self, width):
        """per_head([Bt, nc, H, width]) (per-chunk values: entering angles, partial bias sums): the
        program's [heads per slice, width] block."""
        return pl.BlockSpec((None, None, None, None, self.heads_per_slice, width), lambda p: self.index(p) + (0, 0))


def run_kernel(body, geo: ScanGeometry, grid, inputs, outputs, name, num_warps):
    """Launches `body` over `grid` with named refs.

    Args:
      body: `body(refs: dict[str, Ref])`, the kernel.
      geo: the ScanGeometry (interpret flag, pipelining depth).
      grid: a ChunkGrid, StateGrid or GroupGrid.
      inputs: list of (name, array, BlockSpec), entries whose array is None are skipped;
      outputs: list of (name, ShapeDtypeStruct, BlockSpec).
      name: kernel name (shows up in profiles).
      num_warps: Triton warps per program.

    Returns:
      dict name -> output array.
    """
    inputs = [i for i in inputs if i[1] is not None]
    in_names = [n for n, _, _ in inputs]
    out_names = [n for n, _, _ in outputs]

    def kernel(*refs):
        body(dict(zip(in_names + out_names, refs)))

    results = pl.pallas_call(
        kernel,
        out_shape=[s for _, s, _ in outputs],
        grid=grid.size,
        in_specs=[s for _, _, s in inputs],
        out_specs=[s for _, _, s in outputs],
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=geo.config.num_stages),
        interpret=geo.interpret,
        name=name,
    )(*[a for _, a, _ in inputs])
    return dict(zip(out_names, results))
