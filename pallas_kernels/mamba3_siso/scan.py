"""The Pallas Mamba-3 SISO scan: the op's implementation contract around the chunked kernel core.

`mamba3_siso_scan_pallas(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states, reset,
*, chunk_size)` -> (out [Bt, T, H, P] in V.dtype, (angle, ssm, k, v) final states float32), the
contract of jmamba/ops/mamba3_siso_scan/api.py, differentiable w.r.t. every array argument.

Split of the work (spec §4): everything per position and small is plain JAX here, so JAX
differentiates it (the DT/Trap/D/initial-state chains of §4.4 steps 4-6 come for free); only the
chunked core (core.py: one custom_vjp around four kernels forward and four to six backward, the
query/key kernels of queries_keys.py and qk_gradients.py included) is hand-differentiated.

  per position   λ = σ(Trap), γ = λ·DT, σ̂_t = DT_{t+1}(1 − λ_{t+1}) (0 at the end), s = γ + σ̂,
                 skip = D + γ⟨q̄, k̄⟩ (expanded so that no [Bt, T, H, N] array is formed),
                 inc = π·tanh(Angles)·DT                                            [Bt, T, H(, S)]
  per chunk      the angle entering each chunk: a triangular matmul over the wrapped chunk sums of
                 inc, wrapped again (chunk_entry_angles); the query/key kernels form the angle at
                 every position, θ_t = (θ_entry + Σ_{r <= t in the chunk} inc_r) mod 2π
  initial state  S_0 = h_{-1} + DT_0(1 − λ_0)·v_{-1}k_{-1}ᵀ (the β_0 term folded in, §4.1)
  final states   angle = the wrapped total; ssm from the core; k = R(θ_{T-1})(K_{T-1} + K_bias);
                 v = V_{T-1}

Layout work done here (layout.py, config.py): T padded to a multiple of the chunk (ADT = DT = 0 there:
identity steps with zero input, so the final state is exact), headdim padded to Pp, and d_state of Q,
K, the biases and the state permuted into the kernel layout (even | odd | rest pieces, zero-padded):
[.., G, N] arrays only; the per-head [.., H, Np] operands are formed in that layout inside the core.

Numerics: every preprocessing step is float32; see the kernel modules for theirs. float64 inputs are
not supported (the kernels compute in float32).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.mamba3_siso.config import Mamba3ScanConfig, ScanGeometry, make_geometry
from pallas_kernels.mamba3_siso.core import chunked_core
from pallas_kernels.mamba3_siso.queries_keys import from_kernel_layout, rotate_pairs, to_kernel_layout

F32 = jnp.float32
HI = jax.lax.Precision.HIGHEST
TWO_PI = 2.0 * math.pi


def matmul_dtype(Q, K, V):
    """bf16 / f16 when Q, K and V all are that dtype (tensor-core dots), else float32."""
    dtypes = {jnp.dtype(x.dtype) for x in (Q, K, V)}
    if len(dtypes) == 1 and next(iter(dtypes)) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return next(iter(dtypes))
    return jnp.dtype(F32)


def mamba3_siso_scan_pallas(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states, reset, *,
                            chunk_size, config: Mamba3ScanConfig | None = None, interpret: bool = False):
    """Chunked Pallas Mamba-3 SISO scan.

    Args:
      Q, K: [Bt, T, G, N]; V: [Bt, T, H, P]; ADT, DT, Trap: [Bt, T, H]; Q_bias, K_bias: [H, N];
        Angles: [Bt, T, H, S] raw; D: [H] or None; Z: [Bt, T, H, P] or None;
        initial_states: None or (angle [Bt, H, S], ssm [Bt, H, P, N], k [Bt, H, N], v [Bt, H, P]).
      reset: must be None (resets are not supported by these kernels; the op falls back to "xla").
      chunk_size: requested chunk length (rounded by config.chunk_length).
      config: launch parameters (None: DEFAULT_CONFIG).
      interpret: run the kernels in the Pallas interpreter (CPU).

    Returns:
      (out [Bt, T, H, P] in V.dtype, (angle, ssm, k, v) float32 final states).
    """
    if reset is not None:
        raise NotImplementedError("reset: the Pallas Mamba-3 SISO kernels do not support reset masks")
    geo, core_args, theta_final = prepare(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states,
                                          chunk_size=chunk_size, config=config, interpret=interpret)
    out, final = chunked_core(geo, *core_args)
    bsz, T, H, P = V.shape
    G, N = Q.shape[2:]
    k_last = jnp.repeat(K[:, T - 1].astype(F32), H // G, axis=1) + K_bias.astype(F32)     # [Bt, H, N]
    final_states = (theta_final, from_kernel_layout(geo, final[:, :, :P]), rotate_pairs(k_last, theta_final),
                    V[:, T - 1].astype(F32))
    return out[:, :T, :, :P], final_states


def prepare(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, initial_states, *, chunk_size, config=None,
            interpret=False):
    """The plain-JAX part before the kernels: (geometry, the 12 arguments of `chunked_core` after
    `geo`, the final angle [Bt, H, S])."""
    bsz, T, H, P = V.shape
    G, N = Q.shape[2:]
    S = Angles.shape[-1]
    geo = make_geometry(batch=bsz, seqlen=T, heads=H, groups=G, headdim=P, d_state=N, num_angles=S,
                        chunk_size=chunk_size, has_z=Z is not None, matmul_dtype=matmul_dtype(Q, K, V),
                        io_dtype=V.dtype, config=config, interpret=interpret)

    dt = DT.astype(F32)
    lam = jax.nn.sigmoid(Trap.astype(F32))
    gamma = lam * dt
    prev_weight = dt * (1.0 - lam)                                       # β_t / α_t
    shifted = jnp.concatenate([prev_weight[:, 1:], jnp.zeros((bsz, 1, H), F32)], axis=1)   # σ̂_t
    scale = gamma + shifted
    skip = gamma * biased_diagonal(Q, K, Q_bias, K_bias, H)
    if D is not None:
        skip = skip + D.astype(F32)

    if initial_states is None:
        angle0 = jnp.zeros((bsz, H, S), F32)
        s0 = jnp.zeros((bsz, H, P, N), F32)
    else:
        angle0, h0, k0, v0 = (x.astype(F32) for x in initial_states)
        s0 = h0 + prev_weight[:, 0, :, None, None] * v0[..., :, None] * k0[..., None, :]

    inc = theta_entry = None
    theta_final = angle0
    if S:
        inc = math.pi * jnp.tanh(Angles.astype(F32)) * dt[..., None]     # [Bt, T, H, S]
        theta_entry, theta_final = chunk_entry_angles(geo, inc, angle0)
        pad = [(0, 0)] * 3 + [(0, geo.angle_width - S)]
        inc, theta_entry = jnp.pad(_pad_time(geo, inc), pad), jnp.pad(theta_entry, pad)

    core_args = (
        to_kernel_layout(geo, _pad_time(geo, Q)), to_kernel_layout(geo, _pad_time(geo, K)),
        to_kernel_layout(geo, Q_bias.astype(F32)), to_kernel_layout(geo, K_bias.astype(F32)),
        _pad_time(geo, scale), inc, theta_entry,
        _pad_headdim(geo, _pad_time(geo, V)), None if Z is None else _pad_headdim(geo, _pad_time(geo, Z)),
        _sequence(geo, ADT.astype(F32)), _sequence(geo, skip),
        _pad_headdim(geo, to_kernel_layout(geo, s0), axis=2))
    return geo, core_args, theta_final


def biased_diagonal(Q, K, Q_bias, K_bias, H):
    """⟨q̄_t, k̄_t⟩ per head [Bt, T, H] (float32), q̄ = Q[g] + Q_bias[h], without forming [Bt, T, H, N]:
    ⟨Q, K⟩ + ⟨Q, K_bias[h]⟩ + ⟨Q_bias[h], K⟩ + ⟨Q_bias[h], K_bias[h]⟩."""
    bsz, T, G, N = Q.shape
    q, k = Q.astype(F32), K.astype(F32)
    qb = Q_bias.astype(F32).reshape(G, H // G, N)
    kb = K_bias.astype(F32).reshape(G, H // G, N)
    both = jnp.sum(q * k, axis=-1)[..., None]                                       # [Bt, T, G, 1]
    cross = (jnp.einsum("btgn,gjn->btgj", q, kb, precision=HI)
             + jnp.einsum("btgn,gjn->btgj", k, qb, precision=HI))                     # [Bt, T, G, H/G]
    return (both + cross + jnp.sum(qb * kb, axis=-1)).reshape(bsz, T, H)


def chunk_entry_angles(geo: ScanGeometry, inc, angle0):
    """(θ entering each chunk [Bt, nc, H, S], final θ [Bt, H, S]), wrapped into [0, 2π).

    Each chunk's sum of increments is wrapped first (so every term is in [0, 2π)), then one
    triangular matmul (float32, Precision.HIGHEST) forms the exclusive prefix sums over chunks, which
    are wrapped again: one small XLA kernel instead of a scan. The prefix sums stay below nc·2π, so
    the carried angle loses at most ~nc·2π·2^-24 rad (4e-5 rad at nc = 128) to rounding.
    """
    bsz, _, H, S = inc.shape
    nc = geo.n_chunks
    sums = jnp.mod(_pad_time(geo, inc).reshape(bsz, nc, geo.chunk, H, S).sum(axis=2), TWO_PI)   # [Bt, nc, H, S]
    # [θ_{-1}, sum_0, ..., sum_{nc-1}]: row c of `before` adds θ_{-1} and the sums of the chunks before c
    terms = jnp.concatenate([angle0[:, None], sums], axis=1)                                      # [Bt, nc+1, H, S]
    before = jnp.tril(jnp.ones((nc + 1, nc + 1), F32))
    running = jnp.mod(jnp.einsum("ck,bkhs->bchs", before, terms, precision=HI), TWO_PI)
    return running[:, :-1], running[:, -1]


def _pad_time(geo: ScanGeometry, x, axis=1):
    extra = geo.padded_seqlen - x.shape[axis]
    return x if extra == 0 else jnp.pad(x, [(0, extra) if a == axis else (0, 0) for a in range(x.ndim)])


def _pad_headdim(geo: ScanGeometry, x, axis=3):
    extra = geo.padded_headdim - x.shape[axis]
    return x if extra == 0 else jnp.pad(x, [(0, extra) if a == axis else (0, 0) for a in range(x.ndim)])


def _sequence(geo: ScanGeometry, x):
    """[Bt, T, H] -> [Bt, H, Tp] (zero padding: ADT = 0 is the identity decay, s = skip = 0)."""
    return jnp.transpose(_pad_time(geo, x), (0, 2, 1))
