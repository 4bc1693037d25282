"""What the Pallas-Triton kernels compile to, without a GPU: registers, spills and the SASS instruction mix.

Two steps, in two Python environments (jax's lowering and Triton's compiler do not share one):

    # 1. in the project's venv: lower the op for an abstract H200 and save each kernel's Triton IR
    .venv/bin/python benchmarks/triton_inspect.py capture mamba1 --out /tmp/ttir [--scan-config K=V,...]
    # 2. in a venv with `pip install triton==3.6.0` (the H200 image's version): compile for sm_90
    /tmp/tvenv/bin/python benchmarks/triton_inspect.py compile /tmp/ttir [--fp-fusion]

Step 2 runs Triton's own pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas), which is close to but not
the same as XLA's (XLA links the kernel into its own LLVM module and does not let LLVM or ptxas contract
a multiply and an add into an FMA: Nsight Compute counted 19 M fused and 435 M unfused float32
instructions in the Mamba-1 gradients kernel on the H200). `--fp-fusion` off (the default) mimics that.
It prints, per kernel: registers, spill bytes, and the count of each SASS opcode class (FFMA, FMUL,
FADD, MUFU, SHFL, LDG, STG, LDS, STS, BAR, ...), whole kernel and inside the innermost loop body (the
basic blocks between the last backward branch target and its branch), which is what a time step costs.
Scripts that reach into jax internals (step 1 wraps `lower_jaxpr_to_triton_module`) are measurement
tools only: nothing in the library imports this file.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path


# ----------------------------------------------------------------------------------------- capture
def capture(what, out_dir, scan_config=None, shape=None, per_head_angles=False):
    """Lowers `what`'s forward+backward for an abstract H200, writing <name>.ttir and <name>.json
    (num_warps, num_stages) for every Pallas kernel."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import lowering, pallas_call_registration as reg
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    modules = []
    original_lower, original_call = lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call

    def lower(jaxpr, *a, **k):
        result = original_lower(jaxpr, *a, **k)
        modules.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    def custom_call(call_target_name, *a, backend_config=None, **k):
        if call_target_name == reg.CUSTOM_CALL_TARGET_NAME and modules:
            name = str(backend_config["name"]).strip('"')
            meta = {k2: int(str(backend_config[k2]).split(":")[0]) for k2 in ("num_warps", "num_stages")}
            text = modules.pop()
            fname = re.sub(r"[^A-Za-z0-9_]", "_", name)
            (out_dir / f"{fname}.ttir").write_text(text)
            (out_dir / f"{fname}.json").write_text(json.dumps(meta))
            print(f"captured {fname}: {meta}, {len(text)} chars")
        return original_call(call_target_name, *a, backend_config=backend_config, **k)

    lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call = lower, custom_call
    try:
        fn, specs = _op(what, scan_config, shape, per_head_angles)
        device = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
        mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=device)
        from unittest import mock
        from jmamba.ops.mamba3_siso_scan import pallas as m3_glue
        with warnings.catch_warnings(), jax.sharding.use_abstract_mesh(mesh), \
                mock.patch.object(m3_glue, "interpret_mode", return_value=False):
            warnings.simplefilter("ignore", DeprecationWarning)
            jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module, reg.mlir.custom_call = original_lower, original_call


