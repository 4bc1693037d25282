"""Benchmark of the Mamba-3 SISO scan: pallas vs xla vs reference, one process.

    python3 benchmarks/bench_mamba3_scan.py              # the three shapes of docs/performance.md §6 (GPU)
    python3 benchmarks/bench_mamba3_scan.py --sweep      # also time the SWEEP Pallas configs at b8t2048
    python3 benchmarks/bench_mamba3_scan.py --breakdown  # also time each Pallas launch at b8t2048
    python3 benchmarks/bench_mamba3_scan.py --tiny       # CPU smoke run at a tiny shape (interpret mode)

Every shape runs the official anchor's call: bf16 Q, K, V, Z, Trap; float32 ADT, DT, biases, D;
angles shared by the heads ([Bt, T, S], as the mixer passes them); no initial states; H=24, P=64,
N=128, G=1, S=32, chunk 64. For each implementation: the forward, and forward+backward (a VJP with a
random output cotangent returning every input cotangent), each the median of `--iters` runs after a
warm-up, every run bracketed by `jax.block_until_ready`, with the min–max spread. The functions of a
shape are compiled ahead of time, in parallel threads, before any of them is timed; rows are printed
as soon as their shape is done (a run cut short still leaves the first shapes).

Rates: FLOP/s counts the dots of the chunked algorithm (forward 2L²(N+P) + 4LNP per chunk and head,
backward 6L²(N+P) + 10LNP more), against the 668 TFLOP/s bf16 ceiling measured on the H200; bandwidth
is the fewest bytes the op must move (each input read once, each output written once) over the
median time, against 3.72 TB/s (docs/performance.md §5). The official Triton kernel's times (fixed numbers
measured elsewhere) are printed beside. Performance is checked here, never in tests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import fmt_time, rel, timed  # noqa: E402

from jmamba.ops import Mamba3ScanTuning, mamba3_siso_scan  # noqa: E402
from pallas_kernels.mamba3_siso import DEFAULT_CONFIG  # noqa: E402

PEAK_TFLOPS = 668.0
CEILING_TBPS = 3.72
# Earlier runs (docs/performance.md §3): official Triton mamba3_siso_combined on H200 (bf16, D, Z, chunk 64): (fwd, fwd+bwd) ms, best seen.
OFFICIAL_MS = {(8, 2048): ("0.80–1.23", "2.15–3.25"), (32, 512): ("0.74–0.79", "2.03–2.42"),
               (2, 8192): ("2.18", "4.33")}
DIMS = dict(H=24, P=64, N=128, G=1, S=32)
SHAPES = {"b8t2048": (8, 2048), "b32t512": (32, 512), "b2t8192": (2, 8192)}
TINY = dict(shape=(1, 40), dims=dict(H=2, P=16, N=32, G=1, S=8), chunk=16)
ARG_NAMES = ("Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "z")
# Candidates for `--sweep` (notes_mamba3_scan.md records what a sweep found).
SWEEP = [
    DEFAULT_CONFIG,
    dataclasses.replace(DEFAULT_CONFIG, stored_state_dtype="float32"),
    dataclasses.replace(DEFAULT_CONFIG, gradient_kernels=1, stored_scores=False, stored_ungated=False,
                        keys_with_queries=False),
    dataclasses.replace(DEFAULT_CONFIG, gradient_kernels=2, stored_scores=False, stored_ungated=False,
                        keys_with_queries=False),
    dataclasses.replace(DEFAULT_CONFIG, num_warps_grad=8),
    dataclasses.replace(DEFAULT_CONFIG, num_warps_chunk=8),
    dataclasses.replace(DEFAULT_CONFIG, num_warps_local=8),
    dataclasses.replace(DEFAULT_CONFIG, num_warps_qk=4),
    dataclasses.replace(DEFAULT_CONFIG, state_block_p=32),
    dataclasses.replace(DEFAULT_CONFIG, state_block_p=8),
    dataclasses.replace(DEFAULT_CONFIG, angle_sums="matmul"),
    dataclasses.replace(DEFAULT_CONFIG, angle_sums="matmul", num_warps_qk=4),
    dataclasses.replace(DEFAULT_CONFIG, qk_head_splits=2),
    dataclasses.replace(DEFAULT_CONFIG, stored_scores=False, stored_ungated=False),   # the session-15 default
    dataclasses.replace(DEFAULT_CONFIG, stored_scores=True, stored_ungated=False),
    dataclasses.replace(DEFAULT_CONFIG, stored_scores=False, stored_ungated=True),
    dataclasses.replace(DEFAULT_CONFIG, stored_for_keys=True),
]
# The query/key gradient kernel's knobs (session 17): row blocks per chunk, its own warps, head slices,
# the angle sums by triangular dots.
QK_SWEEP = [DEFAULT_CONFIG] + [dataclasses.replace(DEFAULT_CONFIG, **kw) for kw in (
    dict(angle_sums="matmul"), dict(num_warps_qk_grad=4), dict(num_warps_qk_grad=16),
    dict(qk_grad_blocks=2), dict(qk_grad_blocks=2, num_warps_qk_grad=4), dict(qk_grad_blocks=4),
    dict(qk_grad_blocks=4, num_warps_qk_grad=4), dict(qk_grad_blocks=2, qk_head_splits=8),
    dict(qk_head_splits=8), dict(qk_head_splits=12), dict(qk_head_splits=2, qk_grad_blocks=4),
    dict(num_warps_qk=4), dict(num_warps_qk=16), dict(qk_gradient_dtype="float32"),
    dict(qk_grad_blocks=2, num_warps_qk_grad=4), dict(qk_gradient_dtype="float32", qk_grad_blocks=4))]
QK16 = [DEFAULT_CONFIG] + QK_SWEEP[-3:]
ADT = [DEFAULT_CONFIG, dataclasses.replace(DEFAULT_CONFIG, adt_in_values=False),
       dataclasses.replace(DEFAULT_CONFIG, stored_for_keys=True),
       dataclasses.replace(DEFAULT_CONFIG, keys_with_queries=True),
       dataclasses.replace(DEFAULT_CONFIG, keys_with_queries=True, num_warps_grad=8)]
# The queries' and keys' gradients rotated back in their chunk launch (session 22) vs the separate
# query/key gradient kernel, and that launch's warps.
HEAD = [DEFAULT_CONFIG] + [dataclasses.replace(DEFAULT_CONFIG, rotate_in_chunk_gradients=True, **kw) for kw in (
    dict(), dict(num_warps_head_grad=8), dict(head_gradient_launches=1, num_warps_head_grad=8),
    dict(head_gradient_launches=1))]
# The skip term as the scores' diagonal (the default since session 23) vs the float32 per-position weight.
SKIP = [DEFAULT_CONFIG, dataclasses.replace(DEFAULT_CONFIG, skip_in_scores=False)]
# The walking state passes (session 23): contributions formed inside the walk over the chunks.
# The default since session 23 (walk, 64 rows) against the split passes and other row blocks / warps.
WALK = [DEFAULT_CONFIG] + [dataclasses.replace(DEFAULT_CONFIG, **kw) for kw in (
    dict(state_passes="split"), dict(walk_block_p=16), dict(walk_block_p=32), dict(num_warps_walk=8))]
# The hardware cos / sin in the query/key kernels (session 25, untimed): with fewer instructions and
# instructions per head step, other splits or the rotation in the chunk-gradient launches may now win
# (4 warps spill in both query/key kernels: triton_inspect.py, 352 B and 696 B of stack; 16 warps:
# forward 519 instructions per head step at 118 registers, gradients 136 B of spills; 2 gradient
# blocks: 979 per step at 217 registers, no spills).
FASTROT = [DEFAULT_CONFIG] + [dataclasses.replace(DEFAULT_CONFIG, fast_rotation=True, **kw) for kw in (
    dict(), dict(qk_head_splits=8), dict(qk_grad_blocks=2), dict(num_warps_qk=16), dict(rotate_in_chunk_gradients=True),
    dict(angle_sums="matmul"), dict(fast_rotation_backward=False), dict(fast_rotation_backward=False, num_warps_qk=16))]
SWEEP_SETS = {"all": SWEEP, "stored": [DEFAULT_CONFIG] + SWEEP[-4:], "qk": QK_SWEEP, "qk16": QK16, "adt": ADT,
              "head": HEAD, "skip": SKIP, "walk": WALK, "fastrot": FASTROT}


def make_args(bsz, T, dims, dtype=jnp.bfloat16, seed=0, per_head_angles=False):
    """Op arguments like a Mamba-3 layer's (the official test's generator: rms-normed Q/K, DT
    log-uniform in [1e-3, 0.1], ADT = -U[1, 16]·DT, D = 1). Angles are shared by the heads
    ([Bt, T, S], the layer's) or, with per_head_angles, [Bt, T, H, S] (the anchors' op timing uses
    those: per-head rates and rate gradients, 4× more angle traffic at S = N/4)."""
    H, P, N, G, S = (dims[k] for k in ("H", "P", "N", "G", "S"))
    r = np.random.default_rng(seed)

    def rms_normed(shape):
        x = r.normal(size=shape)
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5)

    dt = np.exp(r.uniform(np.log(1e-3), np.log(1e-1), (bsz, T, H)))
    a = dict(Q=rms_normed((bsz, T, G, N)), K=rms_normed((bsz, T, G, N)), V=r.normal(size=(bsz, T, H, P)),
             ADT=-r.uniform(1, 16, (bsz, T, H)) * dt, DT=dt, Trap=r.uniform(0, 1, (bsz, T, H)),
             Q_bias=r.normal(size=(H, N)), K_bias=r.normal(size=(H, N)), Angles=r.normal(size=(bsz, T, H, S) if per_head_angles else (bsz, T, S)),
             D=np.ones(H), z=r.normal(size=(bsz, T, H, P)))
    low = ("Q", "K", "V", "z", "Trap")
    return {k: jnp.asarray(v, dtype if k in low else jnp.float32) for k, v in a.items()}


def op_function(impl, chunk, config=None):
    """fn(args dict) -> out [Bt, T, H, P] through the op (validation and angle broadcast included);
    `config` is the Pallas kernels' Mamba3ScanConfig (interpreted off the GPU)."""
    tuning = Mamba3ScanTuning(chunk_size=chunk, pallas_config=config if impl == "pallas" else None)
    return lambda a: mamba3_siso_scan(**a, implementation=impl, tuning=tuning)


