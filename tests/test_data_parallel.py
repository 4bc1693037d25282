"""Data-parallel training on 4 simulated CPU devices equals the single-device run on the same batch.

The cases run in a subprocess (`data_parallel_worker.py`) because the device count must be set before
JAX starts. Gradients are compared through an optimizer that stores the gradient it receives, so the
check is on what the all-reduce produced (f32, 1e-6 relative); Adam amplifies reduction-order
rounding of near-zero gradients, so parameters after three Adam steps get a looser bound.
"""

from __future__ import annotations

import pytest
from builders import worker_results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return worker_results("data_parallel_worker.py", tmp_path_factory.mktemp("dp"))


@pytest.mark.parametrize("case", ["mamba1", "mamba1_fsdp", "mamba3"])
def test_sharded_train_step_equals_single_device(results, case):
    r = results[case]
    assert r["grads"] <= 2e-6, r     # f32 reduction-order rounding of the gradient all-reduce
    assert r["params"] <= 2e-5 and r["opt_state"] <= 1e-5 and r["recurrent"] <= 1e-6, r
    assert r["step_equal"]
    assert r["recurrent_spec"] == "P('data',)"
    assert r["param_spec"] == ("P('data', None)" if case.endswith("fsdp") else "P()")


def test_loss_scaler_decisions_are_identical(results):
    r = results["f16_scaler"]
    assert r["single"] == r["multi"]
    assert {skipped for skipped, _ in r["single"]} == {True, False}, "the run must contain both kinds of step"


def test_sharded_split_api_equals_single_device(results):
    assert results["split"]["params"] <= 2e-5


def test_sharded_checkpoint_round_trip_keeps_shardings(results):
    assert results["checkpoint"] == {"equal": True, "same_sharding": True}


@pytest.mark.parametrize("case", ["pallas", "pallas_fsdp", "pallas_mamba3_projection"])
def test_pallas_kernel_runs_per_device_inside_shard_map(results, case):
    r = results[case]
    assert r["grads"] <= 1e-6, r
    assert r.get("projection_kernels_ran", True), r