def _op(what, scan_config, shape, per_head_angles=False):
    """(fn, argument specs) of the op's forward+backward at the benchmark shape."""
    import jax
    import jax.numpy as jnp
    from benchmarks.measure import scan_config as parse
    config = None
    if scan_config and not what.startswith("adamw"):
        config = parse(scan_config, "mamba3" if what in ("qk_norm", "projection") else what)
    if what == "mamba1":
        from pallas_kernels.selective_scan.scan import selective_scan_pallas
        bsz, T, d, n = shape or (8, 2048, 1536, 16)
        bf, f32 = jnp.bfloat16, jnp.float32
        specs = [jax.ShapeDtypeStruct(s, t) for s, t in [
            ((bsz, T, d), bf), ((bsz, T, d), bf), ((d, n), f32), ((bsz, T, 1, n), bf), ((bsz, T, 1, n), bf),
            ((d,), f32), ((bsz, T, d), bf), ((d,), f32)]]

        def loss(u, delta, A, B, C, D, z, bias):
            y, h = selective_scan_pallas(u, delta, A, B, C, D, z, bias, None, None, delta_softplus=True,
                                         config=config)
            return jnp.sum(y.astype(jnp.float32)) + jnp.sum(h)
        return jax.grad(loss, argnums=tuple(range(8))), specs
    if what == "mamba3":
        from benchmarks import bench_mamba3_scan as m3
        bsz, T = shape[:2] if shape else (8, 2048)
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            jax.eval_shape(lambda: m3.make_args(bsz, T, m3.DIMS, per_head_angles=per_head_angles)))
        op = m3.op_function("pallas", 64, config or m3.DEFAULT_CONFIG)
        fn = m3.forward_and_backward(op)
        return fn, [args, jax.ShapeDtypeStruct(args["V"].shape, jnp.bfloat16)]
    if what == "conv":
        from pallas_kernels.causal_conv import conv_silu_backward, conv_silu_forward
        bsz, T, e, k = shape or (8, 2048, 1536, 4)
        bf, f32 = jnp.bfloat16, jnp.float32
        specs = [jax.ShapeDtypeStruct(s, t) for s, t in [
            ((bsz, T, 2 * e), bf), ((bsz, k - 1, e), f32), ((k, e), f32), ((e,), f32), ((bsz, T, e), bf)]]

        def fwd_bwd(src, state, kernel, bias, g):   # the mixer core's packed call: forward, then backward
            u = conv_silu_forward(src, state, kernel, bias, None, config=config)
            return u, conv_silu_backward(src, state, kernel, bias, None, g, g, g,
                                         jnp.zeros((bsz, k - 1, e), f32), config=config)
        return fwd_bwd, specs
    if what == "qk_norm":   # the Mamba-3 B/C norms fused with the kernel layout (pallas_kernels/mamba3_siso/qk_norm.py)
        from pallas_kernels.mamba3_siso.config import make_geometry
        from pallas_kernels.mamba3_siso.qk_norm import normalized_kernel_layout
        bsz, T = shape[:2] if shape else (8, 2048)
        geo = make_geometry(batch=bsz, seqlen=T, heads=24, groups=1, headdim=64, d_state=128, num_angles=32,
                            chunk_size=64, has_z=True, matmul_dtype=jnp.bfloat16, io_dtype=jnp.bfloat16,
                            config=config)
        rows, w = jax.ShapeDtypeStruct((bsz, T, 1, 128), jnp.bfloat16), jax.ShapeDtypeStruct((128,), jnp.float32)

        def fwd_bwd(Q, K, wq, wk, dq, dk):
            y, vjp = jax.vjp(lambda *a: normalized_kernel_layout(geo, *a, 1e-5), Q, K, wq, wk)
            return y, vjp((dq, dk))
        return fwd_bwd, [rows, rows, w, w, rows, rows]
    if what == "projection":   # the Mamba-3 per-position work (pallas_kernels/mamba3_siso/projection.py)
        from jmamba.ops.mamba3_siso_scan.per_position import per_head_for
        from pallas_kernels.mamba3_siso.config import make_geometry
        from pallas_kernels.mamba3_siso.projection import projection
        bsz, T = shape[:2] if shape else (8, 2048)
        geo = make_geometry(batch=bsz, seqlen=T, heads=24, groups=1, headdim=64, d_state=128, num_angles=32,
                            chunk_size=64, has_z=True, matmul_dtype=jnp.bfloat16, io_dtype=jnp.bfloat16,
                            config=config)
        s = jax.ShapeDtypeStruct
        rest, heads = s((bsz, T, 2 * 128 + 3 * 24 + 32), jnp.bfloat16), s((bsz, T, 24), jnp.float32)
        layout = s((bsz, T, 1, 128), jnp.bfloat16)

        def fwd_bwd(rest, bias, wk, wq, cots):
            y, vjp = jax.vjp(lambda *a: projection(geo, *a, T, 1e-5, per_head_for(1e-4)), rest, bias, wk, wq)
            return y, vjp(cots)
        cots = (layout, layout, heads, heads, heads, heads, s((bsz, T, 1, 32), jnp.float32))
        return fwd_bwd, [rest, s((24,), jnp.float32), s((128,), jnp.float32), s((128,), jnp.float32), cots]
    if what in ("adamw_flat", "adamw_leaves"):   # the fused AdamW on flat buffers (a flat TrainState) / per leaf
        from jmamba import ops
        from jmamba.core.flat_buffers import FlatSpec
        from pallas_kernels.fused_adamw import KernelConfig, fused_adamw_flat, fused_adamw_leaves
        shapes = [(50280, 768), (768,), (768, 3432), (24,), (1536, 768), (3, 17)]   # LM-like leaves, one odd
        if what == "adamw_leaves":
            leaves = [jax.ShapeDtypeStruct(sh, jnp.float32) for sh in shapes]

            def update_leaves(ps, ms, vs, lr, gs):
                scalars = ops.step_scalars(learning_rate=lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, step=3)
                return fused_adamw_leaves(ps, gs, ms, vs, scalars, [True, False] * 3,
                                          config=KernelConfig(interpret=False))[:3]
            return update_leaves, [leaves, leaves, leaves, jax.ShapeDtypeStruct((), jnp.float32),
                                   [jax.ShapeDtypeStruct(sh, jnp.bfloat16) for sh in shapes]]
        spec = FlatSpec.of([jax.ShapeDtypeStruct(sh, jnp.float32) for sh in shapes])
        offsets = tuple(off for _, off in spec.places)
        flat = jax.ShapeDtypeStruct((spec.buffers[0][1],), jnp.float32)
        grads = [jax.ShapeDtypeStruct(sh, jnp.bfloat16) for sh in shapes]

        def update(p, m, v, lr, *g):
            scalars = ops.step_scalars(learning_rate=lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, step=3)
            return fused_adamw_flat(p, list(g), m, v, offsets, scalars, [True, False] * 3,
                                    config=KernelConfig(interpret=False))
        return update, [flat, flat, flat, jax.ShapeDtypeStruct((), jnp.float32)] + grads
    raise SystemExit(f"unknown op {what!r}: mamba1, mamba3, conv, qk_norm, projection, adamw_flat or adamw_leaves")