def forward_and_backward(fn):
    def fwd_bwd(a, d_out):
        out, vjp = jax.vjp(fn, a)
        return out, vjp(d_out)[0]
    return fwd_bwd


def compile_all(jobs, workers):
    """jobs: {key: (fn, args)} -> {key: compiled or the exception}. Lowering runs here, XLA compiles
    in parallel threads (they release the GIL)."""
    lowered = {}
    for key, (fn, args) in jobs.items():
        try:
            lowered[key] = jax.jit(fn).lower(*args)
        except Exception as e:  # report and go on
            lowered[key] = e
    out = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {k: pool.submit(lambda l: l.compile(), l) for k, l in lowered.items() if not isinstance(l, Exception)}
        for k, l in lowered.items():
            if isinstance(l, Exception):
                out[k] = l
        for k, f in futures.items():
            try:
                out[k] = f.result()
            except Exception as e:
                out[k] = e
    return out


def dot_flops(bsz, T, dims, chunk):
    """(forward, forward+backward) FLOPs of the chunked algorithm's dots."""
    H, P, N = dims["H"], dims["P"], dims["N"]
    chunks = bsz * H * math.ceil(T / chunk)
    L = chunk
    fwd = chunks * (2 * L * L * (N + P) + 4 * L * N * P)
    return fwd, fwd + chunks * (6 * L * L * (N + P) + 10 * L * N * P)


