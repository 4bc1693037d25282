"""The one-pass log-sum-exp kernel and its launch.

Per program: `block_rows` rows of x [N, V] (any float dtype, e.g. bf16 logits), walked in pieces of
`width` columns. With m the running max and s = Σ exp(x − m) so far (float32), a piece with max c
updates them as

    m' = max(m, c),   s' = s·exp(m − m') + Σ_piece exp(x − m')

(an exponent whose max is −inf is taken as 0 / −inf, so rows of −inf give s = 0, never NaN), and the
result is m + log(s) per row: −inf for a row of −inf; a NaN or +inf in a row makes it non-finite.
Columns past V in the last piece are masked to −inf. One read of x, one float32 per row written;
float32 throughout, the pieces reduced in order (deterministic). Rows are padded to whole blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common.dtypes import F32, I32
from pallas_kernels.common.padding import pad_axis_to
from pallas_kernels.common.sizes import ceil_div, round_up
from pallas_kernels.log_sum_exp.config import DEFAULT_LSE_CONFIG, LogSumExpConfig

NEG_INF = float("-inf")


def _body(x_ref, out_ref, *, n_cols, width, pieces, interpret):
    rows = out_ref.shape[0]

    def load(i):
        cols = i * width + jnp.arange(width, dtype=I32)
        window = (slice(None), pl.ds(i * width, width))
        if interpret:       # the interpreter: a plain (clamped) load, then the mask
            x = x_ref[window]
        else:
            x = plt.load(x_ref.at[window], mask=(cols < n_cols)[None, :], other=NEG_INF)
        return jnp.where((cols < n_cols)[None, :], x.astype(F32), NEG_INF)

    def step(i, carry):
        m, s = carry
        x = load(i)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        finite = m_new > NEG_INF
        scale = jnp.exp(jnp.where(finite, m - m_new, 0.0))
        e = jnp.exp(jnp.where(finite[:, None], x - m_new[:, None], NEG_INF))
        return m_new, s * scale + jnp.sum(e, axis=1)

    init = (jnp.full((rows,), NEG_INF, F32), jnp.zeros((rows,), F32))
    m, s = jax.lax.fori_loop(0, pieces, step, init)
    out_ref[...] = m + jnp.log(s)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def row_log_sum_exp(x, *, config: LogSumExpConfig | None = None, interpret: bool = False):
    """log Σ_v exp(x[n, v]) [N] float32 of x [N, V] (module docstring)."""
    cfg = (config or DEFAULT_LSE_CONFIG).validate()
    n_rows, n_cols = x.shape
    rows = cfg.block_rows
    width = min(cfg.width, max(16, 1 << (max(n_cols, 1) - 1).bit_length()))   # no wider than V needs
    pieces = ceil_div(max(n_cols, 1), width)
    padded_rows = round_up(max(n_rows, 1), rows)
    # the interpreter's loads are not masked: give it whole pieces (the kernel masks columns >= V)
    xp = pad_axis_to(pad_axis_to(x, 0, padded_rows), 1, pieces * width) if interpret else pad_axis_to(x, 0, padded_rows)
    out = pl.pallas_call(
        functools.partial(_body, n_cols=n_cols, width=width, pieces=pieces, interpret=interpret),
        out_shape=jax.ShapeDtypeStruct((padded_rows,), F32),
        grid=(padded_rows // rows,),
        in_specs=[pl.BlockSpec((rows, xp.shape[1]), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows,), lambda i: (i,)),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="log_sum_exp",
    )(xp)
    return out[:n_rows]
