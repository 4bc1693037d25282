"""The Pallas selective scan: padding, the `custom_vjp` that strings the kernels together, reductions.

Contract (the jmamba op's implementation signature, see jmamba/ops/selective_scan/reference.py):
`selective_scan_pallas(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, *, delta_softplus)`
-> (out [Bt, T, d] in u.dtype, final_state [Bt, d, n] float32), differentiable w.r.t. every array.

Forward  (3 launches): chunk summaries -> chunk combine -> chunk outputs        (forward.py, combine.py)
Backward (3 launches): adjoint summaries -> adjoint combine -> chunk gradients (backward.py, combine.py)
then XLA sums the per-program partials of dA, dD, d delta_bias over (batch, chunk) and of dB, dC over
the channel blocks of a group, in a fixed order (deterministic; no atomics anywhere).

Residuals kept from the forward: the inputs and the chunk-start states H [Bt, T/chunk, n, d] float32
plus δ sums [Bt, T/chunk, d]; the [Bt, T, d, n] expansion is never stored (the backward recomputes
states one sub-chunk at a time in registers).

Padding (done here, outside the kernels, only when needed): T up to a multiple of `chunk` (padding
steps are made the identity inside the kernels), d_state up to a power of two (A = 0, B = C = 0 and
h_{-1} = 0 there, so padded states stay 0 and contribute nothing). Channel blocks always divide
d / groups (`ScanBlockConfig.fitted`), so d is never padded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common.dtypes import F32
from pallas_kernels.common.padding import pad_axis_to
from pallas_kernels.common.sizes import next_power_of_2, round_up
from pallas_kernels.selective_scan import backward, combine, forward
from pallas_kernels.selective_scan.config import DEFAULT_CONFIG, ScanBlockConfig, ScanProblem
from pallas_kernels.selective_scan.kernel_math import LOG2_E


def selective_scan_pallas(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, *, delta_softplus,
                          config: ScanBlockConfig | None = None, interpret: bool = False):
    """Chunked Pallas selective scan.

    Args:
      u, delta: [Bt, T, d] (f32 / bf16 / f16). A: [d, n]. B, C: [Bt, T, g, n] (g divides d).
      D, delta_bias: [d] or None. z: [Bt, T, d] or None. initial_state: [Bt, d, n] or None.
      reset: [Bt, T] bool or None (True zeroes the state entering position t).
      delta_softplus: apply the thresholded softplus to delta + delta_bias.
      config: block sizes (None: DEFAULT_CONFIG), shrunk to the call by `ScanBlockConfig.fitted`.
      interpret: run the kernels in the Pallas interpreter (CPU).

    Returns:
      (out [Bt, T, d] in u.dtype, final_state [Bt, d, n] float32).
    """
    problem = make_problem(u, A, B, D, z, delta_bias, reset, delta_softplus=delta_softplus, config=config,
                           interpret=interpret)
    operands = padded_operands(problem, u, delta, A, B, C, D, z, delta_bias, initial_state, reset)
    out, last = _scan(problem, *operands)
    return unpadded_outputs(problem, out, last, A.shape[1])


def padded_operands(problem: ScanProblem, u, delta, A, B, C, D, z, delta_bias, initial_state, reset):
    """The kernels' operands in their padded layout (see the module docstring):
    (u, delta, A_t [n_pad, d] f32, B, C [Bt, Tp, g, n_pad], D f32, z, bias f32, h0 [Bt, n_pad, d] f32,
    keep [Bt, Tp] f32 or None). Linear in the arrays (pads, transposes, casts)."""
    bsz, _, d = u.shape
    n_pad, padded_seqlen = problem.n, problem.padded_seqlen

    def pad_time(x):   # [Bt, T, ...] -> [Bt, Tp, ...]; optional operands stay None
        return None if x is None else pad_axis_to(x, 1, padded_seqlen)

    def pad_state(x, axis):   # the d_state axis -> n_pad
        return pad_axis_to(x, axis, n_pad)

    A_t = pad_state(A.astype(F32), 1).T                                     # [n, d]
    h0 = (jnp.zeros((bsz, n_pad, d), F32) if initial_state is None
          else jnp.swapaxes(pad_state(initial_state.astype(F32), 2), 1, 2))  # [Bt, n, d]
    return (pad_time(u), pad_time(delta), A_t, pad_time(pad_state(B, 3)), pad_time(pad_state(C, 3)),
            None if D is None else D.astype(F32), pad_time(z),
            None if delta_bias is None else delta_bias.astype(F32), h0, padded_keep(problem, reset))


def padded_keep(problem: ScanProblem, reset):
    """[Bt, Tp] float32: 1.0 keeps the incoming state, 0.0 at a reset; padding steps are no resets."""
    if reset is None:
        return None
    return pad_axis_to(jnp.logical_not(reset).astype(F32), 1, problem.padded_seqlen, value=1.0)


def unpadded_outputs(problem: ScanProblem, out, last, n):
    """(out [Bt, T, d], final_state [Bt, d, n] f32) from the kernels' padded results."""
    return out[:, :problem.seqlen], jnp.swapaxes(last, 1, 2)[:, :, :n]


