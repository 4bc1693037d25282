"""Sequence parallelism on 4 simulated CPU devices equals the single-device run.

The cases run in a subprocess (`sequence_parallel_worker.py`: the device count must be set before
JAX starts). Each op is compared on a `seq`-only mesh (4 time shards: the Pallas kernels) and a 2 x 2
data x seq mesh (the XLA implementation), outputs, both passes' final states and every cotangent (incl.
the initial states'), with resets inside a shard, at a shard's first position and at the window's first
position (the Mamba-3 kernels take no resets), and a rerun of the compiled call is bit-identical. In bf16 the sharded
run must be as close to the float32 one-device run as the bf16 one-device run is (the bf16 gradients
up to one more ulp). The loss (worker's `grad_fn`) has a cotangent with a bounded derivative, so the
float32 comparisons measure the sharding, not the loss's amplification of output rounding. The train steps
chain three windows through the recurrent state (resets in the second).
"""

from __future__ import annotations

import pytest
from builders import worker_results



@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return worker_results("sequence_parallel_worker.py", tmp_path_factory.mktemp("sp"))


@pytest.mark.parametrize("case", ["selective_scan_f32", "mixer_core_f32", "mamba3_f32"])
def test_op_equals_one_device_f32(results, case):
    out, grads = results[case]["data2_seq2"]
    assert out <= 2e-6 and grads <= 5e-6, results[case]
    assert results[case]["data2_seq2_bit_identical_rerun"], results[case]


@pytest.mark.parametrize("case", ["selective_scan_pallas", "mixer_core_pallas", "mamba3_pallas"])
def test_pallas_kernels_run_per_time_shard(results, case):
    out, grads = results[case]["seq4"]
    assert out <= 5e-6 and grads <= 2e-5, results[case]
    assert results[case]["seq4_bit_identical_rerun"], results[case]


@pytest.mark.parametrize("case", ["selective_scan_bf16", "mixer_core_bf16", "mamba3_bf16_shared_angles"])
def test_op_bf16_is_as_close_to_f32_as_one_device(results, case):
    r = results[case]
    for mesh in ("data2_seq2",):
        assert r[mesh][0] <= 1e-5, (mesh, r)           # outputs: the same bf16 values up to 1 ulp in a few
        # outputs vs the float32 run; the gradients of bf16 arguments are bf16, where the shards'
        # differently ordered sums flip a rounding: one bf16 ulp of the largest entry (2^-8) more
        assert r[mesh + "_vs_f32"][0] <= 1.25 * r["single_vs_f32"][0] + 1e-6, (mesh, r)
        assert r[mesh + "_vs_f32"][1] <= 1.25 * r["single_vs_f32"][1] + 2.0 ** -8, (mesh, r)


@pytest.mark.parametrize("arch", ["mamba1", "mamba3"])
def test_train_step_on_data_x_seq_mesh_equals_one_device(results, arch):
    r = results[f"train_{arch}"]
    assert r["grads"] <= 5e-6, r
    # Adam turns reduction-order rounding of near-zero gradients into visible parameter differences
    assert r["params"] <= 1e-4 and r["recurrent"] <= 5e-5, r
    assert r["recurrent_spec"] == "P('data',)"


@pytest.mark.parametrize("arch", ["mamba1", "mamba3"])
def test_train_step_bf16_is_as_close_to_f32_as_one_device(results, arch):
    r = results[f"train_{arch}_bf16"]
    assert r["multi_vs_f32"] <= 1.25 * r["single_vs_f32"], r


def test_split_api_on_data_x_seq_mesh(results):
    assert results["split"]["params"] <= 1e-4


def test_checkpoint_round_trip_from_sequence_sharded_state(results):
    assert results["checkpoint"] == {"equal": True, "same_sharding": True}


def test_unsplittable_windows_are_refused_by_name(results):
    r = results["errors"]
    assert "sequence length (6) must be divisible by the mesh's 'seq' axis (4)" in r["seqlen"]
    assert "at least d_conv - 1 = 3 positions" in r["conv_tail"]
    assert "data x seq = 3 x 2 = 6 must equal the number of devices (4)" in r["mesh_product"]
    assert "seq (3) must divide the number of devices (4)" in r["mesh_divides"]
    assert "seq must be a positive int, got 0" in r["mesh_positive"]
    assert "batch['inputs']: sequence length 7 (axis 1) must be divisible by the 'seq' axis (2)" in r["batch_time"]
    assert "batch['inputs']: batch size 3 must be divisible by the 'data' axis (2)" in r["batch_rows"]
    assert "fsdp=True shards the weights over the 'data' axis: the mesh has none" in r["fsdp_without_data"]
