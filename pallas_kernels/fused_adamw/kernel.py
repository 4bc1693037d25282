"""Fused AdamW as a Pallas-Triton kernel: p, m and v of many tensors updated in one launch, in place.

Why it exists: `optax.adamw` runs as several XLA fusions per leaf (moments, bias correction, decay,
learning-rate scale, `apply_updates`) and reached 1.36 TB/s on an H200 (BENCHMARKS.md). The AdamW update
is one streaming pass: read p, g, m, v, write p, m, v. This kernel does exactly that.

Per element, in float32 (the scalars come from `AdamWStepScalars`, computed once per step):

    g  = g · grad_scale
    m' = b1 · m + (1 − b1) · g
    v' = b2 · v + (1 − b2) · g²
    p' = p − (lr·wd · p + step_size · m' / (√v' / √bc2 + eps))      (decay term only on decayed leaves)
    where skip ≠ 0: p' = p, m' = m, v' = v
    c  = p'.astype(compute_dtype)                                   (optional compute copy)

with step_size = lr / bc1, bc_i = 1 − b_i^t. The decay and the Adam step are summed before the one
rounding at the parameter's scale: torch's two in-place roundings (`p.mul_(1 − lr·wd)`, then
`p.addcdiv_`) make a biased error, since lr·wd·p is nearly the same fraction of an ulp every step
(measured: 3e-6 relative drift of a leaf after 100 steps at lr 1e-3, wd 1e-2, against float64).

On the GPU, Triton lowers float32 `/` to `div.full.f32` (≤ 2 ulp; triton-lang/triton#446) and
contracts mul+add into FMAs, so the kernel and the pure-JAX path may differ by an ulp or two of the
update (~1e-10 of the parameter at lr 1e-3); sqrt goes through libdevice.

HBM traffic: one pass, 28 bytes per parameter (16 read, 12 written), 30 with a bf16/f16 compute
copy; the ten scalars are one 40-byte load per program.

Layout ("multi-tensor apply", like torch's fused AdamW): the leaves stay separate buffers, no arena.
Each leaf is viewed as 1-D (a bitcast), cut into `block_size` chunks, and the chunks of up to
`max_leaves_per_call` leaves are laid end to end on one 1-D grid: program `pid` finds its leaf by
comparing against static start offsets (`pl.when` per leaf) and updates one block of that leaf,
masking the tail. So a model of L leaves costs ceil(L / max_leaves_per_call) launches; the bound
keeps the kernel's pointer arguments (7–8 per leaf) well under CUDA's 4 KiB parameter limit.
p, m, v are aliased input→output (`input_output_aliases`); under `jax.jit(..., donate_argnums=...)`
XLA updates them in place, with no copy.

Flat-buffer layout (`fused_adamw_flat`, for a TrainState created with `flat=True`): p, m and v of
every leaf live in three 1-D buffers at static offsets, and each launch aliases the three whole
buffers; the gradients stay separate arrays. Same programs, same arithmetic; the leaf's p/m/v window
is shifted by its offset. Elements between leaves (alignment padding) are never read or written.

Configuration (no Pallas import): config.py (`AdamWStepScalars`, `KernelConfig`, `COMPUTE_DTYPES`).

Backend: GPU through Triton (`pl.pallas_call` with `plt.CompilerParams`); `interpret=True` runs the
same kernel on CPU for tests. The pure-JAX path with the same numerics is
`jmamba/ops/adamw/reference.py` (`adamw_leaf_update`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.common.dtypes import F32, I32, is_sixteen_bit_float
from pallas_kernels.common.sizes import ceil_div
from pallas_kernels.fused_adamw.config import AdamWStepScalars, KernelConfig


@dataclasses.dataclass(frozen=True)
class _LeafSlot:
    size: int          # elements
    first_block: int   # first program id of this leaf in its launch
    decay: bool
    state_offset: int = 0   # where the leaf starts in p, m, v (non-zero in the flat-buffer layout)


def _update_block(scal_ref, p_in, g_in, m_in, v_in, p_out, m_out, v_out, c_out, *,
                  pid, slot: _LeafSlot, block_size: int):
    offset = pl.multiple_of((pid - slot.first_block) * block_size, block_size)
    window = pl.ds(offset, block_size)
    state_window = window
    if slot.state_offset:   # a static offset: the hint keeps the loads vectorized
        align = math.gcd(slot.state_offset, block_size)
        state_window = pl.ds(pl.multiple_of(slot.state_offset + offset, align), block_size)
    mask = None
    if slot.size % block_size:   # only the leaf's last block can run past its end
        mask = offset + jnp.arange(block_size, dtype=I32) < slot.size

    def load(ref, win):
        if mask is None:   # (Triton rejects `other` without a mask)
            return plt.load(ref.at[win]).astype(F32)
        return plt.load(ref.at[win], mask=mask, other=0).astype(F32)

    def store(ref, x, win=state_window):
        plt.store(ref.at[win], x.astype(ref.dtype), mask=mask)

    b1, omb1, b2, omb2, eps, step_size, sqrt_bc2, lr_wd, grad_scale, skip = (
        scal_ref[i] for i in range(len(AdamWStepScalars._fields)))
    p, g, m, v = load(p_in, state_window), load(g_in, window), load(m_in, state_window), load(v_in, state_window)
    g = g * grad_scale
    m_new = b1 * m + omb1 * g
    v_new = b2 * v + omb2 * (g * g)
    denom = jnp.sqrt(v_new) / sqrt_bc2 + eps
    step = step_size * (m_new / denom)
    p_new = p - (lr_wd * p + step if slot.decay else step)
    keep = skip != 0
    p_new = jnp.where(keep, p, p_new)
    store(p_out, p_new)
    store(m_out, jnp.where(keep, m, m_new))
    store(v_out, jnp.where(keep, v, v_new))
    if c_out is not None:
        store(c_out, p_new, window)


def _kernel(scal_ref, *refs, slots: Sequence[_LeafSlot], block_size: int, with_copy: bool):
    n = len(slots)
    ins, outs = refs[:4 * n], refs[4 * n:]
    per_out = 4 if with_copy else 3
    pid = pl.program_id(0)
    for k, slot in enumerate(slots):
        last_block = slot.first_block + ceil_div(slot.size, block_size)

        @pl.when((pid >= slot.first_block) & (pid < last_block))
        def _(k=k, slot=slot):
            o = outs[per_out * k: per_out * (k + 1)]
            _update_block(scal_ref, *ins[4 * k: 4 * (k + 1)], o[0], o[1], o[2],
                          o[3] if with_copy else None, pid=pid, slot=slot, block_size=block_size)


def _one_launch(scalars, ps, gs, ms, vs, decay, compute_dtype, cfg: KernelConfig, interpret: bool):
    slots, first = [], 0
    for p, d in zip(ps, decay):
        slots.append(_LeafSlot(size=int(p.size), first_block=first, decay=bool(d)))
        first += ceil_div(int(p.size), cfg.block_size)
    out_shape = []
    for p in ps:
        out_shape += [jax.ShapeDtypeStruct(p.shape, F32)] * 3
        if compute_dtype is not None:
            out_shape.append(jax.ShapeDtypeStruct(p.shape, compute_dtype))
    per_out = 3 if compute_dtype is None else 4
    aliases = {}
    for k in range(len(ps)):   # operand 0 is the scalar vector; then (p, g, m, v) per leaf
        aliases[1 + 4 * k] = per_out * k          # p
        aliases[1 + 4 * k + 2] = per_out * k + 1  # m
        aliases[1 + 4 * k + 3] = per_out * k + 2  # v
    operands = [scalars]
    for quad in zip(ps, gs, ms, vs):
        operands += list(quad)
    outs = pl.pallas_call(
        functools.partial(_kernel, slots=tuple(slots), block_size=cfg.block_size,
                          with_copy=compute_dtype is not None),
        out_shape=out_shape,
        grid=(first,),
        input_output_aliases=aliases,
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="fused_adamw",
    )(*operands)
    return [tuple(outs[per_out * k: per_out * (k + 1)]) for k in range(len(ps))]


def fused_adamw_leaves(params: Sequence[jax.Array], grads: Sequence[jax.Array],
                       mus: Sequence[jax.Array], nus: Sequence[jax.Array],
                       scalars: AdamWStepScalars, decay: Sequence[bool], *,
                       compute_dtype=None, config: Optional[KernelConfig] = None):
    """One AdamW step over lists of leaves with the fused kernel.

    Args:
      params, mus, nus: float32 arrays (any shapes; leaf k of each has the same shape).
      grads: float arrays shaped like `params` (upcast to float32 in the kernel).
      scalars: this step's `AdamWStepScalars` (float32 scalars, may be traced).
      decay: one Python bool per leaf; False leaves get no weight decay.
      compute_dtype: None, or bfloat16/float16 to also write a copy of the new params in that dtype.
      config: launch shape and interpret mode (`KernelConfig()` when None).

    Returns:
      (new_params, new_mus, new_nus, compute_params or None), lists in the input order. Under jit
      with the inputs donated, p, m and v are updated in place.
    """
    cfg = (config or KernelConfig()).validate()
    n = len(params)
    for name, xs in (("grads", grads), ("mus", mus), ("nus", nus), ("decay", decay)):
        if len(xs) != n:
            raise ValueError(f"{name} must have one entry per parameter leaf ({n}), got {len(xs)}")
    for k in range(n):
        for name, x in (("params", params[k]), ("mus", mus[k]), ("nus", nus[k])):
            if x.dtype != F32:
                raise TypeError(f"{name}[{k}] must be float32, got {x.dtype}")
        for name, x in (("grads", grads[k]), ("mus", mus[k]), ("nus", nus[k])):
            if x.shape != params[k].shape:
                raise ValueError(f"{name}[{k}] must have shape {params[k].shape} like params[{k}], "
                                 f"got {x.shape}")
        if not jnp.issubdtype(grads[k].dtype, jnp.floating):
            raise TypeError(f"grads[{k}] must be floating, got {grads[k].dtype}")
        if params[k].size >= 2 ** 31 - cfg.block_size:
            raise ValueError(f"params[{k}] has {params[k].size} elements; int32 offsets allow < 2**31")
    if compute_dtype is not None and not is_sixteen_bit_float(compute_dtype):
        raise ValueError(f"compute_dtype must be None, bfloat16 or float16, got {compute_dtype!r}")
    if not isinstance(scalars, AdamWStepScalars):
        raise TypeError(f"scalars must be an AdamWStepScalars, got {type(scalars).__name__}")

    interpret = cfg.interpret if cfg.interpret is not None else jax.default_backend() == "cpu"
    vec = scalars.as_vector()
    new_p, new_m, new_v = list(params), list(mus), list(nus)
    new_c = [None] * n if compute_dtype is None else [p.astype(compute_dtype) for p in params]
    live = [k for k in range(n) if params[k].size > 0]
    for start in range(0, len(live), cfg.max_leaves_per_call):
        group = live[start:start + cfg.max_leaves_per_call]
        flat = lambda xs: [xs[k].reshape(-1) for k in group]   # noqa: E731  (row-major: a bitcast)
        results = _one_launch(vec, flat(params), flat(grads), flat(mus), flat(nus),
                              [decay[k] for k in group], compute_dtype, cfg, interpret)
        for k, outs in zip(group, results):
            shape = params[k].shape
            new_p[k], new_m[k], new_v[k] = (o.reshape(shape) for o in outs[:3])
            if compute_dtype is not None:
                new_c[k] = outs[3].reshape(shape)
    return new_p, new_m, new_v, (None if compute_dtype is None else new_c)


# ------------------------------------------------------------------------- the flat-buffer layout
def _kernel_flat(scal_ref, p_in, m_in, v_in, *refs, slots: Sequence[_LeafSlot], block_size: int):
    n = len(slots)
    g_refs, (p_out, m_out, v_out) = refs[:n], refs[n:]
    pid = pl.program_id(0)
    for k, slot in enumerate(slots):
        last_block = slot.first_block + ceil_div(slot.size, block_size)

        @pl.when((pid >= slot.first_block) & (pid < last_block))
        def _(k=k, slot=slot):
            _update_block(scal_ref, p_in, g_refs[k], m_in, v_in, p_out, m_out, v_out, None,
                          pid=pid, slot=slot, block_size=block_size)


def _one_flat_launch(scalars, flat_p, flat_m, flat_v, gs, offsets, decay, cfg: KernelConfig, interpret: bool):
    slots, first = [], 0
    for g, off, d in zip(gs, offsets, decay):
        slots.append(_LeafSlot(size=int(g.size), first_block=first, decay=bool(d), state_offset=int(off)))
        first += ceil_div(int(g.size), cfg.block_size)
    shape = jax.ShapeDtypeStruct(flat_p.shape, F32)
    return pl.pallas_call(
        functools.partial(_kernel_flat, slots=tuple(slots), block_size=cfg.block_size),
        out_shape=[shape] * 3,
        grid=(first,),
        input_output_aliases={1: 0, 2: 1, 3: 2},   # operands: scalars, p, m, v, then the gradients
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
        interpret=interpret,
        name="fused_adamw_flat",
    )(scalars, flat_p, flat_m, flat_v, *gs)


def fused_adamw_flat(flat_params: jax.Array, grads: Sequence[jax.Array], flat_mu: jax.Array,
                     flat_nu: jax.Array, offsets: Sequence[int], scalars: AdamWStepScalars,
                     decay: Sequence[bool], *, config: Optional[KernelConfig] = None):
    """One AdamW step of leaves that live inside three flat float32 buffers, updated in place.

    Leaf k occupies elements [offsets[k], offsets[k] + grads[k].size) of each of `flat_params`,
    `flat_mu` and `flat_nu` (row-major, as `x.reshape(-1)` lays it out); its gradient is the
    separate array `grads[k]`. Elements outside every leaf (alignment padding) are not touched. The
    per-element arithmetic is `fused_adamw_leaves`' (the same `_update_block`), so a leaf gives
    bit-identical results in either layout. Launches: ceil(leaves / max_leaves_per_call), each
    aliasing the three buffers input → output, so under a donating jit the whole update is in place.

    Args:
      flat_params, flat_mu, flat_nu: 1-D float32 arrays of one length S.
      grads: float arrays (any shapes), leaf k with grads[k].size elements.
      offsets: one static int per leaf, in [0, S − size]; the leaves' ranges must not overlap.
      scalars: this step's `AdamWStepScalars`.
      decay: one Python bool per leaf.
      config: launch shape and interpret mode (`KernelConfig()` when None).

    Returns:
      (new_flat_params, new_flat_mu, new_flat_nu).
    """
    cfg = (config or KernelConfig()).validate()
    n = len(grads)
    for name, x in (("flat_params", flat_params), ("flat_mu", flat_mu), ("flat_nu", flat_nu)):
        if x.dtype != F32 or x.ndim != 1:
            raise TypeError(f"{name} must be a 1-D float32 array, got {x.dtype}{list(x.shape)}")
        if x.shape != flat_params.shape:
            raise ValueError(f"{name} must have the length of flat_params {flat_params.shape[0]}, got {x.shape[0]}")
    for name, xs in (("offsets", offsets), ("decay", decay)):
        if len(xs) != n:
            raise ValueError(f"{name} must have one entry per leaf ({n}), got {len(xs)}")
    size = flat_params.shape[0]
    if size >= 2 ** 31 - cfg.block_size:
        raise ValueError(f"flat_params has {size} elements; int32 offsets allow < 2**31")
    spans = []
    for k, (g, off) in enumerate(zip(grads, offsets)):
        if not jnp.issubdtype(g.dtype, jnp.floating):
            raise TypeError(f"grads[{k}] must be floating, got {g.dtype}")
        if isinstance(off, bool) or not isinstance(off, int) or off < 0 or off + g.size > size:
            raise ValueError(f"offsets[{k}] = {off!r} must be an int with the leaf's {g.size} elements inside "
                             f"the buffers' {size}")
        spans.append((off, off + g.size))
    spans.sort()
    for (a0, a1), (b0, _) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(f"offsets: the leaves at [{a0}, {a1}) and from {b0} overlap")
    if not isinstance(scalars, AdamWStepScalars):
        raise TypeError(f"scalars must be an AdamWStepScalars, got {type(scalars).__name__}")

    interpret = cfg.interpret if cfg.interpret is not None else jax.default_backend() == "cpu"
    vec = scalars.as_vector()
    p, m, v = flat_params, flat_mu, flat_nu
    live = [k for k in range(n) if grads[k].size > 0]
    for start in range(0, len(live), cfg.max_leaves_per_call):
        group = live[start:start + cfg.max_leaves_per_call]
        p, m, v = _one_flat_launch(vec, p, m, v, [grads[k].reshape(-1) for k in group],
                                   [offsets[k] for k in group], [decay[k] for k in group], cfg, interpret)
    return p, m, v
