import os
import sys

# The tests are compile-bound on the CPU (tiny shapes, hundreds of programs): LLVM's optimisation of
# XLA's CPU code costs more than it saves here (~25% of the suite's time). Set before JAX starts its
# backend; subprocess workers inherit it. Values change only by rounding, and every comparison in
# the suite is between runs under the same flags or against tolerances.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# One persistent compilation cache for the whole run, shared by the xdist workers and every subprocess
# a test starts (they inherit the environment): many tests compile the same programs (the main job's
# train step in each of its fresh processes, the same interpreted kernels at the same shapes in several
# files), and a hit replaces a CPU compile by a read. The controller makes a fresh directory per run
# (removed at the end), so nothing carries over between runs; a JAX_COMPILATION_CACHE_DIR of your own
# is used as it is. A nonzero size limit turns on jax's file lock around every read and write (safe
# across processes). A hit is the executable a compile would have produced: no numerics change.
import tempfile  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jmamba-test-jax-cache-")
    os.environ["JMAMBA_TEST_OWNS_JAX_CACHE"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))

import jax  # noqa: E402
import pytest  # noqa: E402

# numpy references and helpers live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

# A worker that dies mid-test (a native crash, a pytest-timeout kill) costs one re-run of that test,
# not a hung session: see tests/xdist_recovery.py.
from xdist_recovery import (pytest_handlecrashitem, pytest_report_teststatus,  # noqa: E402,F401
                            pytest_terminal_summary)
import xdist_recovery  # noqa: E402

# The slowest test files, slowest first (seconds on 2 CPU cores, from `--durations=0`). Under
# `pytest -n auto --dist loadfile` (`make test`) they are handed out first, so no long file starts
# last and leaves the other workers idle (xdist's own order is by the number of tests in a file,
# which puts the few-test subprocess files, the slowest of all, at the end).
# test_properties.py leads for another reason: its hypothesis cases compile hundreds of small eager
# programs, and all three of session 28's native crashes inside XLA's CPU compile (a segfault, re-run
# by xdist_recovery) hit it at ~89% of the run, in a worker that had compiled for ~13 minutes; the file
# alone never crashed in 40 runs. Run early, it meets a young worker (a mitigation, not a fix).
SLOW_FILES_FIRST = (
    "test_properties.py",           # ~30 s; see above
    "test_sequence_parallel.py",    # ~190 s: one subprocess with 4 simulated devices
    "test_mamba3_scan_pallas.py",   # ~200 s: the Pallas interpreter
    "test_data_parallel.py",        # ~110 s: one subprocess with 4 simulated devices
    "test_training_system.py",      # ~120 s
    "test_checkpoint.py",           # ~85 s: subprocesses
    "test_lm_generate.py",          # ~55 s: the main job
    "test_multiprocess.py",         # ~30 s: three processes under jax.distributed
    "test_mamba1_mixer_core.py",    # ~85 s: the Pallas interpreter (scan + conv kernels)
    "test_selective_scan_mosaic.py",   # ~85 s: the Mosaic GPU interpreter and CUDA lowerings
    "test_mamba1_backbone.py",
    "test_benchmarks_smoke.py",
    "test_examples.py",
    "test_mamba3_backbone.py",
    "test_selective_scan_pallas.py",
    "test_causal_conv_pallas.py",   # ~45 s: the Pallas interpreter
    "test_selective_scan.py",       # ~30 s
)


def pytest_configure(config):
    # The tests use the current API: a DeprecationWarning raised for a call in a test module or a
    # shared test helper is an error. Tests of the old spellings catch theirs with pytest.warns.
    for module in ("test_", "builders", "helpers"):
        config.addinivalue_line("filterwarnings", f"error::DeprecationWarning:{module}")
    if hasattr(config.option, "loadscopereorder"):   # pytest-xdist: keep the order set below
        config.option.loadscopereorder = False
    xdist_recovery.install(config)


def pytest_unconfigure(config):
    """Removes the run's compilation cache (in the process that made it: the controller)."""
    if os.environ.get("JMAMBA_TEST_OWNS_JAX_CACHE") == str(os.getpid()):
        import shutil
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Slow files first (see SLOW_FILES_FIRST); `@pytest.mark.gpu` tests need a CUDA GPU: they are
    skipped (and reported as skipped) elsewhere."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))   # stable
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python3 -m pytest -m gpu tests` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
