"""Per-device overhead of the sequence-sharded scans (jmamba.ops.sequence_sharding) at equal work.

    python3 benchmarks/bench_sequence_parallel.py            # H200: B=1, T=65,536, 130m-class layer shapes, bf16
    python3 benchmarks/bench_sequence_parallel.py --tiny     # CPU smoke run (small shapes, the "xla" implementations)

Each op runs its full window on one device twice: plainly, and under a mesh with a `seq` axis of
size 1, i.e. the sequence-parallel path with one shard (pass 1 from the zero state for the shard's
summary, the gather-and-fold of the summaries, pass 2 from the true incoming state). With S shards
each device runs that path on T/S positions, so the ratio below is the per-device price of the
split; the exchanged summaries are state-sized ([B, E, N] / [B, H, P, N] float32 per shard).
Rows: fwd and fwd+bwd (grad of a scalar of the outputs and the final state) medians of `--iters`,
and the largest difference of the outputs from the plain run (relative to its largest magnitude).
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


def mamba1_case(bsz, T, E, N, R, K, dtype, impl):
    r = np.random.default_rng(0)
    a = lambda *s, scale=1.0: jnp.asarray(r.normal(size=s) * scale, jnp.float32)
    args = (a(bsz, T, 2 * E).astype(dtype), a(K, E, scale=0.5), a(E), a(E, R + 2 * N, scale=E ** -0.5),
            a(R, E, scale=R ** -0.5), a(E) - 2.0, -jnp.exp(a(E, N) * 0.5), a(E))

    def f(xz, ck, cb, xp, dp, db, A, D):
        y, st = ops.mamba1_mixer_core(xz, None, ck, cb, xp, dp, db, A, D, return_final_state=True,
                                      implementation=impl, xz_packed=True)
        return y, st.ssm
    return f, args


def mamba3_case(bsz, T, H, N, P, S, dtype, impl):
    r = np.random.default_rng(0)
    a = lambda *s, scale=1.0: jnp.asarray(r.normal(size=s) * scale, jnp.float32)
    dt = jnp.exp(jnp.asarray(r.uniform(np.log(1e-3), np.log(0.1), (bsz, T, H)), jnp.float32))
    args = (a(bsz, T, 1, N).astype(dtype), a(bsz, T, 1, N).astype(dtype), a(bsz, T, H, P).astype(dtype),
            -dt * 2.0, dt, a(bsz, T, H).astype(dtype), a(H, N), a(H, N), a(bsz, T, S), a(H),
            a(bsz, T, H, P).astype(dtype))

    def f(*x):
        y, st = ops.mamba3_siso_scan(*x, return_final_state=True, implementation=impl)
        return y, st.ssm
    return f, args


def fwd_bwd(f):
    def scalar(*a):
        y, h = f(*a)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(h ** 2)
    return jax.grad(scalar, argnums=0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=65536)
    a = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    impl = "pallas" if gpu else "xla"
    T = 32 if a.tiny else a.seq_len
    iters = 1 if a.tiny else a.iters
    cases = {"mamba1_mixer_core": mamba1_case(1, T, *((32, 4, 2, 4) if a.tiny else (1536, 16, 48, 4)),
                                              jnp.bfloat16, impl),
             "mamba3_siso_scan": mamba3_case(1, T, *((2, 16, 8, 4) if a.tiny else (24, 128, 64, 32)),
                                             jnp.bfloat16, impl)}
    mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    print(f"# jax {jax.__version__}, {jax.devices()[0].device_kind}; B=1 T={T} bf16, implementation={impl}", flush=True)
    print("\n| op | path | fwd ms | fwd+bwd ms | fwd+bwd vs plain | max rel diff of out |\n|---|---|---|---|---|---|")
    rows = []
    for name, (f, args) in cases.items():
        base = None
        for path in ("plain", "seq axis, 1 shard"):
            def run(fn):
                jitted = jax.jit(fn)
                if path == "plain":
                    return jitted

                def sharded(*x):
                    with jax.set_mesh(mesh):
                        return jitted(*x)
                return sharded
            t_f, (y, _) = timed(run(f), args, iters, warmup=1)
            t_b, _ = timed(run(fwd_bwd(f)), args, iters, warmup=1)
            base = (y, t_b[0]) if base is None else base
            print(f"| {name} | {path} | {fmt_time(t_f)} | {fmt_time(t_b)} | {t_b[0] / base[1]:.2f}x | "
                  f"{rel(y, base[0]):.1e} |", flush=True)
            rows.append({"op": name, "path": path, "seconds": {"fwd": t_f[0], "fwd_bwd": t_b[0]}})
    return rows


if __name__ == "__main__":
    main()