def min_bytes(bsz, T, dims, itemsize=2):
    """Fewest HBM bytes (forward, forward+backward): Q, K [Bt,T,G,N], V, Z, out [Bt,T,H,P] in bf16,
    ADT, DT f32 and Trap bf16 [Bt,T,H], angles f32 [Bt,T,S]; the backward reads d_out too and writes
    every input's gradient once."""
    H, P, N, G, S = (dims[k] for k in ("H", "P", "N", "G", "S"))
    qk = 2 * bsz * T * G * N * itemsize
    rows = bsz * T * H * P * itemsize
    scal = bsz * T * H * (4 + 4 + itemsize) + bsz * T * S * 4
    fwd = qk + 3 * rows + scal
    return fwd, fwd + rows + qk + 2 * rows + scal


def core_operands(inputs, chunk, config):
    """(geometry, prep): the kernels' ScanGeometry and `prep(*inputs)` -> the 13 operands of
    `pallas_kernels.mamba3_siso.core.chunked_core`, i.e. the op's glue and layout work before the core.

    Both are captured from the real glue (jmamba/ops/mamba3_siso_scan/pallas.py) by standing in for
    `chunked_core` while it runs, so the breakdown times exactly what the op runs.
    """
    from jmamba.ops.mamba3_siso_scan.pallas import mamba3_siso_scan_pallas
    from pallas_kernels.mamba3_siso import scan as kernel_scan

    seen = {}

    def stand_in(geo, *operands):   # what chunked_core returns: out like v, the final state [Bt, H, Pp, Np]
        seen["geo"], seen["operands"] = geo, operands
        v = operands[8]
        final = (geo.batch, geo.heads, geo.padded_headdim, geo.padded_state)
        return jnp.zeros(v.shape, v.dtype), jnp.zeros(final, jnp.float32)

    def prep(*x):
        real = kernel_scan.chunked_core
        kernel_scan.chunked_core = stand_in
        try:
            mamba3_siso_scan_pallas(*x, None, None, tuning=Mamba3ScanTuning(chunk_size=chunk, pallas_config=config))
        finally:
            kernel_scan.chunked_core = real
        return seen["operands"]

    jax.eval_shape(prep, *inputs)
    return seen["geo"], prep


