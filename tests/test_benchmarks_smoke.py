"""Every benchmark script runs at tiny shapes on the CPU (`--tiny`), so none of them can rot: its
`main(["--tiny"])` returns rows, and every variant the script compares produced finite positive times."""

import glob
import importlib.util
import math
import os

import pytest

HERE = os.path.dirname(__file__)
SCRIPTS = sorted(glob.glob(os.path.join(HERE, "..", "benchmarks", "bench_*.py"))
                 + glob.glob(os.path.join(HERE, "..", "benchmarks", "profile_*.py"))
                 + glob.glob(os.path.join(HERE, "..", "benchmarks", "soak_*.py")))
# what each script's tiny run must have timed: {row key: values that must all appear}
EXPECTED = {
    "bench_causal_conv.py": ("variant", {"xla", "pallas t32 e64 w1 fast fma"}),
    "bench_dispatch.py": ("variant", {"fwd+bwd, cotangent closed over", "trivial: one scalar add"}),
    "bench_decode.py": ("impl", {"jmamba", "jmamba-stream"}),
    "bench_fused_adamw.py": ("variant", {"optax.adamw", "fused xla"}),
    "bench_host_dispatch.py": ("state", {"TrainState.create", "nnx trees"}),
    "bench_mamba1_mixer.py": ("variant", {"fused-pallas", "unfused", "xla"}),
    "bench_mamba3_scan.py": ("impl", {"pallas", "xla", "reference"}),
    "bench_mamba3_projection.py": ("variant", {"xla ops", "qk_norm kernels", "projection kernels"}),
    "bench_rms_norm.py": ("variant", {"xla", "pallas r8 w4"}),
    "bench_mosaic_forward.py": ("variant", {"triton", "mosaic c16"}),
    "bench_scaling.py": ("mode", {"dp", "fsdp", "seq"}),
    "bench_split_dense.py": ("variant", {"reference, default options", "xla, triton_gemm_any off"}),
    "bench_selective_scan.py": ("impl", {"pallas", "xla", "assoc", "reference"}),
    "bench_sequence_parallel.py": ("path", {"plain", "seq axis, 1 shard"}),
    "bench_train_step.py": ("impl", {"xla"}),
    "profile_kernels.py": ("kernel", {"wall"}),     # no device events off the GPU
    "soak_f16.py": ("nonfinite_weights_or_state", {"False"}),   # the guard held through the injected faults
}


def test_every_script_is_covered():
    assert sorted(os.path.basename(p) for p in SCRIPTS) == sorted(EXPECTED)


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_benchmark_runs_tiny(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.main(["--tiny"])
    assert isinstance(rows, list) and rows, "main(['--tiny']) must return the rows it measured"
    key, want = EXPECTED[os.path.basename(path)]
    names = {str(r[key]).split(" (")[0] for r in rows}
    assert want <= names, f"missing rows: {sorted(want - names)} (got {sorted(names)})"
    for r in rows:
        assert r["seconds"], r
        for what, t in r["seconds"].items():
            assert isinstance(t, float) and math.isfinite(t) and t > 0, f"{r[key]} {what}: {t!r}"


def _load(name):
    path = os.path.join(HERE, "..", "benchmarks", name)
    spec = importlib.util.spec_from_file_location(name[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_kernels_runs_the_mamba1_scan_tiny():
    rows = _load("profile_kernels.py").main(["mamba1", "--tiny"])
    wall = [r for r in rows if r["kernel"] == "wall"]
    assert wall and math.isfinite(wall[0]["seconds"]["per call"]) and wall[0]["seconds"]["per call"] > 0


def test_triton_inspect_captures_every_mamba1_kernel(tmp_path):
    """The capture half (jax's lowering for an abstract H200); the compile half needs Triton 3.6."""
    _load("triton_inspect.py").capture("mamba1", tmp_path, "fast_math=True", (1, 64, 64, 16))
    names = sorted(p.stem for p in tmp_path.glob("*.ttir"))
    assert names == sorted(["selective_scan_fwd_chunk_summaries", "selective_scan_fwd_chunk_combine",
                            "selective_scan_fwd_chunk_outputs", "selective_scan_bwd_adjoint_summaries",
                            "selective_scan_adjoint_chunk_combine", "selective_scan_bwd_chunk_gradients"])
    text = (tmp_path / "selective_scan_bwd_chunk_gradients.ttir").read_text()
    assert "tt.func" in text and "fma.rn.f32" in text     # the inline-assembly fma reached the kernel


def test_glue_inventory_counts_the_kernels_and_the_ops_around_them():
    path = os.path.join(HERE, "..", "benchmarks", "glue_inventory.py")
    spec = importlib.util.spec_from_file_location("glue_inventory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main(["mamba1", "--batch-size", "1", "--seq-len", "32", "--min-elements", "64"])
    assert len(out["kernels"]) == 8 and "selective_scan_bwd_chunk_gradients" in out["kernels"]
    assert out["others"].get("dot_general", 0) >= 4