def selective_scan_forward(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, *, delta_softplus,
                           config: ScanBlockConfig | None = None, interpret: bool = False, z_channel_offset=0):
    """`selective_scan_pallas`'s forward, also returning what `selective_scan_backward` needs.

    For ops that wrap the scan in their own `custom_vjp` (e.g. the fused Mamba-1 mixer core, which
    recomputes u and delta in its backward instead of saving them). Same arguments as
    `selective_scan_pallas`, and `z_channel_offset`: z may be a wider [Bt, T, C] array whose channels
    [offset, offset + d) are the gate (in_proj's packed x | z output, offset = d): the kernels read it
    in place when the offset is a multiple of the channel blocks, else a slice is taken.

    Returns:
      (out [Bt, T, d] in u.dtype, final_state [Bt, d, n] f32, residuals): residuals is a tuple of
      arrays (chunk-start states [Bt, nc, n_pad, d] f32, δ sums [Bt, nc, d] f32), nothing per position.
    """
    problem = make_problem(u, A, B, D, z, delta_bias, reset, delta_softplus=delta_softplus, config=config,
                           interpret=interpret, z_offset=z_channel_offset)
    if z is not None and z_channel_offset and not problem.z_offset:
        z = z[..., z_channel_offset:z_channel_offset + u.shape[-1]]
    operands = padded_operands(problem, u, delta, A, B, C, D, z, delta_bias, initial_state, reset)
    out, last, residuals = _scan_forward(problem, *operands)
    return unpadded_outputs(problem, out, last, A.shape[1]) + (residuals,)