def stage_breakdown(shape, dims, chunk, config, iters, workers):
    """Times each launch of the Pallas forward and backward on its own: [(stage, (median, min, max))].

    Every stage is lowered from abstract shapes and compiled in parallel first, then run in order,
    each feeding the next. The XLA stages are the glue before the core (prep) and its VJP (the glue
    backward); every other stage is one or more Pallas launches.

    It times the split state passes (contributions + combine) and the skip term as a per-position weight
    of V, whatever `config` says about state_passes / skip_in_scores (the defaults since session 23 are
    the walk and the scores' diagonal): use `profile_kernels.py` for the default launches.
    """
    from pallas_kernels.mamba3_siso import chunk_backward, chunk_forward, core, qk_gradients, state_passes
    from pallas_kernels.mamba3_siso.queries_keys import head_queries_keys_kernel as queries_keys_kernel

    a = make_args(*shape, dims)
    H = dims["H"]
    angles = a["Angles"][:, :, None]      # shared by the heads, as the op normalizes the mixer's [Bt, T, S]
    inputs = [a[k] for k in ARG_NAMES[:8]] + [angles, a["D"], a["z"]]
    geo, prep = core_operands(inputs, chunk, config)
    del H

    def operands(args, qk, d_out=None):   # args: Q, K, Q_bias, K_bias, scale, angles, dt, θ_entry, v, z, adt, γ, s0, D
        skip = core.skip_term(args[13], args[11], qk[3])       # D + γ⟨q̄, k̄⟩: the core's one XLA op
        return core.kernel_operands(*qk[:2], *args[8:11], skip, s0=args[12], d_out=d_out)

    def queries_keys(args):               # (q, k̃, θ, ⟨q̄, k̄⟩)
        return queries_keys_kernel(geo, *args[:8])

    def fwd_local(args, qk):
        return state_passes.chunk_contributions(geo, operands(args, qk), adjoint=False)

    def fwd_combine(args, local):
        return state_passes.combine_chunks(geo, local, state_passes.chunk_decays(geo, args[10]), args[12],
                                           reverse=False)[0]

    def fwd_chunks(args, qk, entering):
        return chunk_forward.chunk_outputs(geo, operands(args, qk), entering, for_backward=True)

    def bwd_local(args, qk, d_out):
        return state_passes.chunk_contributions(geo, operands(args, qk, d_out), adjoint=True)

    def bwd_combine(args, local):
        # the op's call: the final state unused, so the adjoint starts from zeros with no boundary operand
        return state_passes.combine_chunks(geo, local, state_passes.chunk_decays(geo, args[10]), None,
                                           reverse=True, want_last=args[12] is not None)[0]

    def bwd_chunks(args, qk, d_out, entering, leaving, stored):   # stored: the forward's kept products
        return chunk_backward.chunk_gradients(geo, dict(operands(args, qk, d_out), **stored), entering, leaving)

    def qk_grads(args, qk, grads):
        return qk_gradients.query_key_gradients(geo, *args[:7], qk[2], grads["dq"], grads["dk"],
                                                d_diagonal=grads["d_skip"] * args[11])

    def glue_backward(qk_g, grads, diagonal, d_initial):
        """XLA: the core's cotangents of γ and D from d skip (skip = D + γ⟨q̄, k̄⟩), then the VJP of prep
        (from the core's cotangents to the op's)."""
        cotangents = tuple(qk_g) + (grads["dv"], grads.get("dz"), grads["d_adt"], grads["d_skip"] * diagonal,
                                    d_initial, jnp.sum(grads["d_skip"], axis=(0, 1)))
        primals, vjp = jax.vjp(prep, *inputs)
        return vjp(tuple(None if c is None else c.astype(p.dtype) for c, p in zip(cotangents, primals)))

    stages = [("prep (XLA, before the core)", prep, lambda r: inputs),
              ("fwd 0: per-head q, k̃", queries_keys, lambda r: (r["args"],)),
              ("fwd 1: chunk states", fwd_local, lambda r: (r["args"], r["qk"])),
              ("fwd 2: state combine", fwd_combine, lambda r: (r["args"], r["fwd_local"])),
              ("fwd 3: chunk outputs", fwd_chunks, lambda r: (r["args"], r["qk"], r["entering"])),
              ("bwd 1: chunk adjoints", bwd_local, lambda r: (r["args"], r["qk"], r["d_out"])),
              ("bwd 2: adjoint combine", bwd_combine, lambda r: (r["args"], r["bwd_local"])),
              ("bwd 3: chunk gradients", bwd_chunks,
               lambda r: (r["args"], r["qk"], r["d_out"], r["entering"], r["leaving"], r["fwd_out"][1])),
              ("bwd 4: query/key gradients", qk_grads, lambda r: (r["args"], r["qk"], r["grads"])),
              ("bwd 5: glue backward (XLA: d γ, d D and the VJP of prep, which it recomputes)", glue_backward,
               lambda r: (r["qk_g"], r["grads"], r["qk"][3], r["args"][12]))]
    # abstract values of every intermediate, so that all stages can be lowered before any runs
    shapes = {"args": jax.eval_shape(prep, *inputs)}
    shapes["d_out"] = jax.ShapeDtypeStruct(shapes["args"][8].shape, shapes["args"][8].dtype)
    shapes["qk"] = jax.eval_shape(queries_keys, shapes["args"])
    shapes["fwd_local"] = jax.eval_shape(fwd_local, shapes["args"], shapes["qk"])
    shapes["entering"] = jax.eval_shape(fwd_combine, shapes["args"], shapes["fwd_local"])
    shapes["fwd_out"] = jax.eval_shape(fwd_chunks, shapes["args"], shapes["qk"], shapes["entering"])
    shapes["bwd_local"] = jax.eval_shape(bwd_local, shapes["args"], shapes["qk"], shapes["d_out"])
    shapes["leaving"] = jax.eval_shape(bwd_combine, shapes["args"], shapes["bwd_local"])
    shapes["grads"] = jax.eval_shape(bwd_chunks, shapes["args"], shapes["qk"], shapes["d_out"], shapes["entering"],
                                     shapes["leaving"], shapes["fwd_out"][1])
    shapes["qk_g"] = jax.eval_shape(qk_grads, shapes["args"], shapes["qk"], shapes["grads"])
    compiled = compile_all({name: (fn, get(shapes)) for name, fn, get in stages}, workers)

    real = {"d_out": jnp.asarray(np.random.default_rng(7).normal(size=shapes["d_out"].shape), shapes["d_out"].dtype)}
    produces = ("args", "qk", "fwd_local", "entering", "fwd_out", "bwd_local", "leaving", "grads", "qk_g", None)
    out = []
    for (name, _, get), key in zip(stages, produces):
        c = compiled[name]
        if isinstance(c, Exception):
            print(f"# breakdown stage {name} failed to compile: {type(c).__name__}: {str(c)[:300]}", flush=True)
            return out
        t, res = timed(c, get(real), iters)
        if key is not None:
            real[key] = res
        out.append((name, t))
    return out


