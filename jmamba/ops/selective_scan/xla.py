"""Fast pure-JAX selective scan: time cut into chunks, an associative scan inside each chunk.

Why: `lax.associative_scan` over the whole sequence materialises the [B, T, d, n] expansion
(exp(δA), δBu) several times, and a `lax.scan` over single steps is latency bound. Here a `lax.scan`
walks chunks of `chunk_size` steps, carrying the f32 state [B, d, n]; inside a chunk the pairs
(ā, β) are combined with `lax.associative_scan`. The chunk body is wrapped in `jax.checkpoint`, so
under autodiff only the chunk-boundary states are saved and each chunk is recomputed in the
backward pass: at most one chunk of the expansion is alive at a time, forward or backward.

Inside a chunk the recurrence is either combined with `lax.associative_scan` (log-depth, good on
accelerators; default chunk 64) or unrolled step by step (best on CPU, where XLA fuses a short unrolled
loop; default chunk 4). `inner=None` picks by backend.

Numerics: f32 throughout (inputs cast on entry, output cast to `u.dtype`); padding steps past T use
δ = 0 (ā = 1, β = 0), the identity of the combine, so the final state is exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jmamba.core.dtypes import accum_dtype
from jmamba.ops.selective_scan.common import prepare_delta
# (inner, chunk_size) per backend, measured: CPU 2 cores, B=16 T=128 d=256 n=16 fwd+bwd: unrolled
# chunk 4 = 53 ms, associative chunk 8/64 = 127/219 ms, plain lax.scan over t = 147 ms.
DEFAULTS = {"cpu": ("sequential", 4)}
GPU_DEFAULT = ("associative", 64)


def _combine(left, right):
    """(a1, b1) then (a2, b2) = (a1·a2, a2·b1 + b2): composition of h -> a·h + b."""
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def _combine_with_resets(left, right):
    """`_combine` for segments: a right element that starts at a reset (r2) ignores what came before
    it, by selection rather than by multiplying by 0, so a non-finite earlier state cannot leak."""
    a1, b1, r1 = left
    a2, b2, r2 = right
    return jnp.where(r2, a2, a1 * a2), jnp.where(r2, b2, a2 * b1 + b2), r1 | r2


def selective_scan_xla(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, *, delta_softplus,
                       tuning=None, chunk_size=None, inner=None):
    """Chunked selective scan; same contract as `selective_scan_reference`.

    `tuning` (a `SelectiveScanTuning`) gives `xla_chunk_size` (steps per chunk) and `xla_inner`
    ("associative" or "sequential" combination inside a chunk); None fields take the backend default.
    `chunk_size=` / `inner=` are their deprecated spellings.
    """
    if chunk_size is not None or inner is not None:
        import warnings

        from jmamba.ops.selective_scan.common import SelectiveScanTuning
        warnings.warn("selective_scan_xla(chunk_size=, inner=) is deprecated; pass "
                      "tuning=SelectiveScanTuning(xla_chunk_size=, xla_inner=)", DeprecationWarning, stacklevel=2)
        if tuning is not None:
            raise TypeError("selective_scan_xla() got both tuning= and the deprecated chunk_size=/inner=")
        tuning = SelectiveScanTuning(xla_chunk_size=chunk_size, xla_inner=inner)
    default_inner, default_chunk = DEFAULTS.get(jax.default_backend(), GPU_DEFAULT)
    inner = (tuning and tuning.xla_inner) or default_inner
    chunk_size = (tuning and tuning.xla_chunk_size) or default_chunk
    if inner not in ("associative", "sequential"):
        raise ValueError(f"inner must be 'associative' or 'sequential', got {inner!r}")
    bsz, seqlen, d = u.shape
    n = A.shape[-1]
    g = B.shape[2]
    dg = d // g
    lc = max(1, min(chunk_size, seqlen))
    n_chunks = -(-seqlen // lc)
    pad = n_chunks * lc - seqlen

    f32 = accum_dtype(u.dtype, A.dtype)
    dl = prepare_delta(delta, delta_bias, delta_softplus, f32)
    uf = u.astype(f32)
    rs = jnp.zeros((bsz, seqlen), bool) if reset is None else reset

    def to_chunks(x):  # [Bt, T, ...] -> [n_chunks, Bt, lc, ...], zero padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((bsz, n_chunks, lc) + x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    xs = (
        to_chunks(uf.reshape(bsz, seqlen, g, dg)),
        to_chunks(dl.reshape(bsz, seqlen, g, dg)),
        to_chunks(B.astype(f32)),
        to_chunks(C.astype(f32)),
        to_chunks(rs),
    )
    Ag = A.astype(f32).reshape(g, dg, n)
    h0 = jnp.zeros((bsz, d, n), f32) if initial_state is None else initial_state.astype(f32)

    @jax.checkpoint
    def chunk(h, xs_c):
        u_c, d_c, b_c, c_c, r_c = xs_c                       # [Bt, lc, g, dg], ..., [Bt, lc, g, n], [Bt, lc]
        a = jnp.exp(d_c[..., None] * Ag)                      # [Bt, lc, g, dg, n]
        beta = (d_c * u_c)[..., None] * b_c[:, :, :, None, :]
        hg = h.reshape(bsz, g, dg, n)
        r5 = r_c[:, :, None, None, None]
        # A reset forgets the incoming state by selecting zeros (never 0·h, which keeps a NaN h).
        if inner == "associative":
            if reset is None:
                P, Q = jax.lax.associative_scan(_combine, (a, beta), axis=1)
                hs = P * hg[:, None] + Q
            else:
                P, Q, seen = jax.lax.associative_scan(_combine_with_resets, (a, beta, r5), axis=1)
                hs = jnp.where(seen, Q, P * hg[:, None] + Q)
            y = jnp.sum(hs * c_c[:, :, :, None, :], axis=-1)  # [Bt, lc, g, dg]
            return hs[:, -1].reshape(bsz, d, n), y
        ys = []
        for t in range(lc):                                   # unrolled: lc is small
            if reset is not None:
                hg = jnp.where(r5[:, t], 0.0, hg)
            hg = a[:, t] * hg + beta[:, t]
            ys.append(jnp.sum(hg * c_c[:, t, :, None, :], axis=-1))
        return hg.reshape(bsz, d, n), jnp.stack(ys, axis=1)

    h_last, ys = jax.lax.scan(chunk, h0, xs)
    y = jnp.moveaxis(ys, 0, 1).reshape(bsz, n_chunks * lc, d)[:, :seqlen]
    if D is not None:
        y = y + D.astype(f32) * uf
    if z is not None:
        y = y * jax.nn.silu(z.astype(f32))
    return y.astype(u.dtype), h_last
