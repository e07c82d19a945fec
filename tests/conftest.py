"""Test tiers by folder: tests/unit (one process, by package), tests/multirank (gloo processes),
tests/examples (the example scripts end to end). Each tier's marker is set from its folder, so
``pytest -m "not multirank"`` runs the one-process tiers alone; ``slow`` marks the tests named in
``SLOW`` (over 5 s on a 2-core machine), so ``pytest -m "not slow"`` is the quick loop.

Property tests (hypothesis) run derandomized: the same examples on every machine and every run,
so a red CI names a change, not a draw. ``HYPOTHESIS_PROFILE=explore`` draws fresh examples (run
it when changing a bound or a cost; it is how the xfail in test_lp_bound_exact.py was found).

Torch runs one intra-op thread in the test process and in every process it starts (unless
``OMP_NUM_THREADS`` is set by the caller): the tests' tensors are tiny, and a second thread
waiting on a busy core made the torch tests several times slower, on a loaded machine ten times.
"""

import os
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch is imported: before any test module

TIERS = {"multirank": pytest.mark.multirank, "examples": pytest.mark.examples}
ROOT = Path(__file__).resolve().parent

# "<path under tests/>::<test function>" (every parametrisation of it); tests/unit/test_markers.py
# checks that each names a test that exists.
SLOW = frozenset(
    {
        "examples/test_quickstart.py::test_the_quickstart_runs_as_written",
        "examples/test_sft_example.py::test_sft_example_runs",
        "examples/test_sft_trl_example.py::test_sft_trl_example_runs_packed",
        "multirank/test_calibration_runtime.py::test_every_rank_switches_model_at_the_same_step_and_runs_one_plan",
        "multirank/test_calibration_service.py::test_serve_command_calibrates_and_saves_the_profile",
        "multirank/test_calibration_slices.py::test_calibration_with_slices_measures_every_groups_micro_batches",
        "multirank/test_faults.py::test_a_bad_slice_makes_every_rank_fall_back_alike_naming_it",
        "multirank/test_faults.py::test_a_restart_with_slices_resumes_from_its_checkpoint",
        "multirank/test_faults.py::test_a_healthy_step_makes_one_agreement_and_no_store_request",
        "multirank/test_faults.py::test_every_rank_raises_in_bounded_time_naming_the_culprit",
        "multirank/test_faults.py::test_forged_and_garbage_plans_fall_back_consistently",
        "multirank/test_faults.py::test_forged_board_records_are_ignored",
        "multirank/test_faults.py::test_prefetching_needs_agree_ahead_and_never_hangs",
        "multirank/test_faults.py::test_sampler_agreement_is_on_by_default_and_names_an_absent_rank",
        "multirank/test_faults.py::test_tampering_after_rank0_read_raises_in_that_step",
        "multirank/test_fsdp_mesh.py::test_a_unit_is_refused_as_the_runner_model",
        "multirank/test_fsdp_mesh.py::test_adamw_steps_equal_single_process",
        "multirank/test_fsdp_mesh.py::test_meshes_place_parameters_as_hsdp_and_tensor_parallel",
        "multirank/test_fsdp_mesh.py::test_one_step_equals_single_process",
        "multirank/test_fsdp_mesh.py::test_tp_plans_are_uneven_and_leave_a_rank_idle",
        "multirank/test_fsdp_mesh.py::test_trainable_set_changed_after_build",
        "multirank/test_fsdp_mesh.py::test_wrong_pool_and_unsupported_sharding_are_refused",
        "multirank/test_fsdp_sharded.py::test_adamw_steps_equal_single_process",
        "multirank/test_fsdp_sharded.py::test_bad_input_is_refused",
        "multirank/test_fsdp_sharded.py::test_failed_step_keeps_gradients_and_settings",
        "multirank/test_fsdp_sharded.py::test_full_sharding_holds_one_block_unsharded",
        "multirank/test_fsdp_sharded.py::test_one_step_equals_single_process",
        "multirank/test_fsdp_sharded.py::test_sizes_are_read_from_the_sharded_model",
        "multirank/test_fsdp_sharded_mesh.py::test_adamw_steps_equal_single_process",
        "multirank/test_fsdp_sharded_mesh.py::test_one_step_equals_single_process",
        "multirank/test_fsdp_sharded_mesh.py::test_plans_need_empty_passes",
        "multirank/test_fsdp_sharded_mesh.py::test_sizes_count_what_one_rank_shards",
        "multirank/test_fsdp_sharded_mesh.py::test_unsupported_mesh_and_wrong_pool_are_refused",
        "multirank/test_hf.py::test_head_split_with_a_windowed_layer_is_refused_before_any_collective",
        "multirank/test_hf.py::test_loss_and_gradients_equal_single_process",
        "multirank/test_hybrid.py::test_hybrid_gradients_equal_single_process",
        "multirank/test_hybrid_attention.py::test_errors_that_need_process_groups",
        "multirank/test_hybrid_attention.py::test_every_split_matches_full_attention",
        "multirank/test_hybrid_attention.py::test_runtime_mixing_rings_all_to_all_and_hybrid_equals_one_process",
        "multirank/test_megatron.py::test_dyncp_schedule_is_one_schedule_with_packs_and_cp_sizes",
        "multirank/test_megatron.py::test_every_token_once_partners_in_sync",
        "multirank/test_megatron.py::test_loss_and_grads_equal_one_process",
        "multirank/test_menu_runtime.py::test_sizes_3_5_6_on_six_ranks_are_exact",
        "multirank/test_menu_runtime.py::test_sizes_5_12_and_splits_of_12_on_twelve_ranks_are_exact",
        "multirank/test_ring_attention.py::test_ring_world_2",
        "multirank/test_ring_attention.py::test_ring_world_4_switches_cp4_two_cp2_rings_cp4",
        "multirank/test_ring_attention.py::test_ring_world_8",
        "multirank/test_pipeline_measured.py::test_measured_steps_calibrate_the_pipelined_prediction_on_held_out_steps",
        "multirank/test_pipeline_runtime.py::test_a_failing_stage_is_named_by_every_process",
        "multirank/test_pipeline_runtime.py::test_pp2_x_four_columns_1f1b_and_interleaved_equal_one_process",
        "multirank/test_pipeline_runtime.py::test_pp2_x_two_columns_1f1b_and_interleaved_equal_one_process",
        "multirank/test_pipeline_runtime.py::test_wrong_plans_are_refused_on_every_process_before_any_transfer",
        "multirank/test_runtime.py::test_gradients_equal_single_process",
        "multirank/test_scan.py::test_state_passing_and_channel_parallel_scans_match_one_process",
        "multirank/test_service.py::test_a_late_service_never_makes_readers_diverge",
        "multirank/test_service.py::test_four_gloo_ranks_execute_identical_plans",
        "multirank/test_service.py::test_serve_command_runs_the_service_standalone",
        "multirank/test_service.py::test_serve_exits_nonzero_when_its_store_dies",
        "multirank/test_service.py::test_serve_gives_up_on_a_store_that_never_answers_in_one_line",
        "multirank/test_service.py::test_serve_stops_on_sigint_while_connecting",
        "multirank/test_trainer_bugs.py::test_ddp_runner_leaves_frozen_parameters_untouched_and_trainable_ones_exact",
        "multirank/test_trainer_bugs.py::test_execute_local_gives_step_fn_what_execute_gives_on_one_rank",
        "multirank/test_trainer_bugs.py::test_reduce_loss_agrees_on_one_buffer_whatever_the_dtypes",
        "multirank/test_trainer_hf.py::test_trainer_steps_equal_single_process",
        "multirank/test_trainers.py::test_adamw_steps_equal_single_process",
        "multirank/test_trainers.py::test_one_step_equals_single_process",
        "multirank/test_trainers.py::test_pool_on_other_ranks_is_refused",
        "multirank/test_trl.py::test_one_process_equals_plain_sft",
        "multirank/test_trl.py::test_packing_trains_what_the_unpacked_run_trains",
        "multirank/test_trl.py::test_two_ranks_equal_plain_sft",
        "multirank/test_window.py::test_windowed_ring_matches_per_sequence_reference_cp4_and_cp2",
        "unit/cost_model/calibration/test_calibration.py::test_any_measurements_give_a_valid_finite_profile",
        "unit/cost_model/calibration/test_calibration_adversary.py::test_a_step_change_of_the_machine_is_followed_within_eight_steps",
        "unit/cost_model/calibration/test_calibration_adversary.py::test_lognormal_noise_and_stragglers_are_learned_without_bias",
        "unit/cost_model/calibration/test_calibration_drift.py::test_a_step_change_under_heavy_noise_is_followed_within_eight_steps",
        "unit/cost_model/calibration/test_calibration_drift.py::test_noise_alone_triggers_no_following",
        "unit/integrations/test_trainer_one_process.py::test_one_process_trainer_steps_equal_the_same_steps_by_hand",
        "unit/integrations/test_trainer_one_process.py::test_one_process_trainer_trains_under_bf16_autocast",
        "unit/observability/test_metrics.py::test_multiprocess_collector_aggregates_every_writer",
        "unit/plan/test_menu.py::test_a_menu_holding_the_powers_of_two_is_never_slower",
        "unit/plan/test_plan_slice.py::test_all_records_of_a_4096_rank_plan_stay_within_twice_its_json",
        "unit/planner/test_cpsat.py::test_deterministic_plans_identical_across_processes",
        "unit/planner/test_cpsat.py::test_planner_with_cpsat_valid_and_never_worse",
        "unit/planner/test_cpsat.py::test_scale_wlbllm_4096_sequences_on_512_ranks",
        "unit/planner/test_laminar.py::test_planner_keeps_the_layout_only_when_faster",
        "unit/planner/test_pipeline_bound.py::test_bound_is_below_every_pipelined_plan_of_five_sequences",
        "unit/planner/test_policies.py::test_every_policy_gives_a_valid_plan",
        "unit/planner/test_policies.py::test_same_input_same_plan",
        "unit/sampler/test_sampler.py::test_resume_at_a_random_point_equals_the_uninterrupted_run",
        "unit/sim/test_plots.py::test_plot_writes_a_gantt_per_policy_and_the_step_time_plot",
        "unit/sim/test_release_policy.py::test_the_release_is_priced_beside_dyncp",
        "unit/sim/test_release_policy.py::test_the_release_pays_the_same_whole_step_parts",
        "unit/sim/test_sim.py::test_cli_subprocess_bundled_defaults",
        "unit/test_readme_figures.py::test_the_record_is_what_the_caption_command_plans_now",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).resolve().relative_to(ROOT).parts
        mark = TIERS.get(parts[0]) if parts else None
        if mark is not None:
            item.add_marker(mark)
        name = getattr(item, "originalname", item.name)
        if f"{'/'.join(parts)}::{name}" in SLOW:
            item.add_marker(pytest.mark.slow)