def _short(cfg):
    return (f"chunk<={cfg.max_chunk} combine-rows{cfg.state_block_p} warps combine/local/out/grad "
            f"{cfg.num_warps_state}/{cfg.num_warps_local}/{cfg.num_warps_chunk}/{cfg.num_warps_grad} "
            f"stages{cfg.num_stages} states-{cfg.stored_state_dtype} "
            f"grad-launches{cfg.gradient_kernels} qk-warps{cfg.num_warps_qk}/{cfg.num_warps_qk_grad} "
            f"qk-splits{cfg.qk_head_splits} qk-grad-blocks{cfg.qk_grad_blocks} dqk-{cfg.qk_gradient_dtype} "
            f"angle-sums-{cfg.angle_sums}" + (" stored-scores" if cfg.stored_scores else "")
            + (" stored-ungated" if cfg.stored_ungated else "") + (" stored-for-keys" if cfg.stored_for_keys else "")
            + (" adt-in-values" if cfg.adt_in_values else "") + (" keys-with-queries" if cfg.keys_with_queries else "")
            + (" skip-in-scores" if cfg.skip_in_scores else "")
            + (" rotate-in-chunks" if cfg.rotate_in_chunk_gradients else "")
            + (f" walk-rows{cfg.walk_block_p}-warps{cfg.num_warps_walk}" if cfg.state_passes == "walk"
               else " split-passes"))


