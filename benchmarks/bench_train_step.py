"""End-to-end training-step benchmark: a 130m-class Mamba LM, tokens/s per scan implementation.

    python benchmarks/bench_train_step.py                              # H200: Mamba-1 130m-class, bf16
    python benchmarks/bench_train_step.py --arch mamba3
    python benchmarks/bench_train_step.py --tiny                       # CPU smoke run (seconds)

One jitted step (forward, cross entropy over the vocabulary, backward, global-norm clip, AdamW) per
call, the recurrent state carried; the scan implementation is switched with
`jmamba.ops.dispatch.prefer` (the model is the same object). Reports the median ms/step of
`--steps` timed steps after `--warmup` (compile) steps, tokens/s, model TFLOP/s by 6·N·tokens (N =
parameters), and the peak device memory. The PyTorch anchors of earlier runs (docs/performance.md §5) are printed beside.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmamba
from jmamba.ops import dispatch

# ms/step, tokens/s of PyTorch + mamba_ssm on the H200 (Mamba-1 on the official fused path with causal-conv1d;
# earlier runs, docs/performance.md §5). A claim against them is re-measured with the anchors in the same call.
PYTORCH_ANCHOR = {"mamba1": (98.7, 166.0e3), "mamba3": (114.8, 142.8e3)}
REMAT = {"none": None, "layer": "layer", "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
OP = {"mamba1": "selective_scan", "mamba3": "mamba3_siso_scan"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["mamba1", "mamba3"], default="mamba1")
    p.add_argument("--impl", default="pallas,xla", help="comma-separated scan implementations to compare")
    p.add_argument("--precision", default="bf16", choices=["f32", "bf16", "f16"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "fused"])
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--n-layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=50280)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--remat", default="none", choices=sorted(REMAT),
                   help="activation memory: none, layer (recompute each block), dots (keep matmul outputs)")
    p.add_argument("--no-guard", action="store_true", help="build the step with nonfinite_guard=False")
    p.add_argument("--scan-config", default=None, metavar="K=V,...",
                   help="the Pallas scan config of --arch as fields of ScanBlockConfig (mamba1, e.g. "
                        "fwd_mosaic=True,chunk=64) or Mamba3ScanConfig (mamba3, e.g. stored_scores=True)")
    p.add_argument("--mixer-residuals", default=None, choices=["inputs", "activations"],
                   help="mamba1: what the fused mixer core keeps for its backward (SelectiveScanTuning."
                        "mixer_residuals: recompute u, delta, B, C from the inputs, or keep them; default: "
                        "the library's)")
    p.add_argument("--conv-config", default=None, metavar="K=V,...",
                   help="mamba1: the mixer core's conv kernels' ConvBlockConfig fields (e.g. "
                        "fast_math=True,fused_multiply_add=True)")
    p.add_argument("--prefer", default=None, metavar="OP=IMPL,...",
                   help="dispatch.prefer per op, e.g. log_sum_exp=pallas (the cross entropy's normalizer), "
                        "add_rms_norm=xla (the composition instead of the kernels), split_dense=reference "
                        "(Mamba-3's in_proj backward summing dx behind the barrier)")
    p.add_argument("--xla-options", default=None, metavar="NAME=VALUE,...",
                   help="make_train_step(compiler_options=...): XLA options for the step's compilation only, "
                        "e.g. xla_gpu_triton_gemm_any=false (true / false / ints / floats parsed, else str)")
    p.add_argument("--norm-config", default=None, metavar="K=V,...",
                   help="the add + RMSNorm kernels' NormBlockConfig fields (e.g. block_rows=16,num_warps=8)")
    p.add_argument("--steady", type=int, default=0, metavar="K",
                   help="also time K steps dispatched back to back, one block_until_ready at the end (a training "
                        "loop that does not read metrics every step: dispatch overlaps the previous step)")
    p.add_argument("--devices", type=int, default=1,
                   help="this many devices: data parallel over devices / seq-shards of them (global batch = "
                        "batch-size x that), each sequence over --seq-shards")
    p.add_argument("--seq-shards", type=int, default=1,
                   help="sequence parallel: split each sequence's time axis over this many devices (a seq mesh axis)")
    p.add_argument("--flat", action=argparse.BooleanOptionalAction, default=None,
                   help="TrainState.create(..., flat=True): params and optimizer state in one flat buffer per dtype "
                        "(default: on with one device and no mesh, where it measured 4-6 ms/step faster on an H100, "
                        "session 33; --no-flat: the plain tree)")
    p.add_argument("--fsdp", action="store_true", help="with --devices > 1: shard parameters and optimizer state over data")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON to PATH")
    p.add_argument("--gc-freeze", action="store_true",
                   help="after the warm-up, gc.collect() then gc.freeze(): Python's full (generation-2) collections "
                        "stop rescanning the ~10^5 objects compilation leaves behind (their pauses, ~0.1-0.2 s on "
                        "the H200 host, otherwise land inside the timed steps)")
    p.add_argument("--profile-back-to-back", action="store_true",
                   help="with --profile: trace the N steps with one sync at the end (the --steady conditions)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, trace N more steps and print per-kernel and per-category device times")
    p.add_argument("--xla-dump", default=None, metavar="DIR",
                   help="dump XLA's optimized HLO here (maps the profile's fusion names to their ops)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke run")
    args = p.parse_args(argv)
    if args.xla_dump:   # read when the backend compiles the first program
        import os
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={args.xla_dump}"
                                   " --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$").strip()
    if args.flat is None:
        args.flat = args.devices == 1 and args.seq_shards == 1
    if args.flat and (args.devices > 1 or args.seq_shards > 1):
        p.error("--flat needs one device and no mesh (--devices 1 --seq-shards 1)")
    if args.tiny:
        args.d_model, args.n_layers, args.vocab, args.batch_size, args.seq_len = 64, 2, 256, 2, 64
        args.steps, args.warmup = 3, 1
        if jax.default_backend() == "cpu":
            args.impl, args.precision = "xla", "f32"
    return args


def build(args):
    if args.arch == "mamba1":
        cfg = jmamba.Mamba1Config(d_model=args.d_model, n_layers=args.n_layers)
    else:
        cfg = jmamba.Mamba3Config(d_model=args.d_model, n_layers=args.n_layers,
                                  **({"d_state": 16, "headdim": 16} if args.tiny else {}))
    return jmamba.MambaLM(cfg, args.vocab, rngs=nnx.Rngs(0))


@contextlib.contextmanager
def scan_tuning(args):
    """The Mamba-3 scan's chunk (a tuning knob of the op; the official 64, 16 for the tiny run), the
    Mamba-1 mixer core's residuals (--mixer-residuals) and, with --scan-config, the Pallas config of the
    --arch scan (ScanBlockConfig or Mamba3ScanConfig); --prefer OP=IMPL per op, --norm-config for add_rms_norm's kernels."""
    config = None
    if args.scan_config:   # needs the repo root on sys.path (PYTHONPATH=$PWD, as gpu_session.sh sets)
        from benchmarks.measure import scan_config
        config = scan_config(args.scan_config, args.arch)
    with contextlib.ExitStack() as stack:
        stack.enter_context(jmamba.ops.tuning("mamba3_siso_scan", chunk_size=16 if args.tiny else 64,
                                              **({"pallas_config": config} if config and args.arch == "mamba3" else {})))
        if args.arch == "mamba1":
            conv = None
            if args.conv_config:
                from benchmarks.measure import scan_config
                conv = scan_config(args.conv_config, "conv")
            fields = {"pallas_config": config, "conv_config": conv, "mixer_residuals": args.mixer_residuals}
            stack.enter_context(jmamba.ops.tuning("selective_scan",
                                                  **{k: v for k, v in fields.items() if v is not None}))
        for pair in (args.prefer.split(",") if args.prefer else []):
            op, impl = pair.split("=")
            stack.enter_context(dispatch.prefer(op, impl))
        if args.norm_config:
            from benchmarks.measure import scan_config
            stack.enter_context(jmamba.ops.tuning("add_rms_norm", pallas_config=scan_config(args.norm_config, "norm")))
        yield


