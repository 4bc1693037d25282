"""HBM layouts, program grids and block specs of the Mamba-3 SISO kernels: how each array is cut.

The arrays the kernels see are already padded by `scan.py`: T is a multiple of the chunk L, headdim
is Pp and d_state Np (powers of two, d_state in the kernel layout of config.py). The chunk kernels
read per-head queries / keys (biased, rotated, keys scaled, in the dot operand dtype) formed by the
query/key kernel from the per-group Q, K.

Layouts (HBM):
  group rows     [Bt, Tp, G, Np]      Q, K (activation dtype) and dQ, dK (float32, per head slice)
  head rows      [Bt, Tp, H, w]       w = Np: queries q, keys k̃ and their float32 gradients;
                                      w = Pp: V, Z, out, d_out, dV, dZ
  sequences      [Bt, Tp, H]          ADT, γ, ⟨q̄, k̄⟩, skip D + γ⟨q̄, k̄⟩ and their gradients (float32), in the
                                      layout of the per-position math around the kernels (a chunk's
                                      [L] vector is a strided load): no [Bt, H, Tp] transposes
  chunk states   [Bt, H, nc, Pp, Np]  a per-chunk state: a chunk's own contribution, the state entering
                                      it (forward) or the adjoint of the state leaving it (backward)
  chunk scalars  [Bt, H, nc]          e^{Σ ADT} of each chunk (float32)
  states         [Bt, H, Pp, Np]      the initial / final state and their adjoints (float32)

Grids are flattened to one axis (common/grid.py), so that every `vmap` of a `pallas_call` (which
prepends a grid axis) still fits Triton's three; the last-named axis varies fastest:
  chunk grid  program (b, c, h), h fastest: one chunk of one head per program;
  state grid  program (b, h, j): j = block of `state_block_p` headdim rows; each walks all chunks
              (the combine of state_passes.py; with `walk_block_p` rows, the walking state passes);
  group grid  program (b, c, g, j): c = chunk (or block of a chunk's rows), g = group, j = one of `qk_splits` slices of the
              group's heads; each walks the heads of its slice (the query/key kernels). Per-head
              arrays are viewed as [Bt, Tp, G, splits, heads per slice, ...] (a free reshape); that
              last axis of a block need not be a power of two, since a program only ever loads one
              head of it (a dynamic index).
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from pallas_kernels.common.grid import FlatGrid
from pallas_kernels.common.launch import run_kernel
from pallas_kernels.mamba3_siso.config import ScanGeometry


@dataclasses.dataclass(frozen=True)
class ChunkGrid:
    """Programs (b, c, h) over batch rows, chunks and heads; each owns one chunk of one head."""

    geo: ScanGeometry

    @property
    def flat(self) -> FlatGrid:
        return FlatGrid((self.geo.batch, self.geo.n_chunks, self.geo.heads))

    @property
    def size(self):
        return self.flat.size

    def head(self, p):
        return self.flat.coordinate(p, 2)

    def chunk(self, p):
        return self.flat.coordinate(p, 1)

    def row(self, p):
        return self.flat.coordinate(p, 0)

    # ---- block specs (index maps get the flat program id)
    def head_rows(self, width):
        return pl.BlockSpec((None, self.geo.chunk, None, width),
                            lambda p: (self.row(p), self.chunk(p), self.head(p), 0))

    def head_cols(self, width):
        """[Bt, H, width, Tp] (position-major per-head arrays: dq, dk̃ for qk_gradients_transposed): the
        program's [width, L] block."""
        return pl.BlockSpec((None, None, width, self.geo.chunk),
                            lambda p: (self.row(p), self.head(p), 0, self.chunk(p)))

    def sequence(self):
        return pl.BlockSpec((None, self.geo.chunk, None), lambda p: (self.row(p), self.chunk(p), self.head(p)))

    def chunk_state(self):
        return pl.BlockSpec((None, None, None, self.geo.padded_headdim, self.geo.padded_state),
                            lambda p: (self.row(p), self.head(p), self.chunk(p), 0, 0))

    def group_rows(self):
        """[Bt, Tp, G, Np] (Q, K): the chunk's [L, Np] rows of the program's head's group."""
        per_group = self.geo.heads_per_group
        return pl.BlockSpec((None, self.geo.chunk, None, self.geo.padded_state),
                            lambda p: (self.row(p), self.chunk(p), self.head(p) // per_group, 0))

    def head_vector(self, width):
        """[H, width] (the biases): the program's head's [width] row."""
        return pl.BlockSpec((None, width), lambda p: (self.head(p), 0))

    def shared_rows(self, width):
        """[Bt, Tp, width] (per-position values shared by every head: the shared angles): the chunk's
        [L, width] rows."""
        return pl.BlockSpec((None, self.geo.chunk, width), lambda p: (self.row(p), self.chunk(p), 0))

    def chunk_vector(self, width):
        """[Bt, nc, H, width] (one row per chunk and head: the entering angles' gradient): the program's
        [width] row."""
        return pl.BlockSpec((None, None, None, width), lambda p: (self.row(p), self.chunk(p), self.head(p), 0))


@dataclasses.dataclass(frozen=True)
class StateGrid:
    """Programs (b, h, j) over batch rows, heads and blocks of headdim rows; each walks all chunks.
    rows: headdim rows per program (0: config.state_block_p, the combines; the walking state passes
    use config.walk_block_p)."""

    geo: ScanGeometry
    rows: int = 0

    @property
    def block_p(self):
        return self.rows or self.geo.state_block_p

    @property
    def n_row_blocks(self):
        return self.geo.padded_headdim // self.block_p

    @property
    def flat(self) -> FlatGrid:
        return FlatGrid((self.geo.batch, self.geo.heads, self.n_row_blocks))

    @property
    def size(self):
        return self.flat.size

    def row_block(self, p):
        return self.flat.coordinate(p, 2)

    def head(self, p):
        return self.flat.coordinate(p, 1)

    def row(self, p):
        return self.flat.coordinate(p, 0)

    def chunk_scalars(self):
        return pl.BlockSpec((None, None, self.geo.n_chunks), lambda p: (self.row(p), self.head(p), 0))

    def chunk_states(self):
        return pl.BlockSpec((None, None, self.geo.n_chunks, self.block_p, self.geo.padded_state),
                            lambda p: (self.row(p), self.head(p), 0, self.row_block(p), 0))

    def state(self):
        return pl.BlockSpec((None, None, self.block_p, self.geo.padded_state),
                            lambda p: (self.row(p), self.head(p), self.row_block(p), 0))

    def head_sequence_rows(self, width):
        """[Bt, Tp, H, width] (q, k̃): every position's [width] row of the program's head, [Tp, width]
        (the walk loads one chunk of it per step)."""
        return pl.BlockSpec((None, self.geo.padded_seqlen, None, width),
                            lambda p: (self.row(p), 0, self.head(p), 0))

    def head_sequence_block(self):
        """[Bt, Tp, H, Pp] (V, Z, d_out): the program's block of headdim columns at every position,
        [Tp, block_p]."""
        return pl.BlockSpec((None, self.geo.padded_seqlen, None, self.block_p),
                            lambda p: (self.row(p), 0, self.head(p), self.row_block(p)))

    def head_sequence(self):
        """[Bt, Tp, H] (ADT): the program's head at every position, [Tp]."""
        return pl.BlockSpec((None, self.geo.padded_seqlen, None), lambda p: (self.row(p), 0, self.head(p)))


@dataclasses.dataclass(frozen=True)
class GroupGrid:
    """Programs (b, c, g, j) over batch rows, blocks of positions, groups and slices of the group's
    heads; each walks the heads of its slice. A block is one chunk (rows = 0, the forward) or `rows`
    positions of one (a divisor of the chunk: the query/key gradient kernel's qk_grad_blocks)."""

    geo: ScanGeometry
    rows: int = 0

    @property
    def block_rows(self):
        return self.rows or self.geo.chunk

    @property
    def blocks(self):
        return self.geo.padded_seqlen // self.block_rows

    @property
    def splits(self):
        return self.geo.qk_splits

    @property
    def heads_per_slice(self):
        return self.geo.heads_per_group // self.splits

    @property
    def flat(self) -> FlatGrid:
        return FlatGrid((self.geo.batch, self.blocks, self.geo.groups, self.splits))

    @property
    def size(self):
        return self.flat.size

    def index(self, p):
        """(batch row, block, group, slice) of program p."""
        return self.flat.coordinates(p)

    def per_head(self, x):
        """[Bt, Tp (or blocks), H, ...] -> [Bt, Tp, G, splits, heads per slice, ...] (free reshape)."""
        return x.reshape(x.shape[:2] + (self.geo.groups, self.splits, self.heads_per_slice) + x.shape[3:])

    # ---- block specs
    def group_rows(self):
        """[Bt, Tp, G, Np] (Q, K): the block's [rows, Np] (shared by the slices)."""
        return pl.BlockSpec((None, self.block_rows, None, self.geo.padded_state), lambda p: self.index(p)[:3] + (0,))

    def slice_rows(self, width=None):
        """[Bt, Tp, G, splits, width] (partial group sums of dQ, dK; width Np by default, and of the
        shared angle rates' gradient): the program's [rows, width] block."""
        width = self.geo.padded_state if width is None else width
        return pl.BlockSpec((None, self.block_rows, None, None, width), lambda p: self.index(p) + (0,))

    def shared_rows(self, width):
        """[Bt, Tp, width] (per-position values shared by every head: the angle rates): the block's
        [rows, width]."""
        return pl.BlockSpec((None, self.block_rows, width), lambda p: self.index(p)[:2] + (0,))

    def head_rows(self, width):
        """per_head([Bt, Tp, H, width]): a [rows, heads per slice, width] block."""
        return pl.BlockSpec((None, self.block_rows, None, None, self.heads_per_slice, width),
                            lambda p: self.index(p) + (0, 0))

    def per_slice_cols(self, x):
        """position-major [Bt, H, w, Tp] -> [Bt, G, splits, heads per slice, w, Tp] (free reshape)."""
        return x.reshape(x.shape[:1] + (self.geo.groups, self.splits, self.heads_per_slice) + x.shape[2:])

    def head_cols(self, width):
        """per_slice_cols([Bt, H, width, Tp]) (position-major per-head tiles: dq, dk̃, θ, per-head angles):
        the slice's [heads per slice, width, rows] block."""
        def index(p):
            b, c, g, sl = self.index(p)
            return b, g, sl, 0, 0, c
        return pl.BlockSpec((None, None, None, self.heads_per_slice, width, self.block_rows), index)

    def slice_cols(self, width):
        """[Bt, G, splits, width, Tp] (position-major per-slice sums: the shared angles' gradient): the
        program's [width, rows] block."""
        def index(p):
            b, c, g, sl = self.index(p)
            return b, g, sl, 0, c
        return pl.BlockSpec((None, None, None, width, self.block_rows), index)

    def head_scalars(self):
        """per_head([Bt, Tp, H]): a [rows, heads per slice] block."""
        return pl.BlockSpec((None, self.block_rows, None, None, self.heads_per_slice), lambda p: self.index(p) + (0,))

    def biases(self):
        """[G, splits, heads per slice, Np] (the biases): the slice's [heads per slice, Np] block."""
        return pl.BlockSpec((None, None, self.heads_per_slice, self.geo.padded_state),
                            lambda p: self.index(p)[2:] + (0, 0))

    def per_chunk(self, width):
        """per_head([Bt, blocks, H, width]) (per-block values: entering angles, partial bias sums): the
        program's [heads per slice, width] block."""
        return pl.BlockSpec((None, None, None, None, self.heads_per_slice, width), lambda p: self.index(p) + (0, 0))


def piece_columns(geo: ScanGeometry, start, width):
    """The columns of Q, K, their biases or gradients that hold the kernel-layout piece [start, start +
    width) (one of geo.pieces): that range itself in the kernel layout, and with `geo.qk_op_order` (the
    arrays in the op's d_state order, where the kernel layout is a pure permutation: Sp = S) the
    strided range of the even (2a) or odd (2a + 1) dims for the two rotated pieces, the same range for
    the rest."""
    Sp = geo.angle_width
    if not geo.qk_op_order or start >= 2 * Sp:
        return pl.ds(start, width)
    return pl.ds(2 * start if start < Sp else 2 * (start - Sp) + 1, width, stride=2)


def launch(body, geo: ScanGeometry, grid, inputs, outputs, name, num_warps):
    """`common.launch.run_kernel` over `grid` (a ChunkGrid, StateGrid or GroupGrid) with `num_warps`
    (each kernel has its own field in Mamba3ScanConfig) and the call's `num_stages` and interpret flag.

    inputs: (name, array, BlockSpec), entries whose array is None are skipped; outputs: (name,
    ShapeDtypeStruct, BlockSpec). Returns the outputs by name.
    """
    return run_kernel(body, grid=grid.size, inputs=inputs, outputs=outputs, name=name, num_warps=num_warps,
                      num_stages=geo.config.num_stages, interpret=geo.interpret)
