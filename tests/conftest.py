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


# The slow tier (`pytest -m slow`, `make test-slow`; CI runs both tiers): tests that `make test` leaves
# out so that it stays near the ~12-minute budget on 2 cores, chosen because each one checks
# something the default tier also reaches by another case, or a path no default takes. Entries are
# (file, test function or None for the whole file, parameter-id prefix or None). Seconds are
# session 33's clean-clone durations (2 cores, shared compilation cache).
SLOW_TESTS = (
    # whole files: several processes or simulated devices, or a prototype backend
    ("test_sequence_parallel.py", None, None),    # ~200 s: one worker with 4 simulated devices
    ("test_data_parallel.py", None, None),        # ~150 s: likewise
    ("test_multiprocess.py", None, None),         # ~25 s: three processes under jax.distributed
    ("test_benchmarks_smoke.py", None, None),     # ~150 s: every benchmark script at tiny shapes
    ("test_selective_scan_mosaic.py", None, None),   # ~80 s: the Mosaic GPU prototypes (no default uses them)
    ("test_examples.py", None, None),             # ~45 s: the examples end to end
    # Mamba-3 kernel configurations no default takes (Mamba3ScanConfig's docstring says why each is off)
    ("test_mamba3_scan_pallas.py", "test_chunk_gradients_in_one_two_or_three_launches_match_reference", None),
    ("test_mamba3_scan_pallas.py", "test_adt_in_the_values_or_keys_launch_matches_reference", None),
    ("test_mamba3_scan_pallas.py", "test_keys_and_queries_in_one_launch_match_reference", None),
    ("test_mamba3_scan_pallas.py", "test_rotation_in_the_chunk_gradient_launch_matches_reference", None),
    ("test_mamba3_scan_pallas.py", "test_split_state_passes_match_reference", None),
    ("test_mamba3_scan_pallas.py", "test_skip_term_as_a_per_position_weight_matches_reference", None),
    ("test_mamba3_scan_pallas.py", "test_angle_sums_by_matmul_match_reference", None),
    ("test_mamba3_scan_pallas.py", "test_query_key_gradient_blocks_match_reference", None),
    ("test_mamba3_scan_pallas.py", "test_bias_gradients_by_xla_match_reference", None),
    ("test_mamba3_scan_pallas.py", "test_stored_scores_and_ungated_output_match_reference", None),
    ("test_mamba3_scan_pallas.py", "test_query_key_kernels_match_their_pure_jax_reference", "angle-sums-by-matmul"),
    ("test_mamba3_scan_pallas.py", "test_query_key_kernels_match_their_pure_jax_reference", "gradient-blocks"),
    ("test_mamba3_scan_pallas.py", "test_query_key_kernels_match_their_pure_jax_reference", "three-slices"),
    ("test_mamba3_scan_pallas.py", "test_fast_rotation_matches_reference", "rotation-in-chunk-gradients"),
    ("test_mamba3_scan_pallas.py", "test_fast_rotation_matches_reference", "backward-only"),
    ("test_mamba3_scan_pallas.py", "test_fast_math_matches_reference", "rotation-in-chunk-gradients"),
    ("test_mamba3_scan_pallas.py", "test_fast_math_matches_reference", "split-passes-nothing-stored"),
    ("test_mamba3_scan_pallas.py", "test_position_major_query_key_gradients_match_reference",
     "shared-angles-two-blocks-stored-theta"),
    ("test_mamba3_scan_pallas.py", "test_position_major_query_key_gradients_match_reference",
     "no-angles-separate-launches"),
    ("test_mamba3_scan_pallas.py", "test_position_major_query_key_gradients_match_reference",
     "shared-angles-transposed-dots"),
    ("test_mamba3_scan_pallas.py", "test_position_major_query_key_gradients_match_reference",
     "per-head-angles-two-blocks-theta-position-major"),
    ("test_mamba3_scan_pallas.py", "test_position_major_query_key_gradients_match_reference",
     "shared-angles-d-angles-position-major"),
    ("test_mamba3_scan_pallas.py", "test_position_major_query_key_gradients_match_reference",
     "per-head-angles-angle-gradient-pass"),
    ("test_mamba3_scan_pallas.py", "test_angle_gradient_kernel_and_later_sums_match_their_references", "one-chunk"),
    # per-head angles on the position-major kernel without the angle gradient pass (the pass is the default)
    ("test_mamba3_scan_pallas.py", "test_position_major_query_key_gradients_match_reference", "per-head-angles-groups"),
    ("test_mamba3_projected.py", "test_row_splits_change_nothing", None),
    ("test_mamba3_qk_norm.py", "test_the_op_normalizes_as_rms_norm_before_it", "pallas-fused"),
    ("test_causal_conv_pallas.py", "test_values_and_every_cotangent_match_the_xla_conv", "loop-"),
    # more cases of a check the default tier runs in another dtype, shape, optimizer or model
    ("test_mamba3_scan_pallas.py", "test_walking_state_passes_match_reference", "f16"),
    ("test_mamba3_scan_pallas.py", "test_final_state_unused_matches_reference", "per-head-angles-states"),
    ("test_mamba3_scan_pallas.py", "test_final_state_unused_matches_reference", "no-angles"),
    ("test_mamba3_scan_pallas.py", "test_fresh_sequence_equals_explicit_zero_states", "no-angles"),
    ("test_mamba3_scan_pallas.py", "test_op_order_matches_reference_and_the_kernel_layout_bit_for_bit",
     "shared-angles"),
    ("test_mamba3_scan_pallas.py", "test_position_major_qk_copies_from_the_forward_match_reference_bit_for_bit", None),
    ("test_mamba3_scan_pallas.py", "test_entry_angle_prefix_kernel_through_the_op_matches_reference", None),
    ("test_mamba3_scan_pallas.py", "test_vmap_jit_and_checkpoint_gradients_match_reference", "op-order"),
    ("test_mamba3_scan_pallas.py", "test_op_order_matches_reference_and_the_kernel_layout_bit_for_bit", None),
    ("test_mamba3_scan_pallas.py", "test_op_order_leaves_no_permutation_to_xla", None),
    ("test_mamba3_scan_pallas.py", "test_entry_angle_prefix_kernel_matches_the_xla_prefix", "5-chunks"),
    ("test_mamba3_scan_pallas.py", "test_entry_angle_prefix_kernel_matches_the_xla_prefix", "8-chunks"),
    ("test_mamba3_scan_pallas.py", "test_walking_state_passes_match_reference", "f32-no-z-no-states"),
    ("test_mamba3_projected.py", "test_fused_matches_the_unfused_pallas_path", "six-heads-three-groups"),
    ("test_mamba3_projected.py", "test_fused_matches_the_unfused_pallas_path", "model-like-N"),
    ("test_mamba1_mixer_core.py", "test_values_and_every_cotangent_match_reference", "k1-f32"),
    ("test_selective_scan_pallas.py", "test_reusing_the_forward_walks_decays_is_bit_identical", "4"),
    ("test_flat_train_state.py", "test_flat_state_trains_bit_identically", "mamba3-"),
    ("test_train_state_pure.py", "test_steps_match_the_nnx_layout_goldens", "m3_f16_chain"),
    ("test_train_state_pure.py", "test_steps_match_the_nnx_layout_goldens", "m1_multisteps"),
    ("test_training_system.py", "test_f16_overflow_step_is_skipped_bit_identically", "inf-optax"),
    ("test_training_system.py", "test_split_api_is_bit_identical_to_the_fused_step", "bf16-optax"),
    ("test_robustness.py", "test_one_nan_in_the_batch_skips_the_step_and_restarts_only_that_row", "optax-f16"),
    ("test_robustness.py", "test_one_nan_in_the_batch_skips_the_step_and_restarts_only_that_row", "optax-bf16"),
    ("test_robustness.py", "test_one_nan_in_the_batch_skips_the_step_and_restarts_only_that_row", "fused-bf16"),
    ("test_robustness.py", "test_a_schedule_that_turns_bad_later_changes_nothing", "True-"),
    ("test_generation.py", "test_ragged_and_bucketed_equal_each_row_alone", "mamba3"),
    ("test_mamba1_mixer_core.py", "test_pallas_kept_activations_give_the_same_values_and_cotangents_bit_for_bit",
     "bf16-rows-bare-xz-packed"),
    ("test_mamba1_mixer_core.py", "test_packed_xz_gives_the_values_and_cotangents_of_its_two_halves",
     "pallas-short-window"),
    ("test_selective_scan_pallas.py", "test_a_gate_read_from_a_wider_array_gives_the_same_values_and_cotangents",
     "unaligned-sliced"),
    ("test_selective_scan_pallas.py", "test_prefetching_the_backwards_rows_is_bit_identical", "2-bfloat16-True"),
    ("test_selective_scan_pallas.py", "test_prefetching_the_backwards_rows_is_bit_identical", "1-float16-True"),
    ("test_mamba3_scan_pallas.py", "test_fast_rotation_matches_reference", "query-key-gradient-kernel"),
    ("test_add_rms_norm.py", "test_backbone_with_the_kernels_matches_the_composition", "mamba3"),
    ("test_mamba3_qk_norm.py", "test_the_mamba3_mixer_output_is_unchanged_by_the_move", None),   # a refactor's check
    ("test_generation.py", "test_stream_receives_every_token_in_order", "mamba3"),
    ("test_generation.py", "test_eos_and_stop_sequences_stop_rows_and_pad", "mamba3"),
    ("test_lm_generate.py", "test_main_job_mamba3", None),
    ("test_checkpoint.py", "test_resume_in_a_fresh_process_is_bit_continuous", "mamba3"),
    # session 34 (~110 s of test time on 2 cores): a config no default takes, or a case whose path a kept
    # sibling of the same test already runs (another dtype, size or geometry of the same kernel)
    ("test_selective_scan_pallas.py", "test_values_and_every_cotangent_match_reference", "f32-all-reset-groups-exact-math"),
    ("test_selective_scan_pallas.py", "test_values_and_every_cotangent_match_reference", "f32-reset-adjoint-stride-4"),
    ("test_selective_scan_pallas.py", "test_values_and_every_cotangent_match_reference",
     "bf16-all-reset-n5-split-adjoint-stride-2"),
    ("test_selective_scan_pallas.py", "test_values_and_every_cotangent_match_reference", "f32-all-reset-groups-fast-math"),
    ("test_selective_scan_pallas.py", "test_kernels_lower_to_triton_for_h200", "perf-shape-parallel-forward"),
    ("test_selective_scan_pallas.py", "test_kernels_lower_to_triton_for_h200", "perf-shape-no-reuse-decay"),
    ("test_selective_scan_pallas.py", "test_kernels_lower_to_triton_for_h200", "perf-shape-prefetch-rows"),
    ("test_mamba1_mixer_core.py", "test_values_and_every_cotangent_match_reference", "f16-no-state-pallas"),
    ("test_causal_conv_pallas.py", "test_values_and_every_cotangent_match_the_xla_conv", "f16-short"),
    ("test_causal_conv_pallas.py", "test_values_and_every_cotangent_match_the_xla_conv", "f32-exact"),
    ("test_causal_conv_pallas.py", "test_the_new_state_cotangent_lands_on_the_last_rows_across_a_block_boundary", "34-"),
    ("test_causal_conv_pallas.py", "test_the_new_state_cotangent_lands_on_the_last_rows_across_a_block_boundary", "40-"),
    ("test_causal_conv_vjp.py", "test_values_and_cotangents_match_old_formula", "3-"),
    ("test_causal_conv_vjp.py", "test_values_and_cotangents_match_old_formula", "5-"),
    ("test_mamba3_scan_pallas.py", "test_query_key_kernels_match_their_pure_jax_reference", "one-slice-per-group"),
    ("test_mamba3_scan_pallas.py", "test_query_key_kernels_match_their_pure_jax_reference", "full-rope"),
    ("test_mamba3_scan_pallas.py", "test_walking_state_passes_match_reference", "bf16-two-row-blocks"),
    ("test_mamba3_scan_pallas.py", "test_kernels_lower_to_triton_for_h200", "perf-shape-bf16-one-head-launch"),
    ("test_mamba3_scan_pallas.py", "test_kernels_lower_to_triton_for_h200", "perf-shape-bf16-head-launches"),
    ("test_mamba3_scan_step.py", "test_steps_equal_the_numpy_model_and_the_scan", "bare-fresh-fullrope-f32-reference"),
    ("test_hf_interop.py", "test_logits_and_greedy_tokens_match_transformers", "fused-pallas-hf_mamba_tied"),
    ("test_packing.py", "test_packed_windows_equal_separate_documents", "mamba3"),
    ("test_fused_adamw.py", "test_matches_optax_adamw_and_float64_over_100_steps", "xla-False"),
    ("test_xdist_recovery.py", "test_a_worker_that_dies_once_costs_one_rerun", "2"),
    # session 41 (~43 s of test time; the default tier was at 11.8 min on 2 cores): cases whose path a kept
    # sibling runs (the packed x|z through xla, remat on Mamba-3, the fused projection in other shapes)
    ("test_mamba1_mixer_core.py", "test_packed_xz_gives_the_values_and_cotangents_of_its_two_halves", "pallas-f32-resets"),
    ("test_remat.py", "test_remat_gives_the_same_training_with_less_temporary_memory", "mamba1-policy0"),
    ("test_mamba3_projected.py", "test_fused_matches_the_unfused_pallas_path", "bf16"),
    # session 42 (~97 s of test time; the default tier took 765 s on an AMD EPYC 2-core host): an off config
    # (qk_norm kernels), the default config named again (fast math), or a case whose path a kept sibling runs
    ("test_selective_scan_pallas.py", "test_values_and_every_cotangent_match_reference", "f32-odd-groups-blocks-of-1"),
    ("test_selective_scan_pallas.py", "test_values_and_every_cotangent_match_reference", "bf16-all-reset-n5-fast-math"),
    ("test_properties.py", "test_mamba3_scan_xla_agrees_with_the_reference", None),
    ("test_mamba3_qk_norm.py", "test_the_op_normalizes_as_rms_norm_before_it", "pallas-unfused"),
    ("test_deprecations.py", "test_models_compute_dtype_keyword", "mamba3"),
    ("test_training_system.py", "test_two_half_batches_accumulated_equal_one_full_batch", None),
    ("test_mamba3_scan_pallas.py", "test_query_key_kernels_match_their_pure_jax_reference", "three-heads"),
    ("test_causal_conv_pallas.py", "test_values_and_every_cotangent_match_the_xla_conv", "bf16-defaults"),
    ("test_selective_scan_pallas.py", "test_reusing_the_forward_walks_decays_is_bit_identical", "2"),
    ("test_train_state_pure.py", "test_unjitted_step_composes_in_a_jit", None),   # test_train_step's first test composes too
)


def slow_entry_matches(entry, path, name, case) -> bool:
    """Whether a SLOW_TESTS entry names the test `name[case]` of file `path` (a basename)."""
    file, function, prefix = entry
    return path == file and function in (None, name) and (prefix is None or case.startswith(prefix))


def is_slow(item) -> bool:
    """Whether SLOW_TESTS names this collected test."""
    path = os.path.basename(str(item.fspath))
    name = getattr(item, "originalname", None) or item.name.partition("[")[0]
    case = item.callspec.id if hasattr(item, "callspec") else ""
    return any(slow_entry_matches(entry, path, name, case) for entry in SLOW_TESTS)


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
    """The slow tier marked (SLOW_TESTS); slow files first (see SLOW_FILES_FIRST); `@pytest.mark.gpu`
    tests need a CUDA GPU: they are skipped (and reported as skipped) elsewhere."""
    slow = pytest.mark.slow
    for item in items:
        if is_slow(item):
            item.add_marker(slow)
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))   # stable
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python3 -m pytest -m gpu tests` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
