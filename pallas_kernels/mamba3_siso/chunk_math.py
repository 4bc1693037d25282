"""Math shared by the Mamba-3 SISO kernels, written with ops the Pallas-Triton lowering supports.

Everything here runs inside a kernel on loaded float32 tiles (and in interpret mode on CPU): only
elementwise ops, forward `cumsum`, single-axis reductions and 2-D `dot_general`. Reverse cumulative
sums are formed as total − cumsum + x (Triton has no reverse scan); the [L, L] decay matrix is
e^{cs_i − cs_j} from the within-chunk cumulative log-decay cs (as the official kernel does, so a
decay below e^-80 or so inside one chunk loses relative precision in the surviving terms).

Names: a chunk holds L positions; the state S [Pp, Np] maps a query q [Np] to y [Pp] as y = S·q.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.common.dtypes import F32, I32
from pallas_kernels.common.inline_ptx import LOG2_E, cos_sin_of_wrapped, fast_sigmoid

TWO_PI = 2.0 * math.pi


def angle_rate(angles):
    """π·tanh(angles): the RoPE angle per unit of DT from the op's raw (pre-tanh) angles, any shape."""
    return math.pi * jnp.tanh(angles)


def angle_rate_and_slope(angles):
    """(π·tanh(a), d(π·tanh a)/da = π·(1 − tanh² a)) of raw angles a, float32, a's shape."""
    t = jnp.tanh(angles)
    return math.pi * t, math.pi * (1.0 - t * t)


def wrap_angle(theta):
    """θ mod 2π into [0, 2π) (floor-mod, like jnp.mod; its derivative is taken as 1)."""
    return theta - TWO_PI * jnp.floor(theta * (1.0 / TWO_PI))


def chunk_angles(inc, theta_entry, *, by_matmul=False):
    """[L, Sp] θ_i = (θ_entry + Σ_{r <= i} inc_r) mod 2π: inc [L, Sp] angle increments, theta_entry [Sp]
    the wrapped angle entering the chunk (each term below 2π·(1 + L): ~L·2π·2^-24 rad rounding).
    by_matmul: the prefix sums as (lower-triangular ones)·inc instead of a cumsum (prefix_sum)."""
    return wrap_angle(theta_entry[None, :] + prefix_sum(inc, by_matmul=by_matmul))


def triangle(n, *, upper):
    """[n, n] float32 0/1 matrix: ones on and below (upper=False) or on and above (upper=True) the diagonal."""
    i = jax.lax.broadcasted_iota(I32, (n, n), 0)
    j = jax.lax.broadcasted_iota(I32, (n, n), 1)
    return jnp.where(j >= i if upper else j <= i, 1.0, 0.0).astype(F32)


def prefix_sum(x, *, by_matmul=False):
    """Σ_{i' <= i} x_{i'} over the rows of a 2-D float32 tile: a cumsum, or a dot with a triangular 0/1
    matrix (exact float32 products; no scan across warps, the dot's operand staging instead)."""
    if by_matmul:
        return dot(triangle(x.shape[0], upper=False), x, F32)
    return jnp.cumsum(x, axis=0)


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def gate_sigmoid(x, geo):
    """σ(x) of the output gate Z inside a kernel: exact, or with config.fast_math the hardware's ex2 and
    rcp (inline_ptx.fast_sigmoid: ~4e-6 relative; the same formula in the interpreter)."""
    if geo.config.fast_math:
        return fast_sigmoid(x, gpu=not geo.interpret)
    return sigmoid(x)


def chunk_decay(adt, geo):
    """ChunkDecay of a chunk's ADT with the exponentials config.fast_math asks for."""
    return ChunkDecay(adt, fast=geo.config.fast_math)


def _exp2_of(x):
    """e^x as 2^(x·log2 e): one `ex2.approx` on the GPU (2^-22 relative, plus the rounding of x·log2 e:
    ~|x|·1e-7 relative, 4e-6 at x = −50; results below ~1e-38 flush to zero)."""
    return jnp.exp2(x * LOG2_E)


def reverse_cumsum(x, axis=0, *, by_matmul=False):
    """Σ_{i' >= i} x_{i'} along `axis` (inclusive); by_matmul (rows of a 2-D tile only): as
    (upper-triangular ones)·x, the sums without the total − cumsum + x cancellation."""
    if by_matmul:
        assert axis == 0 and x.ndim == 2
        return dot(triangle(x.shape[0], upper=True), x, F32)
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