# ----------------------------------------------------------------------------------------- compile
CLASSES = ("FFMA", "FMUL", "FADD", "FSETP", "FSEL", "FMNMX", "MUFU", "SHFL", "LDG", "STG", "LDS", "STS", "LDL",
           "STL", "BAR", "HMMA", "IMAD", "IADD3", "ISETP", "SEL", "MOV", "F2F", "PRMT", "LOP3", "SHF", "BRA")


def compile_dir(in_dir, fp_fusion=False, only=None, dump_sass=False):
    """Compiles every .ttir of in_dir for sm_90 and prints its registers, spills and SASS mix."""
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", 90, 32)
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for path in sorted(Path(in_dir).glob("*.ttir")):
        if only and only not in path.stem:
            continue
        meta = json.loads(path.with_suffix(".json").read_text())
        opts = dict(num_warps=meta["num_warps"], num_stages=meta["num_stages"], enable_fp_fusion=fp_fusion)
        try:
            k = triton.compile(str(path), target=target, options=opts)
        except Exception as e:   # noqa: BLE001 - report and go on with the other kernels
            print(f"## {path.stem}: compile failed: {str(e)[:400]}")
            continue
        cubin = path.with_suffix(".cubin")
        cubin.write_bytes(k.asm["cubin"])
        path.with_suffix(".ptx").write_text(k.asm["ptx"])
        sass = subprocess.run([str(bin_dir / "nvdisasm"), "-c", "-gi", str(cubin)], capture_output=True,
                              text=True).stdout
        path.with_suffix(".sass").write_text(sass)
        usage = subprocess.run([str(bin_dir / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                               text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        whole, loop = _mix(sass), _mix(_innermost_loop(sass))
        print(f"## {path.stem}  warps {meta['num_warps']}  registers {regs and regs.group(1)}  "
              f"stack {stack and stack.group(1)} B  shared {k.metadata.shared} B")
        print("| opcode | whole kernel | innermost loop |\n|---|---|---|")
        for c in CLASSES + ("other", "total"):
            if whole.get(c) or loop.get(c):
                print(f"| {c} | {whole.get(c, 0)} | {loop.get(c, 0)} |")
        if dump_sass:
            print(sass)


def _opcodes(sass):
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
        if m:
            yield m.group(1)


def _mix(sass):
    counts = collections.Counter()
    for op in _opcodes(sass):
        counts[op if op in CLASSES else "other"] += 1
        counts["total"] += 1
    return counts


def _innermost_loop(sass):
    """The SASS lines of the largest loop body: from a branch target to the backward BRA that returns
    to it (the loop over time steps)."""
    lines = sass.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"^\.(L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = i
    best = (0, 0)
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b.*`?\(?\.(L_x_\d+)\)?", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            start = labels[m.group(1)]
            if i - start > best[1] - best[0]:
                best = (start, i)
    return "\n".join(lines[best[0]:best[1] + 1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("what", choices=["mamba1", "mamba3", "conv", "qk_norm", "projection", "adamw_flat", "adamw_leaves"])
    c.add_argument("--out", required=True)
    c.add_argument("--scan-config", default=None)
    c.add_argument("--shape", default=None, help="comma-separated, e.g. 8,2048,1536,16 (mamba1)")
    c.add_argument("--per-head-angles", action="store_true", help="mamba3: angles per head (the op benchmark's)")
    k = sub.add_parser("compile")
    k.add_argument("dir")
    k.add_argument("--fp-fusion", action="store_true", help="let LLVM/ptxas form FMAs (Triton's default)")
    k.add_argument("--only", default=None, help="a substring of the kernel names to compile")
    k.add_argument("--sass", action="store_true", help="print the SASS too")
    a = p.parse_args(argv)
    if a.cmd == "capture":
        capture(a.what, a.out, a.scan_config, tuple(int(x) for x in a.shape.split(",")) if a.shape else None,
                a.per_head_angles)
    else:
        compile_dir(a.dir, a.fp_fusion, a.only, a.sass)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")
    main()