def make_optimizer(args):
    if args.optimizer == "fused":
        from jmamba.optim import fused_adamw
        return fused_adamw(1e-4, weight_decay=0.1)
    return optax.adamw(1e-4, weight_decay=0.1)


def loss_fn(logits, batch):
    return jmamba.next_token_loss(logits, batch)


class gc_pauses:
    """Context manager recording Python's full (generation-2) garbage collections inside it: their pauses
    run on the thread that dispatches the steps, so the device idles during them when it has caught up."""

    def __init__(self):
        self.pauses, self._start = [], None

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase, info):
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.pauses.append(time.perf_counter() - self._start)

    def report(self, impl, steps):
        total = 1e3 * sum(self.pauses)
        print(f"# {impl}: {len(self.pauses)} full GC pauses during the {steps} timed steps, {total:.1f} ms in all"
              + (f" (longest {1e3 * max(self.pauses):.1f} ms)" if self.pauses else ""), flush=True)


def profile_steps(step, state, batches, n, back_to_back=False):
    """Traces n steps (state threaded through) and prints the per-kernel and per-category device times
    per step (benchmarks/profile_kernels.py); returns the last state. back_to_back: one sync after the
    n steps (the host runs ahead, as in --steady) instead of one per step."""
    from benchmarks.profile_kernels import gap_report, host_during_gaps, report, report_categories, traced_kernel_times
    box = [state]

    def run():
        for i in range(n):
            box[0], m = step(box[0], batches[i % 2])
            if not back_to_back or i == n - 1:
                jax.block_until_ready((box[0], m))
    intervals, host = [], []
    totals, wall = traced_kernel_times(run, intervals, host)
    how = "back to back, one sync" if back_to_back else "each synced"
    print(f"\n# per-kernel device time per step ({n} traced steps, {how}, wall {wall / n * 1e3:.1f} ms/step traced)")
    report_categories(totals, n)
    print()
    report(totals, n, top=40)
    gap_report(intervals, n)
    host_during_gaps(intervals, host, n, min_gap_us=1000)
    return box[0]


