"""Multi-GPU scaling of the train step: data parallel, FSDP and sequence parallel (issue 18).

    python3 benchmarks/bench_scaling.py                     # every mode x model on 1, 2, 4, 8 GPUs (as many as exist)
    python3 benchmarks/bench_scaling.py --modes seq --models mamba1_130m --seq-lens 65536,262144
    python3 benchmarks/bench_scaling.py --tiny              # CPU smoke run on 4 simulated devices

Each configuration runs `benchmarks/bench_train_step.py` in its own process (so each peak-memory
figure is that run's alone), pallas scans, bf16, fused AdamW. Modes:
  dp    global batch = per-device batch x devices, parameters replicated;
  fsdp  the same, parameters and optimizer state sharded over `data`;
  seq   one sequence (batch 1 per data row) split over all devices (a `seq` mesh axis).
Scaling efficiency = tokens/s on N devices / (N x tokens/s on 1 device) for dp / fsdp (weak scaling
at a fixed per-device batch); for seq, the one-device row is the same T where it fits, and the
losses after the same steps from the same init are printed beside it (they must agree to rounding).
Gradient equality with one device is checked by the test workers on the same machine:
`python3 tests/data_parallel_worker.py OUT.json` and `python3 tests/sequence_parallel_worker.py OUT.json`
(4 devices each; they include the f16 loss scaler's decisions on every device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MODELS = {"mamba1_130m": ["--arch", "mamba1", "--d-model", "768", "--n-layers", "24"],
          "mamba3_130m": ["--arch", "mamba3", "--d-model", "768", "--n-layers", "24"],
          "mamba1_1.4b": ["--arch", "mamba1", "--d-model", "2048", "--n-layers", "48"]}
HERE = os.path.dirname(os.path.abspath(__file__))


def run(model_args, mode, n, seq_len, batch, extra, timeout):
    """One bench_train_step run in a fresh process; its JSON row, or {"error": ...}."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    argv = [sys.executable, os.path.join(HERE, "bench_train_step.py"), *model_args, "--impl", "pallas",
            "--optimizer", "fused", "--steps", "5", "--warmup", "2", "--devices", str(n),
            "--batch-size", str(batch), "--seq-len", str(seq_len), "--json", out, *extra]
    if mode == "fsdp" and n > 1:
        argv.append("--fsdp")
    if mode == "seq":
        argv += ["--seq-shards", str(n)]
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    rows = json.load(open(out)) if os.path.getsize(out) else []
    if res.returncode or not rows:
        return {"error": (res.stderr or res.stdout)[-300:].replace("\n", " ")}
    return rows[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="dp,fsdp,seq")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--devices", default="1,2,4,8", help="device counts (those above the machine's are skipped)")
    p.add_argument("--batch-size", type=int, default=8, help="per-device batch of dp / fsdp")
    p.add_argument("--seq-len", type=int, default=2048, help="T of dp / fsdp")
    p.add_argument("--seq-lens", default="65536,262144", help="T of the seq mode")
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 4 simulated devices")
    a = p.parse_args(argv)
    extra = []
    if a.tiny:
        os.environ["JAX_NUM_CPU_DEVICES"] = "4"
        extra = ["--tiny"]
        a.models, a.devices, a.seq_lens, a.batch_size, a.seq_len = "mamba1_130m", "2", "64", 2, 64
    import jax
    have = len(jax.devices()) if not a.tiny else 4
    counts = [n for n in map(int, a.devices.split(",")) if n <= have]
    print(f"# scaling: {have} devices ({jax.devices()[0].device_kind}), counts {counts}", flush=True)
    print("\n| model | mode | T | devices | ms/step | tokens/s | efficiency | peak GiB per device | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for model in a.models.split(","):
        for mode in a.modes.split(","):
            for T in ([a.seq_len] if mode != "seq" else list(map(int, a.seq_lens.split(",")))):
                base = None
                for n in counts:
                    batch = a.batch_size if mode != "seq" else 1
                    r = run(MODELS[model], mode, n, T, batch, extra, a.timeout)
                    if "error" in r:
                        print(f"| {model} | {mode} | {T} | {n} | failed: {r['error']} | | | | |", flush=True)
                        continue
                    base = base or (n, r["tokens_per_s"])
                    eff = r["tokens_per_s"] / (base[1] * n / base[0])
                    print(f"| {model} | {mode} | {T} | {n} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                          f"{eff:.0%} | {r['peak_gib']:.1f} | {r['loss']:.5f} |", flush=True)
                    rows.append({"config": f"{model} {mode} T{T} x{n}", "mode": mode, "devices": n,
                                 "efficiency": eff, "loss": r["loss"], "seconds": {"step": r["ms"] / 1e3}})
    return rows


if __name__ == "__main__":
    main()
