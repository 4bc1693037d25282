"""Per-channel loads and stores of the selective-scan kernels, with an optional layout hint.

Every per-channel array a program touches has the channel block as its last axis: rows [chunk, bd],
state tiles [n, bd], sub-chunk tiles [nk, n, bd], vectors [bd]. `ChannelAccess` indexes that axis.

Why the hint (`ScanBlockConfig.hide_channel_alignment`): Triton picks register layouts from the
loads and stores. A [n, bd] float32 tile whose channel offset is provably 16-byte aligned is loaded
4 channels per lane (one 16-byte vector), and that layout then spreads to the whole time loop: each
lane holds 4 channels × 4 states, so the per-channel work of every step (softplus, sigmoid, the loads
of u/delta/z) is done 4 times over, once per lane sharing the channels, and sums over n cross lanes.
Offsetting the channel axis by a runtime zero (read from memory, so the compiler cannot see it is 0)
makes the alignment unprovable; the loads become one element per lane and the layout one channel per
lane with all n states in its registers. The values computed are identical either way.

Status: a hypothesis from the instruction counts ncu reported, not a confirmed effect. On the H200
(2026-11-30) the same config with and without the hint ran within the run-to-run spread (~10%);
the generated layouts were not inspected (no TTGIR dump from XLA's Triton path was available).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import I32
from pallas_kernels.selective_scan.config import ScanProblem

ZERO_NAME = "channel_offset"


def zero_operand(problem: ScanProblem, grid):
    """The (name, array, BlockSpec) of the runtime zero, or None when the hint is off."""
    if not problem.config.hide_channel_alignment:
        return None
    return (ZERO_NAME, jnp.zeros((1,), I32), pl.BlockSpec((1,), lambda p: (0,)))


class ChannelAccess:
    """`load(name, *lead)` / `store(name, value, *lead)` on the channel axis (last) of a ref."""

    def __init__(self, problem: ScanProblem, refs: dict):
        self.refs = refs
        self.block_d = problem.config.block_d
        self.offset = refs[ZERO_NAME][0] if problem.config.hide_channel_alignment else None

    def index(self, name, *lead):
        channel = slice(None) if self.offset is None else pl.ds(self.offset, self.block_d)
        middle = (slice(None),) * (len(self.refs[name].shape) - len(lead) - 1)
        return (*lead, *middle, channel)

    def load(self, name, *lead):
        return self.refs[name][self.index(name, *lead)]

    def store(self, name, value, *lead):
        self.refs[name][self.index(name, *lead)] = value.astype(self.refs[name].dtype)

