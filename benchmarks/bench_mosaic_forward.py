"""The Mosaic GPU forward prototype of the Mamba-1 scan against the Triton forward, at a 130m layer's shape.

    python3 benchmarks/bench_mosaic_forward.py           # H200: Bt=8 T=2048 d=1536 n=16, bf16, z, D, bias, softplus
    python3 benchmarks/bench_mosaic_forward.py --tiny    # CPU smoke run (both interpreted)

Rows: "triton" (`jmamba.ops.selective_scan(..., implementation="pallas")`, forward only, with the final
state) and "mosaic c<L>" (pallas_kernels/selective_scan/mosaic_forward.py, one row per `--chunks`
entry; it also writes the state entering every chunk). The last column is the largest difference of
the output from the Triton one, relative to its largest magnitude. Times are medians (min–max) of
`--iters` jitted calls; the official CUDA forward at this shape: 0.478 ms (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import fmt_time, rel, timed  # noqa: E402
from jmamba import ops  # noqa: E402
from pallas_kernels.selective_scan.mosaic_forward import mosaic_forward  # noqa: E402


def make(bt, seqlen, d, n, dtype):
    r = np.random.default_rng(0)
    act = lambda shift=0.0: jnp.asarray(r.normal(size=(bt, seqlen, d)) + shift, dtype)
    return dict(u=act(), delta=act(-1.0), A=-jnp.asarray(np.exp(r.normal(size=(d, n)) * 0.5), jnp.float32),
                B=jnp.asarray(r.normal(size=(bt, seqlen, n)), dtype), C=jnp.asarray(r.normal(size=(bt, seqlen, n)), dtype),
                D=jnp.asarray(r.normal(size=(d,)), jnp.float32), z=act(),
                delta_bias=jnp.asarray(r.normal(size=(d,)) * 0.3, jnp.float32))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny shape, both kernels interpreted (CPU smoke run)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--chunks", default="64,128,32", help="comma-separated Mosaic chunk lengths")
    a = p.parse_args(argv)
    shape = (1, 32, 128, 16) if a.tiny else (8, 2048, 1536, 16)
    chunks = [16] if a.tiny else [int(c) for c in a.chunks.split(",")]
    iters = 1 if a.tiny else a.iters
    interpret = jax.default_backend() != "gpu"
    x = make(*shape, jnp.bfloat16)
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; shape (Bt, T, d, n) = {shape}, bf16"
          + (" (interpreted)" if interpret else ""), flush=True)

    triton = jax.jit(lambda x: ops.selective_scan(**x, delta_softplus=True, return_final_state=True,
                                                  implementation="pallas"))
    variants = [("triton", triton)]
    for c in chunks:
        variants.append((f"mosaic c{c}", jax.jit(lambda x, c=c: mosaic_forward(**x, softplus=True, chunk=c,
                                                                               interpret=interpret)[:2])))
    rows, base = [], None
    print("\n| variant | fwd ms (median, min–max) | max rel diff of out vs triton |\n|---|---|---|")
    for name, fn in variants:
        try:
            t, (out, _) = timed(fn, (x,), iters, warmup=1 if a.tiny else 3)
        except Exception as e:  # a prototype: report a failure instead of stopping the table
            print(f"| {name} | failed: {type(e).__name__}: {str(e)[:300]} | |", flush=True)
            continue
        base = out if base is None else base
        print(f"| {name} | {fmt_time(t)} | {rel(out, base):.2e} |", flush=True)
        rows.append({"variant": name, "seconds": {"fwd": t[0]}, "rel_diff": rel(out, base)})
    return rows


if __name__ == "__main__":
    main()
