"""`affine_scan`: the first-order linear recurrence h_t = a_t·h_{t-1} + b_t along one axis of a tile,
as one Triton scan (`tt.scan`) inside Pallas-Triton kernels.

Why: the Mamba-1 kernels walk time serially per lane (one dependent step per position); the official
CUDA kernel instead scans (a, b) pairs across the threads of a block (a parallel prefix over time).
Pallas-Triton lowers `jnp.cumsum` through `tt.scan` but exposes no general associative scan; this
module registers one primitive with a Triton lowering rule (the same construction as jax's own
cumsum rule, with the affine combine and an optional reverse direction) and, for everything else
(the CPU interpreter, XLA), the equivalent `lax.associative_scan`.

    (A, H) = affine_scan(a, b, axis=0)      A_t = Π_{s<=t} a_s,   H_t = Σ_{s<=t} (Π_{s<r<=t} a_r)·b_s
    reverse=True: the same from the end   A_t = Π_{s>=t} a_s,   H_t = Σ_{s>=t} (Π_{t<=r<s} a_r)·b_s

i.e. H is h from a zero start (h_t = H_t + A_t·h_start gives any start). The combine of an earlier
pair (a1, b1) with a later one (a2, b2) is (a1·a2, a2·b1 + b2). Float32 in, float32 out; the order
of the partial products is the scan's tree (not the serial order): results differ from a serial walk
by rounding only.

Status (2026-12-01): lowers for an abstract H200 and matches a serial walk under the interpreter
(tests/test_affine_scan.py); not yet run on the GPU: Triton's combine-argument order for
`reverse=True` must be checked there before a kernel relies on it.

Importing this module loads the Pallas-Triton lowering (`jax._src.pallas.triton`): import it from
kernel modules only (which are themselves imported lazily).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core
from jax._src.interpreters import mlir

affine_scan_p = jax_core.Primitive("pallas_affine_scan")
affine_scan_p.multiple_results = True


def affine_scan(a, b, *, axis: int, reverse: bool = False):
    """(A, H) of the recurrence along `axis` (module docstring). a, b: same shape, float32."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"a and b must have one shape and dtype, got {a.shape} {a.dtype} and {b.shape} {b.dtype}")
    if not -a.ndim <= axis < a.ndim:
        raise ValueError(f"axis {axis} is out of range for rank {a.ndim}")
    return affine_scan_p.bind(a, b, axis=axis % a.ndim, reverse=bool(reverse))


def _combine(earlier, later):
    (a1, b1), (a2, b2) = earlier, later
    return a1 * a2, a2 * b1 + b2


def _reference(a, b, *, axis, reverse):
    return list(lax.associative_scan(_combine, (a, b), axis=axis, reverse=reverse))


affine_scan_p.def_impl(_reference)
affine_scan_p.def_abstract_eval(lambda a, b, **_: (jax_core.ShapedArray(a.shape, a.dtype),
                                                   jax_core.ShapedArray(b.shape, b.dtype)))
mlir.register_lowering(affine_scan_p, mlir.lower_fun(_reference, multiple_results=True))


def _register_triton_rule():
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering as tl

    def rule(ctx, a, b, *, axis, reverse):
        element = tl._element_type(a.type)
        scan = tt_dialect.ScanOp([a, b], axis, reverse)
        entry = scan.regions[0].blocks.append(element, element, element, element)
        with ir.InsertionPoint.at_block_begin(entry):
            a1, b1, a2, b2 = entry.arguments
            # the accumulated pair comes first (the earlier positions in the scan's direction)
            prod = tl._mul(a1, a2)
            acc = tl._add(tl._mul(a2, b1), b2)
            tt_dialect.scan_return([prod, acc])
        scan.verify()
        return list(scan.result)

    tl.triton_lowering_rules[affine_scan_p] = rule


_register_triton_rule()
