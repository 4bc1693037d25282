"""Decode throughput: `jmamba.generate` on a 130m-class LM, beside transformers' `MambaForCausalLM.generate`.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_decode.py   # H200: Mamba-1 130m, bf16, B 1 and 64
    python benchmarks/bench_decode.py --arch mamba3            # Mamba-3 SISO (d_state 128, headdim 64)
    python benchmarks/bench_decode.py --tiny                   # CPU smoke run (seconds)

Greedy, random weights (d_model 768, 24 layers, vocab 50280), a 16-token prompt of random ids and
256 new tokens per row. One timed call = one whole `generate` (the prefill of the prompt included,
as in transformers' `generate`); tokens/s = batch · new tokens / the median of `--iters` timed calls
after `--warmup` calls (which compile; their time is reported as `first_s`). Implementations:

  jmamba          the fused program: prefill + `lax.scan` decode loop in one `jax.jit`
  jmamba-stream   `stream=` given: one jitted step per token from a host loop (the callback path)
  transformers    `MambaForCausalLM(config).to(torch.bfloat16).generate(do_sample=False, use_cache=True)`
                  on the same device in the same process, when torch and transformers import
                  (Mamba-1 only; its CUDA fast path needs the mamba-ssm and causal-conv1d packages,
                  the row says whether it was available)

`main(argv)` returns the result rows (dicts with `tokens_per_s`); `--json FILE` writes them too.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jmamba


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--arch", choices=["mamba1", "mamba3"], default="mamba1", help="backbone")
    p.add_argument("--impls", default="jmamba,jmamba-stream,transformers",
                   help="comma-separated: jmamba, jmamba-stream, transformers")
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per row")
    p.add_argument("--new-tokens", type=int, default=256, help="generated tokens per row")
    p.add_argument("--precision", default="bf16", choices=["f32", "bf16", "f16"], help="compute precision")
    p.add_argument("--d-model", type=int, default=768, help="model width")
    p.add_argument("--n-layers", type=int, default=24, help="residual blocks")
    p.add_argument("--vocab", type=int, default=50280, help="vocabulary size")
    p.add_argument("--iters", type=int, default=5, help="timed generate calls per row")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (compilation)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--tiny", action="store_true", help="tiny shapes for a CPU smoke run")
    args = p.parse_args(argv)
    if args.tiny:
        args.d_model, args.n_layers, args.vocab = 32, 2, 64
        args.batch_sizes, args.prompt_len, args.new_tokens, args.iters = "1,4", 4, 8, 2
        if jax.default_backend() == "cpu":
            args.precision = "f32"
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.impls = args.impls.split(",")
    bad = set(args.impls) - {"jmamba", "jmamba-stream", "transformers"}
    if bad:
        p.error(f"argument --impls: unknown {sorted(bad)}")
    return args


def build(args):
    if args.arch == "mamba1":
        cfg = jmamba.Mamba1Config(d_model=args.d_model, n_layers=args.n_layers)
    else:
        small = {"d_state": 16, "headdim": 16} if args.tiny else {"d_state": 128, "headdim": 64}
        cfg = jmamba.Mamba3Config(d_model=args.d_model, n_layers=args.n_layers, **small)
    return jmamba.MambaLM(cfg, args.vocab, rngs=nnx.Rngs(0))


def _time(fn, iters, warmup):
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return first, times


def bench_jmamba(args, lm, bsz, stream):
    prompt = jnp.asarray(np.random.default_rng(bsz).integers(0, args.vocab, (bsz, args.prompt_len)), jnp.int32)
    cb = (lambda i, tok, done: None) if stream else None

    def run():
        return jax.block_until_ready(jmamba.generate(lm, prompt, args.new_tokens, precision=args.precision,
                                                     stream=cb))

    first, times = _time(run, args.iters, args.warmup)
    return _row(args, "jmamba-stream" if stream else "jmamba", bsz, first, times)


def bench_transformers(args, bsz):
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"# transformers: skipped ({e})")
        return None
    if args.arch != "mamba1":
        print("# transformers: skipped (MambaForCausalLM is Mamba-1 only)")
        return None
    from transformers.models.mamba import modeling_mamba
    device = "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.precision]
    cfg = transformers.MambaConfig(vocab_size=args.vocab, hidden_size=args.d_model, num_hidden_layers=args.n_layers,
                                   state_size=16, expand=2, conv_kernel=4, pad_token_id=0, eos_token_id=0,
                                   bos_token_id=0, use_cache=True)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    ids = torch.as_tensor(np.random.default_rng(bsz).integers(0, args.vocab, (bsz, args.prompt_len)), device=device)
    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                 min_new_tokens=args.new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape == (bsz, args.prompt_len + args.new_tokens), out.shape

    first, times = _time(run, args.iters, args.warmup)
    row = _row(args, "transformers", bsz, first, times)
    row.update(device=device, torch=torch.__version__, transformers=transformers.__version__,
               fast_path=bool(getattr(modeling_mamba, "is_fast_path_available", False)))
    return row


def _row(args, impl, bsz, first, times):
    med = statistics.median(times)
    return {"impl": impl, "arch": args.arch, "batch": bsz, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "precision": args.precision, "first_s": first,
            "median_s": med, "min_s": min(times), "max_s": max(times),
            "tokens_per_s": bsz * args.new_tokens / med, "ms_per_step": 1e3 * med / args.new_tokens,
            "seconds": {"call": med, "first_call": first}}


def main(argv=None):
    args = parse_args(argv)
    lm = build(args)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(lm, nnx.Param)))
    print(f"# decode: {args.arch} d_model={args.d_model} layers={args.n_layers} vocab={args.vocab} "
          f"params={n_params / 1e6:.1f}M prompt={args.prompt_len} new={args.new_tokens} {args.precision} greedy | "
          f"jax {jax.__version__} on {jax.devices()[0].device_kind}")
    rows = []
    for bsz in args.batch_sizes:
        for impl in args.impls:
            row = (bench_transformers(args, bsz) if impl == "transformers"
                   else bench_jmamba(args, lm, bsz, stream=impl == "jmamba-stream"))
            if row is None:
                continue
            rows.append(row)
            extra = f" fast_path={row['fast_path']} ({row['device']})" if impl == "transformers" else ""
            print(f"B={bsz:<3d} {impl:14s} {row['tokens_per_s']:12,.0f} tokens/s  {row['ms_per_step']:.3f} ms/step  "
                  f"median {row['median_s'] * 1e3:.1f} ms ({row['min_s'] * 1e3:.1f}–{row['max_s'] * 1e3:.1f})  "
                  f"first call {row['first_s']:.1f} s{extra}")
    for r in rows:
        assert r["tokens_per_s"] > 0 and math.isfinite(r["tokens_per_s"]), r
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