def total(x):
    """Sum of every element of a 2-D tile, one axis at a time."""
    return jnp.sum(jnp.sum(x, axis=1), axis=0)


class ChunkDecay:
    """Within-chunk decays from ADT [L] (float32); `fast`: the exponentials as 2^(x·log2 e) (one
    ex2.approx each on the GPU, config.fast_math) instead of libdevice's expf.

    Attributes:
      cs: [L] inclusive cumulative sum of ADT inside the chunk.
      end: scalar, Σ ADT over the chunk (cs at its last position).
      read: [L] e^{cs_i}: weight of the entering state at position i.
      to_end: [L] e^{cs_end − cs_j}: weight of position j in the state leaving the chunk.
      chunk: scalar e^{cs_end}: decay of the whole chunk.
    """

    def __init__(self, adt, *, fast: bool = False):
        self._exp = _exp2_of if fast else jnp.exp
        self.cs = jnp.cumsum(adt)
        self.end = jnp.sum(adt)
        self.read = self._exp(self.cs)
        self.to_end = self._exp(self.end - self.cs)
        self.chunk = self._exp(self.end)

    def strictly_lower(self):
        """[L, L] Λ_ij = e^{cs_i − cs_j} for i > j, else 0."""
        L = self.cs.shape[0]
        rows = jnp.arange(L, dtype=I32)[:, None]
        cols = jnp.arange(L, dtype=I32)[None, :]
        below = rows > cols
        diff = self.cs[:, None] - self.cs[None, :]
        return jnp.where(below, self._exp(jnp.where(below, diff, 0.0)), 0.0)

    def lower(self, diagonal=None):
        """Λ (strictly_lower), plus diag(`diagonal` [L]) when given (the skip term's weight γ/s on the
        scores' diagonal, config.skip_in_scores)."""
        lam = self.strictly_lower()
        if diagonal is None:
            return lam
        L = self.cs.shape[0]
        on = jnp.arange(L, dtype=I32)[:, None] == jnp.arange(L, dtype=I32)[None, :]
        return jnp.where(on, diagonal[:, None], lam)


# ---- RoPE on the pieces of the kernel layout (config.py): dicts {piece name: [rows, width] tile}
def rotation_of(theta, geo, *, backward=False):
    """(cos θ, sin θ) [rows, Sp] float32 of wrapped angles θ ∈ [0, 2π): libdevice's cos / sin, or with
    config.fast_rotation (config.fast_rotation_backward for the backward's kernels, `backward=True`,
    when it is not None) the hardware's cos.approx / sin.approx (inline_ptx.cos_sin_of_wrapped: about
    2^-21 absolute instead of ~1 ulp; in the interpreter the same shifted formula in float32)."""
    fast = geo.config.fast_rotation
    if backward and geo.config.fast_rotation_backward is not None:
        fast = geo.config.fast_rotation_backward
    if fast:
        return cos_sin_of_wrapped(theta, gpu=not geo.interpret)
    return jnp.cos(theta), jnp.sin(theta)


def rotate(x, rotation):
    """R(θ)·x: pairs (even_a, odd_a) rotated by +θ_a; the other pieces unchanged. rotation: (cos θ,
    sin θ) [rows, Sp] or None (no angles)."""
    if rotation is None:
        return dict(x)
    c, s = rotation
    out = dict(x)
    out["even"] = c * x["even"] - s * x["odd"]
    out["odd"] = s * x["even"] + c * x["odd"]
    return out


def rotate_back(d, rotation):
    """R(θ)ᵀ·d = R(−θ)·d (the rotation's transpose, for gradients)."""
    if rotation is None:
        return dict(d)
    c, s = rotation
    out = dict(d)
    out["even"] = c * d["even"] + s * d["odd"]
    out["odd"] = c * d["odd"] - s * d["even"]
    return out


def angle_gradient(d, x, rotation):
    """[rows, Sp] ∂⟨d, R(θ)x⟩/∂θ_a = d_e·(−x_e sinθ − x_o cosθ) + d_o·(x_e cosθ − x_o sinθ)."""
    c, s = rotation
    return d["even"] * (-x["even"] * s - x["odd"] * c) + d["odd"] * (x["even"] * c - x["odd"] * s)