def bench_one(args, lm, impl):
    opt = make_optimizer(args)
    rng = np.random.default_rng(0)
    bsz = args.batch_size * data_ways(args)
    mesh = None
    if args.devices > 1 or args.seq_shards > 1:
        from jmamba.parallel import make_mesh
        mesh = make_mesh(data=data_ways(args), seq=args.seq_shards, devices=jax.devices()[:args.devices])
    with dispatch.prefer(OP[args.arch], impl), scan_tuning(args):
        state = jmamba.TrainState.create(lm, opt, bsz, precision=args.precision, flat=args.flat)
        if mesh is not None:
            from jmamba.parallel import shard_state
            state = shard_state(state, mesh, fsdp=args.fsdp)
        step = jmamba.make_train_step(lm, opt, loss_fn=loss_fn, precision=args.precision, clip_max_norm=1.0,
                                      mesh=mesh, fsdp=args.fsdp, remat=REMAT[args.remat],
                                      nonfinite_guard=not args.no_guard,
                                      compiler_options=parse_xla_options(args.xla_options))
        batches = [{"inputs": jnp.asarray(rng.integers(0, args.vocab, (bsz, args.seq_len)), jnp.int32),
                    "targets": jnp.asarray(rng.integers(0, args.vocab, (bsz, args.seq_len)), jnp.int32)}
                   for _ in range(2)]
        t0 = time.perf_counter()
        for i in range(args.warmup):
            state, m = step(state, batches[i % 2])
        jax.block_until_ready(state)
        compile_s = time.perf_counter() - t0
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        with gc_pauses() as pauses:
            times = []
            for i in range(args.steps):
                t = time.perf_counter()
                state, m = step(state, batches[i % 2])
                jax.block_until_ready((state, m))
                times.append(time.perf_counter() - t)
            # Synced on the metrics alone: the outputs of one executable become ready together, so this
            # also waits for the whole step, without the host walking the state's ~800 buffers.
            loss_synced = []
            for i in range(args.steps):
                t = time.perf_counter()
                state, m = step(state, batches[i % 2])
                jax.block_until_ready(m)
                loss_synced.append(time.perf_counter() - t)
            print(f"# {impl}: synced on the metrics only: {1e3 * statistics.median(loss_synced):.1f} ms/step "
                  f"(median of {args.steps}, {1e3 * min(loss_synced):.1f}-{1e3 * max(loss_synced):.1f})", flush=True)
            steady_ms = None
            if args.steady:
                t = time.perf_counter()
                for i in range(args.steady):
                    state, m = step(state, batches[i % 2])
                jax.block_until_ready((state, m))
                steady_ms = 1e3 * (time.perf_counter() - t) / args.steady
                print(f"# {impl}: {args.steady} steps back to back (one sync): {steady_ms:.1f} ms/step", flush=True)
        pauses.report(impl, 2 * args.steps + (args.steady or 0))
        if args.profile:
            state = profile_steps(step, state, batches, args.profile, back_to_back=args.profile_back_to_back)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.devices()[:args.devices]]
    stats = {"peak_bytes_in_use": max(peaks)}   # the fullest device's peak
    return {"impl": impl, "ms": 1e3 * statistics.median(times), "min": 1e3 * min(times), "max": 1e3 * max(times),
            "compile_s": compile_s, "loss": float(m["loss"]), "steady_ms": steady_ms, "peak_gib": stats.get("peak_bytes_in_use", 0) / 2 ** 30,
            "seconds": {"step": statistics.median(times), "compile": compile_s}}


