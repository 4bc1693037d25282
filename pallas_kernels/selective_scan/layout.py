"""The program grid and block specs shared by the selective-scan kernels: how each array is cut.

Program (b, i, j) owns batch row b, channels [i·block_d, (i+1)·block_d) and time steps
[j·chunk, (j+1)·chunk). The grid is flattened to one axis (common/grid.py: a 1-D grid keeps the
kernels usable under nested vmap), i fastest, so programs that read the same B/C rows run together.

The arrays the kernels see are already padded (see `scan.py`): T is a multiple of `chunk`, n a power
of two, and `block_d` divides `d / groups`, so a channel block reads one group of B/C and d needs no
padding.

Layouts (HBM):
  rows              [Bt, T, d]          u, delta, z, out, d_out, du, d_delta, dz
  group rows        [Bt, T, g, n]       B, C
  partial rows      [Bt, T, d/bd, n]    per-channel-block partial dB, dC (f32)
  keep              [Bt, T]             1.0, or 0.0 where a reset zeroes the incoming state (f32)
  A_t               [n, d]              A transposed, so a program's [n, block_d] tile is contiguous in d
  channel vectors   [d]                 D, delta_bias
  chunk states      [Bt, nc, n, d]      states at chunk boundaries (f32)
  chunk vectors     [Bt, nc, d]         per-chunk sums of δ, partial dD / d delta_bias (f32)
  sub-chunk states  [Bt, nc, nk, n, d]  adjoint states at backward sub-chunk boundaries (f32)
  sub-chunk vectors [Bt, nc, nk, d]     suffix sums of δ at those boundaries (f32)
  sub-chunk flags   [Bt, nc, nk]        0.0 where a reset lies right of a sub-chunk in its chunk (f32)
"""

from __future__ import annotations

import dataclasses

from jax.experimental import pallas as pl

from pallas_kernels.common.grid import FlatGrid
from pallas_kernels.common.launch import run_kernel


@dataclasses.dataclass(frozen=True)
class ProgramGrid:
    """A flattened (batch, channel block, time chunk) grid; `n_chunks=1` gives a (batch, block) grid."""

    batch: int
    n_blocks: int
    n_chunks: int

    @property
    def flat(self) -> FlatGrid:
        return FlatGrid((self.batch, self.n_chunks, self.n_blocks))   # channel block fastest

    @property
    def size(self):
        return self.flat.size

    def block(self, p):
        return self.flat.coordinate(p, 2)

    def chunk(self, p):
        return self.flat.coordinate(p, 1)

    def row(self, p):
        return self.flat.coordinate(p, 0)

    # ---- block specs (index maps get the flat program id)
    def rows(self, chunk, block_d, offset_blocks=0):
        """[chunk, block_d] rows; `offset_blocks` shifts the channel block (a gate read in place from
        a wider array)."""
        return pl.BlockSpec((None, chunk, block_d),
                            lambda p: (self.row(p), self.chunk(p), self.block(p) + offset_blocks))

    def group_rows(self, chunk, block_d, n, group_size):
        # A channel block never straddles two groups (block_d divides group_size).
        return pl.BlockSpec((None, chunk, None, n),
                            lambda p: (self.row(p), self.chunk(p), (self.block(p) * block_d) // group_size, 0))

    def partial_rows(self, chunk, n):
        """Per-channel-block partial rows, stored block-major [d/block_d, Bt, Tp, n]: each program writes
        one contiguous [chunk, n] tile, and the sum over blocks reads whole contiguous slabs."""
        return pl.BlockSpec((None, None, chunk, n), lambda p: (self.block(p), self.row(p), self.chunk(p), 0))

    def keep(self, chunk):
        return pl.BlockSpec((None, chunk), lambda p: (self.row(p), self.chunk(p)))

    def transposed_A(self, n, block_d):
        return pl.BlockSpec((n, block_d), lambda p: (0, self.block(p)))

    def channel_vector(self, block_d):
        return pl.BlockSpec((block_d,), lambda p: (self.block(p),))

    def chunk_state(self, n, block_d):
        return pl.BlockSpec((None, None, n, block_d), lambda p: (self.row(p), self.chunk(p), 0, self.block(p)))

    def chunk_vector(self, block_d):
        return pl.BlockSpec((None, None, block_d), lambda p: (self.row(p), self.chunk(p), self.block(p)))

    def sub_chunk_states(self, n_sub, n, block_d):
        return pl.BlockSpec((None, None, n_sub, n, block_d),
                            lambda p: (self.row(p), self.chunk(p), 0, 0, self.block(p)))

    def sub_chunk_vectors(self, n_sub, block_d):
        return pl.BlockSpec((None, None, n_sub, block_d),
                            lambda p: (self.row(p), self.chunk(p), 0, self.block(p)))

    def sub_chunk_flags(self, n_sub):
        return pl.BlockSpec((None, None, n_sub), lambda p: (self.row(p), self.chunk(p), 0))

    # ---- specs of the combine kernel, whose programs (b, i) walk all chunks
    def all_chunk_states(self, n_chunks, n, block_d):
        return pl.BlockSpec((None, n_chunks, n, block_d), lambda p: (self.row(p), 0, 0, self.block(p)))

    def all_chunk_vectors(self, n_chunks, block_d):
        return pl.BlockSpec((None, n_chunks, block_d), lambda p: (self.row(p), 0, self.block(p)))

    def all_chunk_flags(self, n_chunks):
        return pl.BlockSpec((None, n_chunks), lambda p: (self.row(p), 0))

    def state(self, n, block_d):
        return pl.BlockSpec((None, n, block_d), lambda p: (self.row(p), 0, self.block(p)))


def launch(body, problem, grid: ProgramGrid, inputs, outputs, name, num_warps=None):
    """`common.launch.run_kernel` over `grid` with the problem's launch parameters: the (fitted,
    forward or backward) config's `num_warps` (unless given) / `num_stages` and the interpret flag.

    inputs: (name, array, BlockSpec); outputs: (name, ShapeDtypeStruct, BlockSpec). Returns the outputs
    by name.
    """
    cfg = problem.config
    return run_kernel(body, grid=grid.size, inputs=inputs, outputs=outputs, name=name,
                      num_warps=num_warps or cfg.num_warps, num_stages=cfg.num_stages, interpret=problem.interpret)
