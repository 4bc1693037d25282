"""Math shared by the Mamba-3 SISO kernels, written with ops the Pallas-Triton lowering supports.

Everything here runs inside a kernel on loaded float32 tiles (and in interpret mode on CPU): only
elementwise ops, forward `cumsum`, single-axis reductions and 2-D `dot_general`. Reverse cumulative
sums are formed as total − cumsum + x (Triton has no reverse scan); the [L, L] decay matrix is
e^{cs_i − cs_j} from the within-chunk cumulative log-decay cs (as the official kernel does, so a
decay below e^-80 or so inside one chunk loses relative precision in the surviving terms).

Names: a chunk holds L positions; parts are dicts {part name: [L, w] tile} (config.py); the state
S [Pp, w] per part maps q [w] to y [Pp] as y = S·q.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

F32 = jnp.float32
TWO_PI = 2.0 * math.pi


def wrap_angle(theta):
    """θ mod 2π into [0, 2π) (floor-mod, like jnp.mod; its derivative is taken as 1)."""
    return theta - TWO_PI * jnp.floor(theta * (1.0 / TWO_PI))


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def reverse_cumsum(x, axis=0):
    """Σ_{i' >= i} x_{i'} along `axis` (inclusive)."""
    return jnp.sum(x, axis=axis, keepdims=True) - jnp.cumsum(x, axis=axis) + x


def dot(a, b, matmul_dtype, *, trans_a=False, trans_b=False):
    """a·b (aᵀ, bᵀ when asked) with float32 accumulation.

    16-bit `matmul_dtype`: operands rounded to it (tensor cores, as the official kernel);
    float32: exact float32 products (Precision.HIGHEST, no TF32).
    """
    mm = jnp.dtype(matmul_dtype)
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    precision = jax.lax.Precision.HIGHEST if mm == F32 else jax.lax.Precision.DEFAULT
    return jax.lax.dot_general(a.astype(mm), b.astype(mm), dims, precision=precision, preferred_element_type=F32)


def sum_over_parts(terms):
    terms = list(terms)
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def total(x):
    """Sum of every element of a 2-D tile, one axis at a time."""
    return jnp.sum(jnp.sum(x, axis=1), axis=0)


class ChunkDecay:
    """Within-chunk decays from ADT [L] (float32).

    Attributes:
      cs: [L] inclusive cumulative sum of ADT inside the chunk.
      end: scalar, Σ ADT over the chunk (cs at its last position).
      read: [L] e^{cs_i}: weight of the entering state at position i.
      to_end: [L] e^{cs_end − cs_j}: weight of position j in the state leaving the chunk.
      chunk: scalar e^{cs_end}: decay of the whole chunk.
    """

    def __init__(self, adt):
        self.cs = jnp.cumsum(adt)
        self.end = jnp.sum(adt)
        self.read = jnp.exp(self.cs)
        self.to_end = jnp.exp(self.end - self.cs)
        self.chunk = jnp.exp(self.end)

    def strictly_lower(self):
        """[L, L] Λ_ij = e^{cs_i − cs_j} for i > j, else 0."""
        L = self.cs.shape[0]
        rows = jnp.arange(L, dtype=jnp.int32)[:, None]
        cols = jnp.arange(L, dtype=jnp.int32)[None, :]
        below = rows > cols
        diff = self.cs[:, None] - self.cs[None, :]
        return jnp.where(below, jnp.exp(jnp.where(below, diff, 0.0)), 0.0)


def chunk_rotation(inc, theta_entry):
    """(cos θ, sin θ) [L, Sp] with θ_i = (θ_entry + Σ_{r<=i} inc_r) mod 2π.

    inc: [L, Sp] angle increments π·tanh(angles)·DT; theta_entry: [Sp] angle entering the chunk.
    """
    theta = wrap_angle(theta_entry[None, :] + jnp.cumsum(inc, axis=0))
    return jnp.cos(theta), jnp.sin(theta)


def biased_parts(refs, prefix, part_names, rows=None):
    """{part: [L, w] float32} = loaded rows of `{prefix}_{part}` + the head's `{prefix}b_{part}` bias.

    rows: None (the whole block) or a pl.ds slice of the time axis.
    """
    out = {}
    for name in part_names:
        ref = refs[f"{prefix}_{name}"]
        x = ref[...] if rows is None else ref[rows, :]
        out[name] = x.astype(F32) + refs[f"{prefix}b_{name}"][...].astype(F32)[None, :]
    return out


def rotate(parts, rotation):
    """R(θ)·x per position: pairs (even_a, odd_a) rotated by +θ_a; the rest unchanged."""
    if rotation is None:
        return dict(parts)
    c, s = rotation
    e, o = parts["even"], parts["odd"]
    out = dict(parts)
    out["even"] = c * e - s * o
    out["odd"] = s * e + c * o
    return out


def rotate_back(grads, rotation):
    """R(θ)ᵀ·d = R(−θ)·d per position (the rotation's transpose, for gradients)."""
    if rotation is None:
        return dict(grads)
    c, s = rotation
    de, do = grads["even"], grads["odd"]
    out = dict(grads)
    out["even"] = c * de + s * do
    out["odd"] = c * do - s * de
    return out


def angle_gradient(grads, unrotated, rotation):
    """[L, Sp] ∂⟨d, R(θ)x⟩/∂θ_a = d_e·(−x_e sinθ − x_o cosθ) + d_o·(x_e cosθ − x_o sinθ)."""
    c, s = rotation
    xe, xo = unrotated["even"], unrotated["odd"]
    return grads["even"] * (-xe * s - xo * c) + grads["odd"] * (xe * c - xo * s)