def main(argv=None):
    """Runs the benchmark (argv as on the command line) and returns its records: one dict per timed
    row (kind "table", "sweep" or "breakdown"), each with `seconds`, {what: median seconds}."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="one tiny shape, Pallas in interpret mode (CPU smoke run)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    p.add_argument("--impls", default="pallas,xla,reference")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ref-iters", type=int, default=10, help="runs of the (slow) reference")
    p.add_argument("--sweep", action="store_true", help="after the table, time the SWEEP Pallas configs at the first shape")
    p.add_argument("--sweep-set", default="all", choices=sorted(SWEEP_SETS),
                   help="which candidates --sweep times: all, stored (the default and the stored-products variants) "
                        "qk (the query/key kernels' knobs), qk16 (dq, dk̃ in bf16 or float32) or adt (where dADT and dQ are formed)")
    p.add_argument("--breakdown", action="store_true", help="time each Pallas launch at the first shape")
    p.add_argument("--workers", type=int, default=16, help="parallel compile threads")
    p.add_argument("--json", default=None, help="write all numbers here")
    a = p.parse_args(argv)

    device = jax.devices()[0]
    print(f"# jax {jax.__version__}, device {device.device_kind} ({jax.default_backend()})", flush=True)
    if a.tiny:
        shapes, dims, chunk = {"tiny": TINY["shape"]}, TINY["dims"], TINY["chunk"]
        iters, ref_iters = min(a.iters, 3), min(a.ref_iters, 3)
    else:
        shapes, dims, chunk = {k: SHAPES[k] for k in a.shapes.split(",")}, DIMS, 64
        iters, ref_iters = a.iters, a.ref_iters
    impls = a.impls.split(",")
    candidates = SWEEP_SETS[a.sweep_set]
    sweep = (candidates[:2] if a.tiny else candidates) if a.sweep else []
    first = next(iter(shapes))
    records = []

    def measure(key, impl_configs):
        """Compiles fwd and fwd+bwd of each (impl, config) at shape `key` in parallel, then times them."""
        bsz, T = shapes[key]
        args = make_args(bsz, T, dims)
        d_out = jnp.asarray(np.random.default_rng(7).normal(size=args["V"].shape), jnp.bfloat16)
        jobs = {}
        for impl, cfg in impl_configs:
            fn = op_function(impl, chunk, cfg)
            jobs[(impl, cfg, "fwd")] = (fn, (args,))
            jobs[(impl, cfg, "fwd+bwd")] = (forward_and_backward(fn), (args, d_out))
        t0 = time.perf_counter()
        compiled = compile_all(jobs, a.workers)
        print(f"# {key}: compiled {len(jobs)} functions in {time.perf_counter() - t0:.1f} s", flush=True)
        results = {}
        for (impl, cfg, kind), c in compiled.items():
            label = f"{key} {impl} {kind}" + (f" {_short(cfg)}" if cfg else "")
            if isinstance(c, Exception):
                print(f"# {label}: failed to compile: {type(c).__name__}: {str(c)[:600]}", flush=True)
                continue
            try:
                t, res = timed(c, (args,) if kind == "fwd" else (args, d_out),
                               ref_iters if impl == "reference" else iters)
            except Exception as e:
                print(f"# {label}: failed to run: {type(e).__name__}: {str(e)[:600]}", flush=True)
                continue
            results[(impl, cfg, kind)] = (t, res)
        return results

    print(f"\n## Mamba-3 SISO scan, bf16 inputs, f32 state, H={dims['H']} P={dims['P']} N={dims['N']} G={dims['G']} "
          f"S={dims['S']} chunk {chunk} (median of {iters}, reference {ref_iters}; min–max); pallas config: "
          f"{_short(DEFAULT_CONFIG)}\n")
    print("| shape | impl | fwd ms | fwd TFLOP/s · TB/s (% of 668 · 3.72) | fwd+bwd ms | fwd+bwd TFLOP/s · TB/s | "
          "× pallas (fwd / fwd+bwd) | official Triton fwd / fwd+bwd ms | rel err vs reference (out, dV, dQ, dADT) |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for key, (bsz, T) in shapes.items():
        results = measure(key, [(impl, DEFAULT_CONFIG if impl == "pallas" else None) for impl in impls])
        fl, by = dot_flops(bsz, T, dims, chunk), min_bytes(bsz, T, dims)
        get = lambda impl, kind: results.get((impl, DEFAULT_CONFIG if impl == "pallas" else None, kind))
        for impl in impls:
            f, b = get(impl, "fwd"), get(impl, "fwd+bwd")
            if not f or not b:
                print(f"| {key} | {impl} | failed |||||||", flush=True)
                continue
            cells = []
            for (t, _), flops, nbytes in ((f, fl[0], by[0]), (b, fl[1], by[1])):
                tf, tb = flops / t[0] / 1e12, nbytes / t[0] / 1e12
                cells.append((fmt_time(t), f"{tf:.1f} · {tb:.2f} ({100 * tf / PEAK_TFLOPS:.1f}% · "
                                           f"{100 * tb / CEILING_TBPS:.0f}%)"))
            speed = ""
            pf, pb = get("pallas", "fwd"), get("pallas", "fwd+bwd")
            if impl != "pallas" and pf and pb:
                speed = f"{f[0][0] / pf[0][0]:.2f}× / {b[0][0] / pb[0][0]:.2f}×"
            err = ""
            rf, rb = get("reference", "fwd"), get("reference", "fwd+bwd")
            if impl != "reference" and rf and rb:
                gg, gr = b[1][1], rb[1][1]
                err = (f"{rel(f[1], rf[1]):.1e}, {rel(gg['V'], gr['V']):.1e}, {rel(gg['Q'], gr['Q']):.1e}, "
                       f"{rel(gg['ADT'], gr['ADT']):.1e}")
            official = OFFICIAL_MS.get((bsz, T))
            print(f"| {key} ({bsz}×{T}) | {impl} | {cells[0][0]} | {cells[0][1]} | {cells[1][0]} | {cells[1][1]} | "
                  f"{speed} | {'' if official is None else f'{official[0]} / {official[1]}'} | {err} |", flush=True)
            records.append(dict(kind="table", shape=key, impl=impl, fwd=f[0], fwd_bwd=b[0], flops=fl, bytes=by,
                                seconds={"fwd": f[0][0], "fwd+bwd": b[0][0]}))
    print("\n'× pallas' = that row's time / pallas time", flush=True)

    if sweep:
        results = measure(first, [("pallas", cfg) for cfg in sweep])
        print(f"\n## Pallas config sweep at {first} (median of {iters}, min–max)\n\n"
              "| config | fwd ms | fwd+bwd ms |\n|---|---|---|")
        for cfg in sweep:
            f, b = results.get(("pallas", cfg, "fwd")), results.get(("pallas", cfg, "fwd+bwd"))
            print(f"| {_short(cfg)} | {fmt_time(f[0]) if f else 'failed'} | {fmt_time(b[0]) if b else 'failed'} |",
                  flush=True)
            for kind, r in (("fwd", f), ("fwd+bwd", b)):
                if r:
                    records.append(dict(kind="sweep", shape=first, config=dataclasses.asdict(cfg), what=kind,
                                        time=r[0], seconds={kind: r[0][0]}))

    if a.breakdown:
        stages = stage_breakdown(shapes[first], dims, chunk, DEFAULT_CONFIG, iters, a.workers)
        total = sum(t[0] for _, t in stages)
        print(f"\n## Pallas launches one by one, {first}, {_short(DEFAULT_CONFIG)}\n\n"
              "| stage | ms (min–max) | share |\n|---|---|---|")
        for name, t in stages:
            print(f"| {name} | {fmt_time(t)} | {100 * t[0] / total:.0f}% |", flush=True)
            records.append(dict(kind="breakdown", shape=first, stage=name, time=t, seconds={"stage": t[0]}))
        print(f"| sum (each launch timed alone, dispatch included) | {total * 1e3:.3f} | |", flush=True)

    if a.json:
        Path(a.json).write_text(json.dumps(dict(jax=jax.__version__, device=device.device_kind, records=records),
                                           indent=1, default=str))
    return records


if __name__ == "__main__":
    main()
