"""The sequence-parallel train step under `jax.distributed`: 2 processes on localhost with 2 CPU
devices each (a data x seq mesh over all 4) give the one-process, one-device result.

The worker (`multiprocess_worker.py`) trains a tiny Mamba-1 LM for three chained windows; each
process feeds only its own rows of the global batch (`jax.make_array_from_process_local_data`).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_equal_one_process(tmp_path):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, WORKER, str(tmp_path), str(i), "2", port],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    single = subprocess.run([sys.executable, WORKER, str(tmp_path), "single"], capture_output=True, text=True,
                            timeout=600)
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    assert single.returncode == 0, single.stderr[-3000:]
    ref = np.load(tmp_path / "result_single.npz")
    for i in range(2):
        got = np.load(tmp_path / f"result_{i}.npz")
        np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-6)
        for k in ref.files:
            if k != "losses":   # parameters after 3 AdamW steps and the recurrent state: to rounding
                scale = max(float(np.max(np.abs(ref[k]))), 1e-30)
                assert float(np.max(np.abs(got[k] - ref[k]))) / scale <= 1e-4, k