def selective_scan_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, reset, residuals, d_out,
                            d_final_state, *, delta_softplus, config: ScanBlockConfig | None = None,
                            interpret: bool = False, z_channel_offset=0):
    """Cotangents of `selective_scan_forward` from its residuals (the same kernels as the custom_vjp).

    Args:
      u ... reset: the forward's arguments (the same arrays, or a bit-identical recomputation).
      residuals: the third result of `selective_scan_forward`.
      d_out: [Bt, T, d] cotangent of out. d_final_state: [Bt, d, n] cotangent of the final state.

    Returns:
      (du, d_delta, dA, dB, dC, dD, dz, d_delta_bias, d_initial_state), each like its argument
      (None where the argument is None); with `z_channel_offset`, dz is [Bt, T, d] (the gate's
      cotangent only, not one shaped like the wider z array).
    """
    problem = make_problem(u, A, B, D, z, delta_bias, reset, delta_softplus=delta_softplus, config=config,
                           interpret=interpret, z_offset=z_channel_offset)
    if z is not None and z_channel_offset and not problem.z_offset:
        z = z[..., z_channel_offset:z_channel_offset + u.shape[-1]]
    in_place = bool(problem.z_offset)

    def diff_operands(u, delta, A, B, C, D, z, delta_bias, initial_state):
        return padded_operands(problem, u, delta, A, B, C, D, z, delta_bias, initial_state, None)[:9]

    # A gate read in place is not differentiated through the padding: its cotangent is the kernel's dz.
    operands, operands_vjp = jax.vjp(diff_operands, u, delta, A, B, C, D, None if in_place else z, delta_bias,
                                     initial_state)
    if in_place:
        operands = operands[:6] + (pad_axis_to(z, 1, problem.padded_seqlen),) + operands[7:]
    d_out_p = pad_axis_to(d_out, 1, problem.padded_seqlen)
    d_last = jnp.swapaxes(pad_axis_to(d_final_state.astype(F32), 2, problem.n), 1, 2)
    cot = _scan_bwd(problem, operands[:8] + (padded_keep(problem, reset),) + tuple(residuals), (d_out_p, d_last))
    cot = tuple(None if c is None else c.astype(o.dtype) for c, o in zip(cot[:9], operands))
    if not in_place:
        return operands_vjp(cot)
    grads = operands_vjp(cot[:6] + (None,) + cot[7:])
    return grads[:6] + (cot[6][:, :problem.seqlen],) + grads[7:]


