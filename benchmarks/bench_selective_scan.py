"""Benchmark of the Mamba-1 selective scan: pallas vs xla vs lax.associative_scan vs reference, one process.

    python3 benchmarks/bench_selective_scan.py            # the three shapes of docs/performance.md §6 (GPU)
    python3 benchmarks/bench_selective_scan.py --sweep    # also sweep Pallas block configs first
    python3 benchmarks/bench_selective_scan.py --tiny     # CPU smoke run at a tiny shape (interpret mode)

Every shape runs bf16 inputs with delta_softplus, z, D and delta_bias (the official anchor's call), f32
state. For each implementation: the forward, and forward+backward (a VJP with a random output cotangent
returning every input cotangent), each the median of `--iters` runs after a warm-up, every run
bracketed by `jax.block_until_ready`, with the min–max spread. Bandwidth is the fewest bytes the op
must move (each input read once, each output written once) over the median time, against the 3.72 TB/s
elementwise ceiling measured on the H200 (docs/performance.md §5). The official CUDA kernel's times (fixed
numbers measured elsewhere) are printed beside. Performance is checked here, never in tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import fmt_time, rel, scan_config, timed  # noqa: E402

from jmamba.ops import selective_scan  # noqa: E402
from jmamba.ops.selective_scan.common import prepare_delta  # noqa: E402
from pallas_kernels.selective_scan import DEFAULT_CONFIG, ScanBlockConfig, selective_scan_pallas  # noqa: E402

CEILING_TBPS = 3.72
# Earlier runs (docs/performance.md §3): official CUDA selective_scan_fn on H200 (bf16, delta_softplus, z, D, delta_bias): (fwd, fwd+bwd) ms.
OFFICIAL_MS = {(8, 2048): (0.478, 2.285), (32, 256): (0.252, 1.521), (2, 8192): (0.564, 2.515)}
SHAPES = {"b8t2048": (8, 2048, 1536, 16), "b32t256": (32, 256, 1536, 16), "b2t8192": (2, 8192, 1536, 16)}
TINY_SHAPE = (2, 64, 32, 16)
# Candidates for `--sweep` (notes_selective_scan.md records what earlier sweeps found).
SWEEP = [
    ScanBlockConfig(block_d=32, chunk=128, fwd_unroll=8, bwd_sub_chunk=4, hide_channel_alignment=False),
    ScanBlockConfig(block_d=32, chunk=128, fwd_unroll=8, bwd_sub_chunk=4, hide_channel_alignment=True),
    ScanBlockConfig(block_d=32, chunk=128, fwd_unroll=4, bwd_sub_chunk=4, hide_channel_alignment=True),
    ScanBlockConfig(block_d=32, chunk=64, fwd_unroll=8, bwd_sub_chunk=4, hide_channel_alignment=True),
]

# `--sweep-set backward`: the backward kernels' own channel block, warps and sub-chunk (the forward
# stays at the default); never swept before 2026-12-01 (notes_selective_scan.md).
_D = ScanBlockConfig()
_S4 = dataclasses.replace(_D, bwd_sub_chunk=4)   # the default when this set was run
SWEEP_BACKWARD = [
    _S4,
    dataclasses.replace(_S4, bwd_num_warps=2),
    dataclasses.replace(_S4, bwd_num_warps=4),
    dataclasses.replace(_S4, bwd_block_d=64),
    dataclasses.replace(_S4, bwd_block_d=64, bwd_num_warps=2),
    dataclasses.replace(_S4, bwd_block_d=64, bwd_num_warps=4),
    dataclasses.replace(_S4, bwd_block_d=16),
    dataclasses.replace(_S4, bwd_sub_chunk=2),
    dataclasses.replace(_S4, bwd_sub_chunk=8, bwd_num_warps=2),
    dataclasses.replace(_S4, bwd_sub_chunk=8, bwd_block_d=64, bwd_num_warps=4),
    dataclasses.replace(_S4, hide_channel_alignment=False),
    dataclasses.replace(_S4, hide_channel_alignment=False, bwd_num_warps=2),
    dataclasses.replace(_S4, chunk=128),
]
# `--sweep-set sub-chunk`: around the 2026-12-01 winner (bwd_sub_chunk 2, now the default).
SWEEP_SUB_CHUNK = [
    _D,
    dataclasses.replace(_D, bwd_sub_chunk=1),
    dataclasses.replace(_D, bwd_sub_chunk=4),
    dataclasses.replace(_D, chunk=128),
    dataclasses.replace(_D, hide_channel_alignment=False),
    dataclasses.replace(_D, bwd_block_d=16),
    dataclasses.replace(_D, bwd_reuse_decay=True),
    dataclasses.replace(_D, bwd_reuse_decay=True, bwd_sub_chunk=4),
]
# `--sweep-set parallel`: the time-parallel chunk-outputs kernel (forward_parallel.py, not yet timed)
# against the serial default, over its warps and the chunk (the scan's length) and channel block.
_P = dataclasses.replace(_D, fwd_parallel=True)
SWEEP_PARALLEL = [
    _D,
    _P,
    dataclasses.replace(_P, parallel_num_warps=2),
    dataclasses.replace(_P, parallel_num_warps=8),
    dataclasses.replace(_P, chunk=128),
    dataclasses.replace(_P, chunk=128, parallel_num_warps=8),
    dataclasses.replace(_P, block_d=16, bwd_block_d=32),
    dataclasses.replace(_P, block_d=64, bwd_block_d=32, parallel_num_warps=8),
]
# `--sweep-set mosaic`: the Mosaic GPU prototypes (mosaic_forward.py, mosaic_backward.py, not yet timed)
# in the op: forward alone (at the default chunk, its TMA tile length, and two others), backward alone, both.
SWEEP_MOSAIC = [_D, dataclasses.replace(_D, fwd_mosaic=True), dataclasses.replace(_D, fwd_mosaic=True, chunk=128),
                dataclasses.replace(_D, fwd_mosaic=True, chunk=32), dataclasses.replace(_D, bwd_mosaic=True),
                dataclasses.replace(_D, fwd_mosaic=True, bwd_mosaic=True)]
# `--sweep-set prefetch`: the backward kernels' rows loaded one sub-chunk ahead (the default since
# 2026-12-04) against not, and with it at sub-chunks 1 and 4.
SWEEP_PREFETCH = [_D, dataclasses.replace(_D, bwd_prefetch_rows=False),
                  dataclasses.replace(_D, bwd_sub_chunk=1), dataclasses.replace(_D, bwd_sub_chunk=4)]
SWEEP_SETS = {"default": SWEEP, "backward": SWEEP_BACKWARD, "sub-chunk": SWEEP_SUB_CHUNK,
              "parallel": SWEEP_PARALLEL, "mosaic": SWEEP_MOSAIC, "prefetch": SWEEP_PREFETCH}


def make_args(shape, dtype=jnp.bfloat16, seed=0):
    """Op arguments like a Mamba-1 layer's: B, C [Bt, T, n]; A = -(1..n) perturbed; dt bias ~ inverse
    softplus of [1e-3, 1e-1]."""
    bsz, T, d, n = shape
    r = np.random.default_rng(seed)
    dt = np.exp(r.uniform(np.log(1e-3), np.log(1e-1), size=d))
    return dict(
        u=jnp.asarray(r.normal(size=(bsz, T, d)), dtype),
        delta=jnp.asarray(r.normal(size=(bsz, T, d)) * 0.5, dtype),
        A=jnp.asarray(-np.arange(1, n + 1)[None, :] * np.exp(r.normal(size=(d, n)) * 0.1), jnp.float32),
        B=jnp.asarray(r.normal(size=(bsz, T, n)), dtype),
        C=jnp.asarray(r.normal(size=(bsz, T, n)), dtype),
        D=jnp.asarray(r.normal(size=(d,)), jnp.float32),
        z=jnp.asarray(r.normal(size=(bsz, T, d)), dtype),
        delta_bias=jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32),
    )


def associative_scan_baseline(u, delta, A, B, C, D, z, delta_bias):
    """`lax.associative_scan` over (exp(δA), δBu) on the whole [Bt, T, d, n] expansion (the baseline of docs/performance.md §3)."""
    dl = prepare_delta(delta, delta_bias, True)
    a = jnp.exp(dl[..., None] * A)
    beta = (dl * u.astype(jnp.float32))[..., None] * B.astype(jnp.float32)[:, :, None, :]
    _, h = jax.lax.associative_scan(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1]), (a, beta), axis=1)
    y = jnp.sum(h * C.astype(jnp.float32)[:, :, None, :], -1) + D * u.astype(jnp.float32)
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(u.dtype)


def implementation(name, config=None, interpret=False):
    """fn(**args) -> out [Bt, T, d] for an implementation name ("pallas", "xla", "assoc", "reference")."""
    if name == "assoc":
        return associative_scan_baseline
    if name == "pallas":
        def pallas(u, delta, A, B, C, D, z, delta_bias):
            return selective_scan_pallas(u, delta, A, B[:, :, None], C[:, :, None], D, z, delta_bias, None, None,
                                         delta_softplus=True, config=config, interpret=interpret)[0]
        return pallas
    return functools.partial(selective_scan, delta_softplus=True, implementation=name)


def min_bytes(shape, itemsize=2):
    """Fewest HBM bytes: (forward, forward+backward). Rows [Bt, T, d]: fwd reads u, delta, z and writes out;
    bwd reads u, delta, z, d_out and writes du, d_delta, dz. B, C rows [Bt, T, n] read once per pass
    (+ dB, dC written)."""
    bsz, T, d, n = shape
    rows, small = bsz * T * d * itemsize, bsz * T * n * itemsize
    fwd = 4 * rows + 2 * small
    return fwd, fwd + 7 * rows + 4 * small


def bench_one(name, shape, args, d_out, iters, config=None, interpret=False):
    f = implementation(name, config, interpret)
    names = list(args)
    fwd = jax.jit(lambda a: f(**a))
    vals = [args[k] for k in names]

    @jax.jit
    def fwd_bwd(a, g):
        out, vjp = jax.vjp(lambda *v: f(**dict(zip(names, v))), *[a[k] for k in names])
        return out, vjp(g)

    t_fwd, out = timed(fwd, (args,), iters)
    t_all, (_, grads) = timed(fwd_bwd, (args, d_out), iters)
    del vals
    return dict(impl=name, fwd=t_fwd, fwd_bwd=t_all, out=out, grads=dict(zip(names, grads)),
                config=None if config is None else dataclasses.asdict(config))


def stage_breakdown(shape, config, iters, interpret):
    """Times each launch of the Pallas forward and backward on its own: [(stage, (median, min, max))]."""
    from pallas_kernels.selective_scan import backward, combine, forward, scan

    args = make_args(shape)
    B4, C4 = args["B"][:, :, None], args["C"][:, :, None]
    prob = scan.make_problem(args["u"], args["A"], B4, args["D"], args["z"], args["delta_bias"], None,
                             delta_softplus=True, config=config, interpret=interpret)
    assert prob.padded_seqlen == shape[1] and prob.n == shape[3], "breakdown shapes must need no padding"
    bprob = prob.for_backward()
    d_out = jnp.asarray(np.random.default_rng(7).normal(size=shape[:3]), jnp.bfloat16)
    ops = scan.kernel_operands(prob, args["u"], args["delta"], args["A"].T, B4, C4, args["D"], args["z"],
                               args["delta_bias"], None, d_out=d_out)
    h0 = jnp.zeros((shape[0], prob.n, shape[2]), jnp.float32)
    out = []

    def stage(name, fn, *a):
        t, res = timed(jax.jit(fn), a, iters)
        out.append((name, t))
        return res

    Q, S = stage("fwd 1: chunk summaries", lambda o: forward.chunk_summaries(prob, o), ops)
    H, _ = stage("fwd 2: chunk combine", lambda A, q, s, h: combine.chunk_states(prob, A, q, s, None, h, reverse=False),
                 ops["A_t"], Q, S, h0)
    stage("fwd 3: chunk outputs", lambda o, h: forward.chunk_outputs(prob, o, h), ops, H)
    R, sub_adj, sub_rd = stage("bwd 1: adjoint summaries", lambda o: backward.adjoint_summaries(bprob, o), ops)
    G, _ = stage("bwd 2: adjoint combine",
                 lambda A, r, s, h: combine.chunk_states(scan.adjoint_combine_problem(prob), A, r, s, None, h,
                                                         reverse=True), ops["A_t"], R, S, h0)
    g = stage("bwd 3: chunk gradients",
              lambda o, h, gg, sa, sr: backward.chunk_gradients(bprob, o, h, gg, sa, sr, None), ops, H, G, sub_adj, sub_rd)
    stage("bwd 4: XLA partial sums", lambda gg: scan.reduce_partials(gg, B4, C4), g)
    return out


def main(argv=None):
    """Runs the benchmark (argv as on the command line) and returns its records: one dict per timed
    row (kind "sweep", "breakdown" or "table"), each with `seconds`, {what: median seconds}."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="one tiny shape, Pallas in interpret mode (CPU smoke run)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    p.add_argument("--impls", default="pallas,xla,assoc,reference")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="time the SWEEP Pallas configs first, keep the best")
    p.add_argument("--sweep-set", default="default", choices=sorted(SWEEP_SETS),
                   help="which candidate list --sweep times (backward: the backward kernels' own knobs)")
    p.add_argument("--sweep-shapes", default="b8t2048", help="shapes the sweep runs at")
    p.add_argument("--sweep-iters", type=int, default=10)
    p.add_argument("--breakdown", action="store_true", help="time each Pallas launch at the first shape")
    p.add_argument("--config", default=None,
                   help="Pallas config as ScanBlockConfig fields, e.g. block_d=32,chunk=128,bwd_sub_chunk=4")
    p.add_argument("--json", default=None, help="write all numbers here")
    p.add_argument("--cache-dir", default=None, help="persistent compilation cache (saves recompiles)")
    p.add_argument("--xla-dump", default=None, help="XLA dump directory (PTX, to look for spills)")
    a = p.parse_args(argv)
    if a.xla_dump:  # must be set before the backend starts
        import os
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={a.xla_dump}").strip()
    if a.cache_dir:
        jax.config.update("jax_compilation_cache_dir", a.cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    device = jax.devices()[0]
    print(f"# jax {jax.__version__}, device {device.device_kind} ({jax.default_backend()})", flush=True)
    interpret = jax.default_backend() != "gpu"
    if a.tiny:
        shapes = {"tiny": TINY_SHAPE}
        iters = min(a.iters, 3)
        base_config = ScanBlockConfig(block_d=16, chunk=16, fwd_unroll=2, bwd_sub_chunk=2)
        sweep = [base_config, dataclasses.replace(base_config, block_d=8)] if a.sweep else []
    else:
        shapes = {k: SHAPES[k] for k in a.shapes.split(",")}
        iters = a.iters
        base_config = DEFAULT_CONFIG
        sweep = SWEEP_SETS[a.sweep_set] if a.sweep else []
    if a.config:
        base_config = scan_config(a.config)
    impls = a.impls.split(",")
    records = []

    best_config = base_config
    if sweep:
        print("\n## Pallas block-config sweep\n\n| shape | config | fwd ms (min–max) | fwd+bwd ms (min–max) |\n|---|---|---|---|")
        scores = {}
        sweep_shapes = ["tiny"] if a.tiny else a.sweep_shapes.split(",")
        for key in sweep_shapes:
            shape = shapes.get(key, SHAPES.get(key))
            args = make_args(shape)
            d_out = jnp.asarray(np.random.default_rng(7).normal(size=shape[:3]), jnp.bfloat16)
            for cfg in sweep:
                try:
                    r = bench_one("pallas", shape, args, d_out, min(iters, a.sweep_iters), cfg, interpret)
                except Exception as e:  # a config that does not compile or run: report and go on
                    print(f"| {key} | {cfg} | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)
                    continue
                scores.setdefault(cfg, 0.0)
                scores[cfg] += r["fwd_bwd"][0]
                records.append(dict(kind="sweep", shape=key, impl="pallas", config=r["config"],
                                    fwd=r["fwd"], fwd_bwd=r["fwd_bwd"],
                                    seconds={"fwd": r["fwd"][0], "fwd+bwd": r["fwd_bwd"][0]}))
                print(f"| {key} | {_short(cfg)} | {fmt_time(r['fwd'])} | {fmt_time(r['fwd_bwd'])} |", flush=True)
        if scores:
            best_config = min(scores, key=scores.get)
            print(f"\nbest config by fwd+bwd: {_short(best_config)}", flush=True)

    if a.breakdown:
        key, shape = next(iter(shapes.items()))
        stages = stage_breakdown(shape, best_config, iters, interpret)
        total = sum(t[0] for _, t in stages)
        print(f"\n## Pallas launches one by one, {key} {shape}, {_short(best_config)}\n\n"
              "| stage | ms (min–max) | share |\n|---|---|---|")
        for name, t in stages:
            print(f"| {name} | {fmt_time(t)} | {100 * t[0] / total:.0f}% |", flush=True)
            records.append(dict(kind="breakdown", shape=key, stage=name, time=t, seconds={"stage": t[0]}))
        print(f"| sum | {total * 1e3:.3f} | |")

    print("\n## Selective scan, bf16 inputs, f32 state (median of %d, min–max)\n" % iters)
    print("| shape | impl | fwd ms | fwd TB/s (% of 3.72) | fwd+bwd ms | fwd+bwd TB/s (% of 3.72) | "
          "pallas speed-up | official CUDA fwd / fwd+bwd ms | max rel err vs reference (out, du) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, shape in shapes.items():
        args = make_args(shape)
        d_out = jnp.asarray(np.random.default_rng(7).normal(size=shape[:3]), jnp.bfloat16)
        results = {}
        for name in impls:
            try:
                results[name] = bench_one(name, shape, args, d_out, iters,
                                          best_config if name == "pallas" else None, interpret)
            except Exception as e:
                print(f"| {key} | {name} | failed: {type(e).__name__}: {str(e)[:200]} |||||||", flush=True)
        fb, ab = min_bytes(shape)
        official = OFFICIAL_MS.get(shape[:2])
        ref = results.get("reference")
        for name, r in results.items():
            speed = ""
            if "pallas" in results and name != "pallas":
                speed = (f"{r['fwd'][0] / results['pallas']['fwd'][0]:.2f}× / "
                         f"{r['fwd_bwd'][0] / results['pallas']['fwd_bwd'][0]:.2f}×")
            err = ""
            if ref is not None and name != "reference":
                err = f"{rel(r['out'], ref['out']):.1e}, {rel(r['grads']['u'], ref['grads']['u']):.1e}"
            print(f"| {key} {shape} | {name} | {fmt_time(r['fwd'])} | "
                  f"{fb / r['fwd'][0] / 1e12:.2f} ({100 * fb / r['fwd'][0] / 1e12 / CEILING_TBPS:.0f}%) | "
                  f"{fmt_time(r['fwd_bwd'])} | {ab / r['fwd_bwd'][0] / 1e12:.2f} "
                  f"({100 * ab / r['fwd_bwd'][0] / 1e12 / CEILING_TBPS:.0f}%) | {speed} | "
                  f"{'' if official is None else f'{official[0]} / {official[1]}'} | {err} |", flush=True)
            records.append(dict(kind="table", shape=key, impl=name, config=r["config"], fwd=r["fwd"],
                                fwd_bwd=r["fwd_bwd"], bytes=(fb, ab),
                                seconds={"fwd": r["fwd"][0], "fwd+bwd": r["fwd_bwd"][0]}))
    print("\n'pallas speed-up' = that row's time / pallas time (fwd / fwd+bwd); pallas config: "
          f"{_short(best_config)}")
    if a.json:
        Path(a.json).write_text(json.dumps(dict(jax=jax.__version__, device=device.device_kind,
                                                records=records), indent=1, default=str))
    return records


def _short(cfg):
    return (f"bd{cfg.block_d} c{cfg.chunk} u{cfg.fwd_unroll} s{cfg.bwd_sub_chunk} w{cfg.num_warps}"
            + (f" bwd-bd{cfg.bwd_block_d}" if cfg.bwd_block_d else "")
            + (f" bwd-w{cfg.bwd_num_warps}" if cfg.bwd_num_warps else "")
            + (" prefetch-bc" if cfg.prefetch_bc else "")
            + (" hide-align" if cfg.hide_channel_alignment else "")
            + (" reuse-decay" if cfg.bwd_reuse_decay else "")
            + (" bwd-prefetch-rows" if cfg.bwd_prefetch_rows else "")
            + (f" parallel-fwd w{cfg.parallel_num_warps}" if cfg.fwd_parallel else "")
            + (" mosaic-fwd" if cfg.fwd_mosaic else "") + (" mosaic-bwd" if cfg.bwd_mosaic else ""))


if __name__ == "__main__":
    main()
