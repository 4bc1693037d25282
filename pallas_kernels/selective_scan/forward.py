"""Forward kernels of the Pallas selective scan (GPU via Triton; CPU via the Pallas interpreter).

Why two kernels: a single program walking all T steps of its channels is latency bound (one dependent
row load per step, BENCHMARKS.md). The time axis is therefore cut into chunks that run in parallel:

  1. `chunk_summaries` — program (b, channel block, chunk) runs its chunk from a zero state and writes
     the end state Q_j [n, block_d] and the sum of δ over the chunk S_j [block_d] (the chunk's decay is
     P_j = exp(A·S_j), or 0 when a reset falls inside the chunk).
  2. `combine.chunk_states` (tiny) — H_{j+1} = P_j·H_j + Q_j gives every chunk its true start state.
  3. `chunk_outputs` — each program reruns its chunk from H_j and writes
     out_t = (Σ_n C_t[n]·h_t[n] + D·u_t)·silu(z_t).

Numerics: inputs are read in their own dtype (bf16/f16/f32) and converted to float32 on load; δ, ā,
the state, y and the gate are float32; `out` is rounded once to u.dtype when stored. Padding steps past
the true T get δ = 0 (ā = 1, β = 0), the identity, so the final state is exact.
HBM passes: (1) reads u, delta, B; (3) reads u, delta, z, B, C and writes out; chunk states are
[Bt, T/chunk, n, d] float32 (1/chunk of the [Bt, T, d, n] expansion, which is never formed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common.dtypes import F32
from pallas_kernels.selective_scan import layout
from pallas_kernels.selective_scan.channels import ChannelAccess, zero_operand
from pallas_kernels.selective_scan.config import ScanProblem
from pallas_kernels.selective_scan.kernel_math import KernelMath



def common_inputs(problem: ScanProblem, grid, ops: dict, names) -> list:
    """(name, array, BlockSpec) for the named operands that are present."""
    cfg = problem.config
    specs = {
        "u": grid.rows(cfg.chunk, cfg.block_d),
        "delta": grid.rows(cfg.chunk, cfg.block_d),
        "z": grid.rows(cfg.chunk, cfg.block_d, problem.z_offset // cfg.block_d),
        "d_out": grid.rows(cfg.chunk, cfg.block_d),
        "B": grid.group_rows(cfg.chunk, cfg.block_d, problem.n, problem.group_size),
        "C": grid.group_rows(cfg.chunk, cfg.block_d, problem.n, problem.group_size),
        "A_t": grid.transposed_A(problem.n, cfg.block_d),
        "D": grid.channel_vector(cfg.block_d),
        "bias": grid.channel_vector(cfg.block_d),
        "keep": grid.keep(cfg.chunk),
    }
    zero = zero_operand(problem, grid)
    return [(k, ops[k], specs[k]) for k in names if ops.get(k) is not None] + ([zero] if zero else [])


class RowReader(ChannelAccess):
    """Loads the per-step rows a kernel needs, as float32, and applies bias/softplus/time padding.

    A kernel reads the per-channel rows ([block_d]: u, delta, z, d_out) of an unrolled group before
    computing with them, so that the loads of several steps are in flight together (the time loop has
    no other memory-level parallelism). The B/C rows ([n], the same for every channel, so every thread
    holds a copy) are loaded up front only with `config.prefetch_bc` (more registers) and otherwise at
    the step that uses them (an L1/L2 hit, but on the step's critical path).
    """

    def __init__(self, problem: ScanProblem, grid, refs: dict):
        super().__init__(problem, refs)
        self.p = problem
        self.math = KernelMath.of(problem)
        self.bias = self.load("bias").astype(F32) if problem.has_bias else None
        self.chunk_start = grid.chunk(pl.program_id(0)) * problem.config.chunk

    def delta_raw(self, t, loaded=None):
        """δ before softplus, biased, float32; `loaded`: the row already loaded (its input dtype)."""
        x = (self.load("delta", t) if loaded is None else loaded).astype(F32)
        return x if self.bias is None else x + self.bias

    def delta(self, t, raw=None):
        """δ_t [block_d] (0 on padding steps past the true T)."""
        raw = self.delta_raw(t) if raw is None else raw
        dl = self.math.time_step(raw, self.p.softplus)
        if self.p.has_time_padding:
            dl = jnp.where(self.chunk_start + t < self.p.seqlen, dl, 0.0)
        return dl

    def row(self, name, t, loaded=None):
        return (self.load(name, t) if loaded is None else loaded).astype(F32)

    def load_rows(self, names, ts):
        """[{name: row}] per step t of `ts`: the per-channel rows of `names` present in this kernel, in
        their input dtype, loaded now so a later sub-chunk can use them (config.bwd_prefetch_rows)."""
        return [{n: self.load(n, t) for n in names if n in self.refs} for t in ts]

    def prefetch_state_row(self, name, t):
        """B_t / C_t in the input dtype if the config prefetches them, else None (loaded at use)."""
        return self.refs[name][t, :] if self.p.config.prefetch_bc else None

    def state_row(self, name, t, prefetched):
        """B_t / C_t [n] as float32, from the prefetched row or loaded now."""
        return (self.refs[name][t, :] if prefetched is None else prefetched).astype(F32)

    def keep(self, t):
        return self.refs["keep"][t] if self.p.has_reset else None


def chunk_summaries(problem: ScanProblem, ops: dict):
    """Pass 1: per-chunk zero-start end states and δ sums.

    Args:
      ops: padded operands: u, delta [Bt, Tp, d]; B [Bt, Tp, g, n]; A_t [n, d] (A·log2 e); bias [d] or None;
        keep [Bt, Tp] or None.

    Returns:
      (Q [Bt, nc, n, d] f32, S [Bt, nc, d] f32).
    """
    cfg = problem.config
    bsz = ops["u"].shape[0]
    n, bd, unroll = problem.n, cfg.block_d, cfg.fwd_unroll
    grid = problem.grid(bsz)

    def body(refs):
        rd = RowReader(problem, grid, refs)
        m = rd.math
        A = rd.load("A_t").astype(F32)

        def step_group(k, carry):
            h, s = carry
            ts = [k * unroll + i for i in range(unroll)]
            rows = [(rd.delta(t), rd.row("u", t), rd.prefetch_state_row("B", t), rd.keep(t)) for t in ts]
            for t, (dl, u, b, keep) in zip(ts, rows):
                b = rd.state_row("B", t, b)
                h = m.fma(m.decay(dl, A, keep), h, (dl * u)[None, :] * b[:, None])
                s = s + dl
            return h, s

        h, s = jax.lax.fori_loop(0, cfg.chunk // unroll, step_group,
                                 (jnp.zeros((n, bd), F32), jnp.zeros((bd,), F32)))
        rd.store("Q", h)
        rd.store("S", s)

    out = layout.launch(
        body, problem, grid,
        common_inputs(problem, grid, ops, ("u", "delta", "B", "A_t", "bias", "keep")),
        [("Q", jax.ShapeDtypeStruct((bsz, problem.n_chunks, n, problem.d), F32), grid.chunk_state(n, bd)),
         ("S", jax.ShapeDtypeStruct((bsz, problem.n_chunks, problem.d), F32), grid.chunk_vector(bd))],
        "selective_scan_fwd_chunk_summaries")
    return out["Q"], out["S"]


def chunk_outputs(problem: ScanProblem, ops: dict, chunk_start_states):
    """Pass 3: rerun every chunk from its true start state and write the output.

    Args:
      ops: padded operands: u, delta, z (or None) [Bt, Tp, d]; B, C [Bt, Tp, g, n]; A_t [n, d] (A·log2 e);
        D, bias [d] or None; keep [Bt, Tp] or None.
      chunk_start_states: [Bt, nc, n, d] f32, the state entering each chunk.

    Returns:
      out [Bt, Tp, d] in u.dtype.
    """
    cfg = problem.config
    bsz, _, d = ops["u"].shape
    n, bd, unroll = problem.n, cfg.block_d, cfg.fwd_unroll
    grid = problem.grid(bsz)

    def body(refs):
        rd = RowReader(problem, grid, refs)
        m = rd.math
        A = rd.load("A_t").astype(F32)
        D = rd.load("D").astype(F32) if problem.has_D else None

        def step_group(k, h):
            ts = [k * unroll + i for i in range(unroll)]
            rows = [(rd.delta(t), rd.row("u", t), rd.prefetch_state_row("B", t), rd.prefetch_state_row("C", t),
                     rd.keep(t), rd.row("z", t) if problem.has_z else None) for t in ts]
            outs = []
            for t, (dl, u, b, c, keep, z) in zip(ts, rows):
                b, c = rd.state_row("B", t, b), rd.state_row("C", t, c)
                h = m.fma(m.decay(dl, A, keep), h, (dl * u)[None, :] * b[:, None])
                y = jnp.sum(h * c[:, None], axis=0)
                if D is not None:
                    y = m.fma(D, u, y)
                if z is not None:
                    y = y * (z * m.sigmoid(z))
                outs.append(y)
            # Stores last: a load cannot be moved above a store that might alias it, so storing at
            # each step would put the next step's B/C loads on the critical path.
            for t, y in zip(ts, outs):
                rd.store("out", y, t)
            return h

        jax.lax.fori_loop(0, cfg.chunk // unroll, step_group, rd.load("H"))

    out = layout.launch(
        body, problem, grid,
        common_inputs(problem, grid, ops, ("u", "delta", "z", "B", "C", "A_t", "D", "bias", "keep"))
        + [("H", chunk_start_states, grid.chunk_state(n, bd))],
        [("out", jax.ShapeDtypeStruct((bsz, problem.padded_seqlen, d), ops["u"].dtype),
          grid.rows(cfg.chunk, bd))],
        "selective_scan_fwd_chunk_outputs")
    return out["out"]
