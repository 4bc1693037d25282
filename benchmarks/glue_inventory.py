"""The XLA glue around one mixer layer's Pallas kernels, counted from its jaxpr (no GPU needed).

    PYTHONPATH=$PWD python3 benchmarks/glue_inventory.py mamba3        # B=8 T=2048, the 130m-class layer
    PYTHONPATH=$PWD python3 benchmarks/glue_inventory.py mamba1 --min-elements 100000

Traces `jax.grad` of one mixer layer (forward + backward, bf16, the Pallas implementation preferred)
and walks every jaxpr inside it (jit, custom_vjp bodies), printing the Pallas calls and, by primitive,
the other ops whose largest output has at least `--min-elements` elements (default [8, 2048, 24]):
the per-position work XLA fuses into its launches around the kernels. `--list` prints each such op.
"""

from __future__ import annotations

import argparse
import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmamba.ops import dispatch

WRAPPERS = ("pjit", "jit", "closed_call", "custom_vjp_call", "custom_jvp_call", "remat", "checkpoint",
            "custom_vjp_call_jaxpr")


def mixer(arch):
    if arch == "mamba3":
        from jmamba.mamba3.config import Mamba3Config
        from jmamba.mamba3.mixer import Mamba3Mixer
        return Mamba3Mixer(Mamba3Config(d_model=768, n_layers=24, d_state=128, headdim=64), rngs=nnx.Rngs(0))
    from jmamba.mamba1.config import Mamba1Config
    from jmamba.mamba1.mixer import Mamba1Mixer
    return Mamba1Mixer(Mamba1Config(d_model=768, n_layers=24), rngs=nnx.Rngs(0))


def walk(jaxpr, min_elements, found):
    for e in jaxpr.eqns:
        sub = [e.params[p] for p in ("jaxpr", "call_jaxpr", "fun_jaxpr") if p in e.params]
        if e.primitive.name in WRAPPERS and sub:
            for j in sub:
                walk(getattr(j, "jaxpr", j), min_elements, found)
            continue
        size = max((int(np.prod(v.aval.shape)) for v in e.outvars if hasattr(v.aval, "shape")), default=0)
        if e.primitive.name == "pallas_call" or size >= min_elements:
            found.append((e.primitive.name, str(e.params.get("name", "")), [str(v.aval) for v in e.outvars][:2]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("arch", choices=["mamba1", "mamba3"])
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--min-elements", type=int, default=8 * 2048 * 24)
    p.add_argument("--list", action="store_true")
    a = p.parse_args(argv)
    m = mixer(a.arch)
    graphdef, state = nnx.split(m)
    x = jax.ShapeDtypeStruct((a.batch_size, a.seq_len, 768), jnp.bfloat16)

    def loss(state, x):
        y, _ = nnx.merge(graphdef, state)(x)
        return jnp.sum(y.astype(jnp.float32))

    op = "mamba3_siso_scan" if a.arch == "mamba3" else "selective_scan"
    with dispatch.prefer(op, "pallas"):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, x)
    found = []
    walk(jaxpr.jaxpr, a.min_elements, found)
    kernels = [name for prim, name, _ in found if prim == "pallas_call"]
    others = collections.Counter(prim for prim, _, _ in found if prim != "pallas_call")
    print(f"# {a.arch} mixer layer, B={a.batch_size} T={a.seq_len}, forward + backward: {len(kernels)} Pallas calls, "
          f"{sum(others.values())} other ops with >= {a.min_elements} output elements")
    print("kernels:", ", ".join(kernels))
    print("others:", ", ".join(f"{k} {v}" for k, v in others.most_common()))
    if a.list:
        for prim, name, avals in found:
            print(prim, name, avals)
    return {"kernels": kernels, "others": dict(others)}


if __name__ == "__main__":
    main()