def make_problem(u, A, B, D, z, delta_bias, reset, *, delta_softplus, config=None, interpret=False,
                 z_offset=0) -> ScanProblem:
    """The static plan of a call: the config fitted to its shape, padded sizes, optional inputs.
    `z_offset` is kept only when z is wide enough and it is a multiple of both channel blocks (else 0:
    the caller slices the gate out)."""
    if config is not None and not isinstance(config, ScanBlockConfig):
        raise TypeError(f"config must be a ScanBlockConfig or None, got {type(config).__name__}")
    _, seqlen, d = u.shape
    n = A.shape[1]
    groups = B.shape[2]
    cfg = (config or DEFAULT_CONFIG).validate().fitted(seqlen, d, d // groups)
    if z is not None and z_offset:
        if z.shape[:2] != u.shape[:2] or z.shape[-1] < z_offset + d:
            raise ValueError(f"z of shape {z.shape} has no channels [{z_offset}, {z_offset + d}) for u of "
                             f"shape {u.shape}")
        if z_offset % cfg.block_d or z_offset % cfg.for_backward().block_d:
            z_offset = 0
    else:
        z_offset = 0
    return ScanProblem(
        seqlen=seqlen, padded_seqlen=round_up(seqlen, cfg.chunk), d=d, n=next_power_of_2(n),
        group_size=d // groups, has_z=z is not None, has_D=D is not None, has_bias=delta_bias is not None,
        has_reset=reset is not None, softplus=bool(delta_softplus), config=cfg, interpret=interpret,
        z_offset=int(z_offset))


def _keep_per_chunk(problem: ScanProblem, keep):
    """[Bt, Tp] -> [Bt, nc]: 0.0 where the chunk holds a reset (its decay product P_j is 0)."""
    if keep is None:
        return None
    return jnp.min(keep.reshape(keep.shape[0], problem.n_chunks, problem.config.chunk), axis=-1)


def _keep_right_of_sub_chunks(problem: ScanProblem, keep):
    """[Bt, Tp] -> [Bt, nc, nk]: 0.0 where a reset lies right of stored-adjoint block k inside chunk j
    (blocks of problem.adjoint_steps steps)."""
    if keep is None:
        return None
    nk, sub = problem.n_stored_adjoints, problem.adjoint_steps
    has_reset = 1.0 - jnp.min(keep.reshape(keep.shape[0], problem.n_chunks, nk, sub), axis=-1)
    suffix = jnp.flip(jnp.cumsum(jnp.flip(has_reset, -1), -1), -1) - has_reset   # resets strictly right
    return jnp.where(suffix > 0, 0.0, 1.0).astype(F32)


def kernel_operands(problem: ScanProblem, u, delta, A_t, B, C, D, z, bias, keep, d_out=None):
    """The kernels' operands; they get A·log2(e) (see kernel_math.decay), gradients are w.r.t. A;
    B and C as float32 with config.f32_state_rows."""
    if problem.config.f32_state_rows:
        B, C = B.astype(F32), C.astype(F32)
    return dict(u=u, delta=delta, A_t=A_t * LOG2_E, B=B, C=C, D=D, z=z, bias=bias, keep=keep, d_out=d_out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(problem, u, delta, A_t, B, C, D, z, bias, h0, keep):
    out, last, _ = _scan_forward(problem, u, delta, A_t, B, C, D, z, bias, h0, keep)
    return out, last


def mosaic_applies(problem: ScanProblem, keep, *, backward=False) -> bool:
    """Whether `ScanBlockConfig.fwd_mosaic` (`bwd_mosaic` with backward=True) runs the Mosaic GPU kernels
    for this call (see config.py)."""
    cfg = problem.config
    if not (cfg.bwd_mosaic if backward else cfg.fwd_mosaic):
        return False                      # (the Mosaic GPU backend is imported only when asked for)
    from pallas_kernels.selective_scan.mosaic_backward import SUB
    from pallas_kernels.selective_scan.mosaic_forward import CHANNELS
    common = (keep is None and problem.group_size == problem.d and problem.d % CHANNELS == 0
              and problem.padded_seqlen == problem.seqlen and cfg.chunk <= 256 and problem.n % 4 == 0
              and problem.z_offset % CHANNELS == 0)
    if backward:
        return common and problem.seqlen % SUB == 0 and SUB * problem.n <= 256
    return common


def _mosaic_scan_forward(problem, u, delta, A_t, B, C, D, z, bias, h0):
    """The forward through mosaic_forward.py, in the Triton forward's output layout."""
    from pallas_kernels.selective_scan.mosaic_forward import mosaic_forward
    out, last, starts, delta_sums = mosaic_forward(
        u, delta, A_t.T, B[:, :, 0], C[:, :, 0], D, z, bias, jnp.swapaxes(h0, 1, 2), softplus=problem.softplus,
        chunk=problem.config.chunk, z_channel_offset=problem.z_offset, interpret=problem.interpret)
    return out, jnp.swapaxes(last, 1, 2), (jnp.swapaxes(starts, 2, 3), delta_sums)


def _scan_forward(problem, u, delta, A_t, B, C, D, z, bias, h0, keep):
    if mosaic_applies(problem, keep):
        return _mosaic_scan_forward(problem, u, delta, A_t, B, C, D, z, bias, h0)
    ops = kernel_operands(problem, u, delta, A_t, B, C, D, z, bias, keep)
    local_end, delta_sums = forward.chunk_summaries(problem, ops)
    starts, last = combine.chunk_states(problem, ops["A_t"], local_end, delta_sums, _keep_per_chunk(problem, keep), h0,
                                        reverse=False)
    if problem.config.fwd_parallel:
        from pallas_kernels.selective_scan.forward_parallel import chunk_outputs_parallel
        out = chunk_outputs_parallel(problem, ops, starts)
    else:
        out = forward.chunk_outputs(problem, ops, starts)
    return out, last, (starts, delta_sums)


def _scan_fwd(problem, u, delta, A_t, B, C, D, z, bias, h0, keep):
    out, last, (starts, delta_sums) = _scan_forward(problem, u, delta, A_t, B, C, D, z, bias, h0, keep)
    return (out, last), (u, delta, A_t, B, C, D, z, bias, keep, starts, delta_sums)


def _mosaic_scan_bwd(problem, u, delta, A_t, B, C, D, z, bias, starts, d_out, d_last):
    """The backward through mosaic_backward.py (its forward recomputation starts from the state entering
    chunk 0, i.e. h0), in the Triton backward's output layout."""
    from pallas_kernels.selective_scan.mosaic_backward import mosaic_backward
    du, dd, dA, dB, dC, dD, dz, d_bias, dh0 = mosaic_backward(
        u, delta, A_t.T, B[:, :, 0], C[:, :, 0], D, z, bias, jnp.swapaxes(starts[:, 0], 1, 2), d_out.astype(u.dtype),
        jnp.swapaxes(d_last.astype(F32), 1, 2), softplus=problem.softplus, z_channel_offset=problem.z_offset,
        interpret=problem.interpret)
    return (du, dd, dA.T, dB[:, :, None].astype(B.dtype), dC[:, :, None].astype(C.dtype), dD, dz, d_bias,
            jnp.swapaxes(dh0, 1, 2), None)


def adjoint_combine_problem(problem: ScanProblem) -> ScanProblem:
    """The backward problem the adjoint combine runs with: the backward's channel block, the forward's
    layout hint (it is the forward combine's kernel walked the other way; without the hint it ran
    30 -> 40 us at B=8 T=2048 and 94 -> 139 us at B=2 T=8192 on the H200). `problem`: the forward's."""
    bwd = problem.for_backward()
    return dataclasses.replace(
        bwd, config=dataclasses.replace(bwd.config, hide_channel_alignment=problem.config.hide_channel_alignment))


def _scan_bwd(problem, residuals, cotangents):
    combine_problem = adjoint_combine_problem(problem)
    problem = problem.for_backward()
    u, delta, A_t, B, C, D, z, bias, keep, starts, delta_sums = residuals
    d_out, d_last = cotangents
    if mosaic_applies(problem, keep, backward=True):
        return _mosaic_scan_bwd(problem, u, delta, A_t, B, C, D, z, bias, starts, d_out, d_last)
    ops = kernel_operands(problem, u, delta, A_t, B, C, D, z, bias, keep, d_out=d_out.astype(u.dtype))
    local_adjoint, sub_adjoint, sub_right_delta = backward.adjoint_summaries(problem, ops)
    right_adjoints, d_h0 = combine.chunk_states(combine_problem, ops["A_t"], local_adjoint, delta_sums,
                                                _keep_per_chunk(problem, keep), d_last.astype(F32), reverse=True)
    g = backward.chunk_gradients(problem, ops, starts, right_adjoints, sub_adjoint, sub_right_delta,
                                 _keep_right_of_sub_chunks(problem, keep))
    dA_t, dB, dC, dD, d_bias = reduce_partials(g, B, C)
    d_keep = None if keep is None else jnp.zeros_like(keep)
    return (g["du"], g["d_delta"], dA_t, dB, dC, dD, g.get("dz"), d_bias, d_h0, d_keep)


def reduce_partials(g, B, C):
    """Sums the per-program partial gradients in XLA (fixed order): (dA_t, dB, dC, dD, d_bias)."""
    def per_group(partial, like):  # [d/bd, Bt, Tp, n] -> [Bt, Tp, g, n]: sum the blocks of each group
        n_blocks, bsz, tp, n = partial.shape
        groups = like.shape[2]
        summed = partial.reshape(groups, n_blocks // groups, bsz, tp, n).sum(axis=1)   # [g, Bt, Tp, n]
        return jnp.moveaxis(summed, 0, 2).astype(like.dtype)

    if "dBC_partial" in g:      # bwd_channel_sums="shuffle": [dB | dC] in one partial
        n = g["dBC_partial"].shape[-1] // 2
        g = dict(g, dB_partial=g["dBC_partial"][..., :n], dC_partial=g["dBC_partial"][..., n:])
    dD = g["dD_partial"].sum(axis=(0, 1)) if "dD_partial" in g else None
    d_bias = g["d_bias_partial"].sum(axis=(0, 1)) if "d_bias_partial" in g else None
    return (g["dA_partial"].sum(axis=(0, 1)), per_group(g["dB_partial"], B), per_group(g["dC_partial"], C),
            dD, d_bias)


_scan.defvjp(_scan_fwd, _scan_bwd)