def data_ways(args):
    """Size of the data axis: the devices not used by the sequence split."""
    if args.devices % args.seq_shards:
        raise SystemExit(f"--seq-shards {args.seq_shards} must divide --devices {args.devices}")
    return args.devices // args.seq_shards


def parse_xla_options(text):
    """--xla-options "name=value,..." -> {name: bool | int | float | str}, or None."""
    if not text:
        return None
    from benchmarks.measure import key_values
    return key_values(text, "--xla-options")


def main(argv=None):
    """Runs the benchmark (argv as on the command line); returns one row per implementation that ran,
    each with `seconds` ({"step": median, "compile": warm-up}) and the loss after the last step."""
    args = parse_args(argv)
    lm = build(args)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(lm, nnx.Param)))
    tokens = args.batch_size * data_ways(args) * args.seq_len
    print(f"# train step: {args.arch} d_model={args.d_model} layers={args.n_layers} vocab={args.vocab} "
          f"params={n_params / 1e6:.1f}M B={args.batch_size}x{data_ways(args)} T={args.seq_len} "
          f"devices={args.devices} (seq shards {args.seq_shards}{', fsdp' if args.fsdp else ''}) {args.precision} "
          f"optimizer={args.optimizer}{' flat state' if args.flat else ''} remat={args.remat} guard={not args.no_guard} | jax {jax.__version__} on {jax.devices()[0].device_kind}")
    rows = []
    for impl in args.impl.split(","):
        try:
            rows.append(bench_one(args, lm, impl))
        except Exception as e:   # one implementation failing must not hide the others' numbers
            print(f"{impl}: FAILED: {type(e).__name__}: {str(e)[:300]}")
    ref_ms, ref_tok = PYTORCH_ANCHOR[args.arch]
    print("\n| implementation | ms/step (median, min-max) | tokens/s | vs PyTorch | TFLOP/s (6·N·tok) | peak GiB | compile s | loss |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tok_s = tokens / (r["ms"] / 1e3)
        tflops = 6 * n_params * tokens / (r["ms"] / 1e3) / 1e12
        print(f"| {r['impl']} | {r['ms']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | {tok_s:,.0f} | "
              f"{tok_s / ref_tok:.2f}x | {tflops:.0f} | {r['peak_gib']:.1f} | {r['compile_s']:.0f} | {r['loss']:.3f} |")
    print(f"| PyTorch + official kernels (earlier-run anchor) | {ref_ms} | {ref_tok:,.0f} | 1.00x | | | | |")
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump([dict(r, tokens_per_s=tokens / (r["ms"] / 1e3), n_params=int(n_params),
                            devices=args.devices, seq_shards=args.seq_shards, fsdp=args.fsdp) for r in rows], f)
    return rows


if __name__ == "__main__":
    main()
