"""Mamba-3's in_proj backward alone (`jmamba.ops.split_dense`): dx and dw of x · w as three column blocks,
"reference" (JAX's transpose: dx summed left to right behind the barrier) against "xla" (custom VJP: dx
summed right to left straight from the matmuls), each compiled with XLA's default options and with
`xla_gpu_triton_gemm_any=false` (the plain dots then reach XLA's GEMM rewriter as cuBLAS calls, which
can take the sums in as their matrix bias, cuBLAS beta = 1: ops/projections/xla.py says when).

    python3 benchmarks/bench_split_dense.py           # GPU: x [8·2048, 768], blocks (1536, 1536, 360), bf16
    python3 benchmarks/bench_split_dense.py --tiny    # CPU smoke run

Rows: implementation × compiler options; "fwd+bwd" is the three forward matmuls and the backward (dx and
dw) under fixed cotangents, one jitted call; medians (min–max) of `--iters` calls. The last column is the
largest relative difference of dx from the first row's (the sums' order and where they are rounded).
On the GPU, `--dump DIR` also writes each variant's optimized HLO, to count the add fusions left.
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

OPTIONS = (("default options", None), ("triton_gemm_any off", {"xla_gpu_triton_gemm_any": False}))


def step(impl, sizes, options):
    def fwd_bwd(x, w, cts):
        ys, vjp = jax.vjp(lambda x, w: ops.split_dense(x, w, sizes, implementation=impl), x, w)
        return ys, vjp(cts)
    return jax.jit(fwd_bwd, compiler_options=options) if options else jax.jit(fwd_bwd)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8 * 2048)
    p.add_argument("--d-in", type=int, default=768)
    p.add_argument("--sizes", default="1536,1536,360", help="the column blocks (Mamba-3 130m: z, xv, rest)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--dump", default=None, metavar="DIR", help="write each variant's optimized HLO here")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke run")
    a = p.parse_args(argv)
    if a.tiny:
        a.rows, a.d_in, a.sizes, a.iters = 64, 16, "8,8,5", 3
    sizes = tuple(int(s) for s in a.sizes.split(","))
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(a.rows, a.d_in)), jnp.bfloat16)
    w = jnp.asarray(r.normal(size=(a.d_in, sum(sizes))) / np.sqrt(a.d_in), jnp.bfloat16)
    cts = tuple(jnp.asarray(r.normal(size=(a.rows, s)), jnp.bfloat16) for s in sizes)
    print(f"# split_dense fwd+bwd: x [{a.rows}, {a.d_in}], blocks {sizes}, bf16 | jax {jax.__version__} on "
          f"{jax.devices()[0].device_kind}")
    print("| implementation | compiler options | fwd+bwd ms | dx rel. diff |\n|---|---|---|---|")
    rows, first_dx = [], None
    for impl in ("reference", "xla"):
        for label, options in OPTIONS:
            fn = step(impl, sizes, options)
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                text = fn.lower(x, w, cts).compile().as_text()
                with open(os.path.join(a.dump, f"{impl}_{label.replace(' ', '_')}.txt"), "w") as f:
                    f.write(text)
            t, (_, (dx, _)) = timed(fn, (x, w, cts), a.iters)
            first_dx = dx if first_dx is None else first_dx
            err = rel(np.asarray(dx, np.float32), np.asarray(first_dx, np.float32))
            print(f"| {impl} | {label} | {fmt_time(t)} | {err:.1e} |", flush=True)
            rows.append({"variant": f"{impl}, {label}", "impl": impl, "options": label,
                         "seconds": {"fwd+bwd": t[0]}, "dx_rel_diff": err})
    return rows


if __name__ == "__main__":
    main()
