"""Backward kernels of the Pallas selective scan (GPU via Triton; CPU via the Pallas interpreter).

The adjoint of h_t = ā_t·h_{t-1} + β_t runs right to left, dh_t = Gy_t·C_t + ā_{t+1}·dh_{t+1}
(docs/mamba1.md §5.2), while the gradients need h_t and dh_t at the same step. Nothing of size [Bt, T, d, n] is
stored; instead:

  1. `adjoint_summaries` — program (b, channel block, chunk) walks its chunk right to left from a zero
     adjoint and writes R_j = ā_first·dh_first (what the chunk passes to its left neighbour), plus, at
     every `bwd_sub_chunk` boundary, the local adjoint entering that sub-chunk from the right and the
     sum of δ to the right of it (so the true adjoint can be rebuilt later without a second walk).
  2. `combine.chunk_states(reverse=True)` — G_{j-1} = P_j·G_j + R_j gives the adjoint entering each
     chunk from the right (and ∂h_{-1}).
  3. `chunk_gradients` — each program walks its chunk left to right from the forward chunk state H_j,
     one sub-chunk at a time: it runs the sub-chunk forward keeping its `bwd_sub_chunk` states in
     registers, rebuilds the adjoint at the sub-chunk's right end
         dh_in = local_in + exp(A·Σ_{right} δ)·G_j     (0·G_j when a reset lies to the right),
     and walks the sub-chunk backwards, producing du, dδ, dz per element, per-step partial dB, dC
     summed over the program's channels, and per-program partial dA, dD, d delta_bias.

Numerics: float32 for δ, ā, states, adjoints and every accumulation; du / d delta / dz are rounded once
to the input dtype when stored; partial sums are float32 and reduced outside the kernel in a fixed
order (no atomics, so two runs are bit-identical). ā_t·h_{t-1} is formed from the kept h_{t-1} (no
h_t − β_t cancellation). HBM passes: (1) reads delta, z, d_out, C; (3) reads every input once and writes
the gradients; the sub-chunk adjoints are [Bt, T/bwd_sub_chunk, n, d] float32, written once and read once.
With `bwd_adjoint_stride` s > 1 an adjoint is stored only every s sub-chunks (1/s of that scratch): the
gradients kernel then takes s sub-chunks per iteration, finds their start states with one forward pass,
and walks them last to first, each with its own forward-keeping pass (the adjoint leaving one sub-chunk
to the left is the one entering its left neighbour).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.dtypes import F32
from pallas_kernels.selective_scan import channel_sums, layout
from pallas_kernels.selective_scan.config import ScanProblem
from pallas_kernels.selective_scan.forward import RowReader, common_inputs
from pallas_kernels.selective_scan.kernel_math import LN_2


# the per-channel rows each backward kernel loads one sub-chunk ahead with config.bwd_prefetch_rows
ADJOINT_ROWS = ("delta", "d_out", "z")
GRADIENT_ROWS = ("delta", "u", "d_out", "z")


def output_gradient(rd: RowReader, t, has_z, loaded=None):
    """(Gy_t = d_out_t·silu(z_t), d_out_t, z_t, σ(z_t)) as float32 rows; z parts None without z.
    loaded: {name: row} already loaded (RowReader.load_rows), or None to load them now."""
    loaded = loaded or {}
    d_out = rd.row("d_out", t, loaded.get("d_out"))
    if not has_z:
        return d_out, d_out, None, None
    z = rd.row("z", t, loaded.get("z"))
    sz = rd.math.sigmoid(z)
    return d_out * z * sz, d_out, z, sz


def adjoint_summaries(problem: ScanProblem, ops: dict):
    """Pass 1 of the backward: per-chunk adjoints from a zero right boundary.

    Args:
      ops: padded operands: delta, z (or None), d_out [Bt, Tp, d]; C [Bt, Tp, g, n]; A_t [n, d] (A·log2 e);
        bias [d] or None; keep [Bt, Tp] or None.

    Returns:
      R [Bt, nc, n, d] f32: ā_first·dh_first of each chunk (local adjoint leaving it to the left);
      sub_adjoint [Bt, nc, nk, n, d] f32: local adjoint entering each stored block (problem.adjoint_steps
        steps: bwd_sub_chunk × bwd_adjoint_stride; nk = problem.n_stored_adjoints) from its right;
      sub_right_delta [Bt, nc, nk, d] f32: Σ δ over the steps of the chunk right of each stored block.
    """
    cfg = problem.config
    bsz = ops["delta"].shape[0]
    # one stored adjoint per problem.adjoint_steps steps (bwd_sub_chunk × bwd_adjoint_stride)
    n, bd, sub, nk = problem.n, cfg.block_d, problem.adjoint_steps, problem.n_stored_adjoints
    prefetch = cfg.bwd_prefetch_rows
    grid = problem.grid(bsz)

    def body(refs):
        rd = RowReader(problem, grid, refs)
        m = rd.math
        A = rd.load("A_t").astype(F32)

        def sub_rows(k):   # the rows of sub-chunk k (clamped: a harmless reload past the end)
            k = jnp.clip(k, 0, nk - 1)
            return rd.load_rows(ADJOINT_ROWS, [k * sub + i for i in range(sub)])

        def sub_chunk(kk, carry):
            c, right_delta, loaded = carry
            k = nk - 1 - kk
            ahead = sub_rows(k - 1) if prefetch else None
            rd.store("sub_adjoint", c, k)
            rd.store("sub_right_delta", right_delta, k)
            ts = [k * sub + i for i in range(sub)]
            got = loaded if prefetch else [None] * sub
            rows = [(t, output_gradient(rd, t, problem.has_z, g)[0],
                     rd.delta(t, rd.delta_raw(t, (g or {}).get("delta"))), rd.prefetch_state_row("C", t),
                     rd.keep(t)) for t, g in zip(ts, got)]
            for t, gy, dl, cr, keep in reversed(rows):
                cr = rd.state_row("C", t, cr)
                dh = m.fma(gy[None, :], cr[:, None], c)
                c = m.decay(dl, A, keep) * dh
                right_delta = right_delta + dl
            return c, right_delta, ahead

        first = sub_rows(nk - 1) if prefetch else None
        c, _, _ = jax.lax.fori_loop(0, nk, sub_chunk, (jnp.zeros((n, bd), F32), jnp.zeros((bd,), F32), first))
        rd.store("R", c)

    nc = problem.n_chunks
    out = layout.launch(
        body, problem, grid,
        common_inputs(problem, grid, ops, ("delta", "z", "d_out", "C", "A_t", "bias", "keep")),
        [("R", jax.ShapeDtypeStruct((bsz, nc, n, problem.d), F32), grid.chunk_state(n, bd)),
         ("sub_adjoint", jax.ShapeDtypeStruct((bsz, nc, nk, n, problem.d), F32),
          grid.sub_chunk_states(nk, n, bd)),
         ("sub_right_delta", jax.ShapeDtypeStruct((bsz, nc, nk, problem.d), F32),
          grid.sub_chunk_vectors(nk, bd))],
        "selective_scan_bwd_adjoint_summaries")
    return out["R"], out["sub_adjoint"], out["sub_right_delta"]


def chunk_gradients(problem: ScanProblem, ops: dict, chunk_start_states, chunk_right_adjoints,
                    sub_adjoint, sub_right_delta, sub_keep_right):
    """Pass 3 of the backward: every gradient, chunk by chunk.

    Args:
      ops: padded operands: u, delta, z (or None), d_out [Bt, Tp, d]; B, C [Bt, Tp, g, n]; A_t [n, d] (A·log2 e);
        D, bias [d] or None; keep [Bt, Tp] or None.
      chunk_start_states: H_j [Bt, nc, n, d] f32 (forward state entering chunk j).
      chunk_right_adjoints: G_j [Bt, nc, n, d] f32 (adjoint entering chunk j from the right).
      sub_adjoint, sub_right_delta: from `adjoint_summaries`.
      sub_keep_right: [Bt, nc, nk] f32, 0.0 where a reset lies right of stored block k inside chunk j;
        None without resets.

    Returns:
      dict with du, d_delta (d of the raw delta) [Bt, Tp, d] in the input dtypes, dz (if z),
      dB_partial, dC_partial [d/block_d, Bt, Tp, n] f32 (block-major; with bwd_channel_sums="shuffle"
      one dBC_partial [d/block_d, Bt, Tp, 2n], dB first), dA_partial [Bt, nc, n, d] f32,
      dD_partial (if D), d_bias_partial [Bt, nc, d] f32.
    """
    cfg = problem.config
    bsz, _, d = ops["u"].shape
    n, bd, sub, nc = problem.n, cfg.block_d, cfg.bwd_sub_chunk, problem.n_chunks
    stride, nb = cfg.bwd_adjoint_stride, problem.n_stored_adjoints
    block = sub * stride                       # steps per loop iteration (one stored adjoint)
    has_z, has_D, softplus = problem.has_z, problem.has_D, problem.softplus
    prefetch = cfg.bwd_prefetch_rows
    grid = problem.grid(bsz)
    shuffle_sums = cfg.bwd_channel_sums == "shuffle"
    if shuffle_sums and not channel_sums.applies(bd, cfg.num_warps, n, cfg.hide_channel_alignment):
        raise ValueError(
            "ScanBlockConfig.bwd_channel_sums='shuffle' needs the backward's layout hint on, 32 channels per "
            f"program on one warp and d_state 16; this call has hint={cfg.hide_channel_alignment}, block_d={bd}, "
            f"num_warps={cfg.num_warps}, d_state (padded) {n}. Use bwd_channel_sums='tree' for it.")

    def body(refs):
        rd = RowReader(problem, grid, refs)
        m = rd.math
        A = rd.load("A_t").astype(F32)
        D = rd.load("D").astype(F32) if has_D else None
        G = rd.load("G")

        def block_rows(k):   # the rows of block k (clamped: a harmless reload past the end)
            k = jnp.minimum(k, nb - 1)
            return rd.load_rows(GRADIENT_ROWS, [k * block + i for i in range(block)])

        def step_rows(ts, loaded):
            rows = []
            for t, g in zip(ts, loaded):
                raw = rd.delta_raw(t, g.get("delta"))
                gy, d_out, z, sz = output_gradient(rd, t, has_z, g)
                rows.append(dict(t=t, raw=raw, dl=rd.delta(t, raw), u=rd.row("u", t, g.get("u")), keep=rd.keep(t),
                                 gy=gy,
                                 d_out=d_out, z=z, sz=sz, b=rd.prefetch_state_row("B", t),
                                 c=rd.prefetch_state_row("C", t)))
            return rows

        def forward(h, rows, keep_all):
            """The states over `rows` from h: every state and decay (registers: len(rows) + 1 and
            len(rows) [n, block_d] tiles) with keep_all, else only the last state."""
            states, decays = [h], []
            for r in rows:
                b = rd.state_row("B", r["t"], r["b"])
                a = m.decay(r["dl"], A, r["keep"])
                h = m.fma(a, h, (r["dl"] * r["u"])[None, :] * b[:, None])
                if keep_all:
                    states.append(h)
                    decays.append(a)
            return (states, decays) if keep_all else h

        def reverse(rows, states, decays, c, dA, dD, d_bias):
            """Walks a sub-chunk right to left from the adjoint c entering it from the right: stores
            its per-step gradients, returns the adjoint leaving it to the left and the accumulators."""
            reuse = cfg.bwd_reuse_decay
            row_stores = []   # per-channel rows are stored after the walk (see forward.chunk_outputs)
            for i in reversed(range(len(rows))):
                r = rows[i]
                h_t, h_prev = states[i + 1], states[i]
                a = decays[i] if reuse else m.decay(r["dl"], A, r["keep"])
                b, cr = rd.state_row("B", r["t"], r["b"]), rd.state_row("C", r["t"], r["c"])
                dh = m.fma(r["gy"][None, :], cr[:, None], c)
                hb = jnp.sum(dh * b[:, None], axis=0)                      # Σ_n dh·B   [block_d]
                x = dh * (a * h_prev)                                         # dh·ā·h_{t-1} [n, block_d]
                d_dl = m.fma(r["u"], hb, LN_2 * jnp.sum(A * x, axis=0))     # A = LN_2·A2
                du = r["dl"] * hb
                if D is not None:
                    du = m.fma(D, r["gy"], du)
                    dD = m.fma(r["gy"], r["u"], dD)
                dA = m.fma(r["dl"][None, :], x, dA)
                c = a * dh
                d_raw = d_dl * m.softplus_grad(r["raw"]) if softplus else d_dl
                if problem.has_time_padding:
                    d_raw = jnp.where(rd.chunk_start + r["t"] < problem.seqlen, d_raw, 0.0)
                d_bias = d_bias + d_raw
                t = r["t"]
                row_stores += [("du", t, du), ("d_delta", t, d_raw)]
                x_c, x_b = r["gy"][None, :] * h_t, dh * (r["dl"] * r["u"])[None, :]
                if shuffle_sums:
                    refs["dBC_partial"][t, :] = channel_sums.dB_dC_sums(x_b, x_c, gpu=not problem.interpret)
                else:
                    refs["dC_partial"][t, :] = jnp.sum(x_c, axis=1)
                    refs["dB_partial"][t, :] = jnp.sum(x_b, axis=1)
                if has_z:
                    y = jnp.sum(h_t * cr[:, None], axis=0)
                    if D is not None:
                        y = m.fma(D, r["u"], y)
                    sz, z = r["sz"], r["z"]
                    row_stores.append(("dz", t, r["d_out"] * y * (sz * (1.0 + z * (1.0 - sz)))))
            for name, t, value in row_stores:
                rd.store(name, value, t)
            return c, dA, dD, d_bias

        def block_step(k, carry):
            h, dA, dD, d_bias, loaded = carry
            # The next block's rows (bwd_prefetch_rows): with one sub-chunk per block they are loaded
            # first, so the whole iteration covers their latency; with several, after the rightmost
            # sub-chunk's walk (below): the other sub-chunks' work still covers it, and they are not
            # live through that sub-chunk's kept states (loaded first, stride 2 spilled 192 B; loaded
            # there, none: benchmarks/triton_inspect.py, Triton 3.6 for sm_90).
            ahead = block_rows(k + 1) if prefetch and stride == 1 else None
            rows = step_rows([k * block + i for i in range(block)], loaded if prefetch else [{}] * block)
            subs = [rows[s * sub:(s + 1) * sub] for s in range(stride)]
            starts = [h]                  # the state entering each sub-chunk of the block
            for s in range(stride - 1):
                starts.append(forward(starts[-1], subs[s], keep_all=False))
            h_end, c = None, None
            for s in reversed(range(stride)):     # right to left; each forward keeps its sub-chunk's states
                states, decays = forward(starts[s], subs[s], keep_all=True)
                if c is None:
                    # The true adjoint entering the block from the right (formed after the forward
                    # pass: earlier, its tile stays live through it and costs registers).
                    h_end = states[-1]
                    psi = jnp.exp2(A * rd.load("sub_right_delta", k)[None, :])
                    if problem.has_reset:
                        psi = psi * refs["sub_keep_right"][k]
                    c = m.fma(psi, G, rd.load("sub_adjoint", k))
                c, dA, dD, d_bias = reverse(subs[s], states, decays, c, dA, dD, d_bias)
                if prefetch and ahead is None:
                    ahead = block_rows(k + 1)
            return h_end, dA, dD, d_bias, ahead

        zeros_row = jnp.zeros((bd,), F32)
        first = block_rows(0) if prefetch else None
        _, dA, dD, d_bias, _ = jax.lax.fori_loop(
            0, nb, block_step, (rd.load("H"), jnp.zeros((n, bd), F32), zeros_row, zeros_row, first))
        rd.store("dA_partial", dA)
        if has_D:
            rd.store("dD_partial", dD)
        if problem.has_bias:
            rd.store("d_bias_partial", d_bias)

    inputs = common_inputs(problem, grid, ops, ("u", "delta", "z", "d_out", "B", "C", "A_t", "D", "bias", "keep")) + [
        ("H", chunk_start_states, grid.chunk_state(n, bd)),
        ("G", chunk_right_adjoints, grid.chunk_state(n, bd)),
        ("sub_adjoint", sub_adjoint, grid.sub_chunk_states(nb, n, bd)),
        ("sub_right_delta", sub_right_delta, grid.sub_chunk_vectors(nb, bd)),
    ]
    if problem.has_reset:
        inputs.append(("sub_keep_right", sub_keep_right, grid.sub_chunk_flags(nb)))
    rows_spec = grid.rows(cfg.chunk, bd)
    tp = problem.padded_seqlen
    outputs = [
        ("du", jax.ShapeDtypeStruct((bsz, tp, d), ops["u"].dtype), rows_spec),
        ("d_delta", jax.ShapeDtypeStruct((bsz, tp, d), ops["delta"].dtype), rows_spec),
        ("dA_partial", jax.ShapeDtypeStruct((bsz, nc, n, d), F32), grid.chunk_state(n, bd)),
    ]
    partial_names = [("dBC_partial", 2 * n)] if shuffle_sums else [("dB_partial", n), ("dC_partial", n)]
    outputs += [(name, jax.ShapeDtypeStruct((problem.n_channel_blocks, bsz, tp, width), F32),
                 grid.partial_rows(cfg.chunk, width)) for name, width in partial_names]
    if has_z:
        outputs.append(("dz", jax.ShapeDtypeStruct((bsz, tp, d), ops["z"].dtype), rows_spec))
    if has_D:
        outputs.append(("dD_partial", jax.ShapeDtypeStruct((bsz, nc, d), F32), grid.chunk_vector(bd)))
    if problem.has_bias:
        outputs.append(("d_bias_partial", jax.ShapeDtypeStruct((bsz, nc, d), F32), grid.chunk_vector(bd)))
    return layout.launch(body, problem, grid, inputs, outputs, "selective_scan_bwd_chunk_gradients")
