"""Which tier each test is in, which quick tests make the smoke run, and which combinations only the
full matrix runs (tests/conftest.py applies them; docs/testing.md says how to run each).

A file's row is the tier of its tests; a ``file::test`` row (the test function's name, all its
parameters) overrides it for that test. A new test file needs a row: the run stops without one.
"""

from __future__ import annotations

TIERS: dict[str, str] = {
    # one process, no servers
    "test_api_protocol.py": "unit",
    "test_audio_media.py": "unit",
    "test_bench.py": "unit",
    "test_block_table.py": "unit",
    "test_checkpoint.py": "unit",
    "test_contiguous_kv.py": "unit",
    "test_cpu_linear.py": "unit",
    "test_detokenizer.py": "unit",
    "test_directory.py": "unit",
    "test_dispatch.py": "unit",
    "test_embedding_cache.py": "unit",
    "test_embeds.py": "unit",
    "test_encoder_batcher.py": "unit",
    "test_encoder_protocol.py": "unit",
    "test_encoder_service.py": "unit",
    "test_engine_core.py": "unit",
    "test_engine_oracle.py": "unit",
    "test_fused_decoder.py": "unit",
    "test_media.py": "unit",
    "test_media_budget.py": "unit",
    "test_media_fuzz.py": "unit",
    "test_memory.py": "unit",
    "test_memory.py::test_serve_with_a_budget_below_its_weights_exits_at_once_naming_the_numbers": "integration",
    "test_memory.py::test_serve_with_a_kv_cache_memory_has_that_many_blocks": "integration",
    "test_memory.py::test_plan_memory_prints_how_many_of_each_role_fit": "integration",
    "test_models.py": "unit",
    "test_module_size.py": "unit",
    "test_pd_transfer.py": "unit",
    "test_plan.py": "unit",
    "test_plan.py::test_calibration_against_a_started_deployment": "e2e",
    "test_processor.py": "unit",
    "test_qwen2_5_vl.py": "unit",
    "test_qwen3_vl.py": "unit",
    "test_resample.py": "unit",
    "test_sampler.py": "unit",
    "test_shapes.py": "unit",
    "test_tokenizer.py": "unit",
    "test_threads.py": "unit",
    "test_lending.py": "integration",
    "test_tiers.py": "unit",
    "test_transfer_security.py": "unit",
    "test_vllm_parts.py": "unit",
    "test_vllm_parts.py::test_up_with_vllm_not_installed_fails_in_one_line": "integration",
    "test_vllm_parts.py::test_up_with_vllm_refuses_what_it_cannot_run_in_one_line": "integration",
    "test_vllm_parts.py::test_the_vllm_wrapper_prefixes_lines_and_takes_vllm_s_helpers_down": "integration",
    "test_vllm_parts.py::test_the_vllm_wrapper_exits_as_vllm_did": "integration",
    "test_vllm_parts.py::test_up_counts_its_encoders_and_leaves_vllm_to_size_itself": "integration",
    # files of unit tests with a few that start processes
    "test_admission.py": "unit",
    "test_admission.py::test_a_burst_of_image_requests_waits_or_is_turned_away_while_text_goes_through": "e2e",
    "test_admission.py::test_a_text_ttft_target_lowers_the_media_limit_of_a_live_router": "e2e",
    "test_cli.py": "unit",
    "test_cli.py::test_serve_help_lists_the_derived_flags": "integration",
    "test_cli.py::test_up_parses_its_flags_without_loading_torch": "integration",
    "test_cli.py::test_demo_against_a_server_sends_the_api_key_of_the_environment": "integration",
    "test_deploy.py": "unit",
    "test_deploy.py::test_the_build_context_makes_a_wheel_with_the_embedded_model_and_the_entrypoint": "integration",
    "test_deploy.py::test_the_images_commands_run_outside_a_container": "integration",
    "test_discovery.py": "unit",
    "test_discovery.py::test_workers_register_renew_and_leave_and_silent_ones_are_evicted": "integration",
    "test_discovery.py::test_the_router_finds_workers_by_dns_name": "integration",
    "test_frontend_decode.py": "unit",
    "test_frontend_decode.py::test_the_router_stays_torch_free_with_frontend_decode": "integration",
    "test_frontend_decode.py::test_greedy_answers_are_the_same_with_the_flag_on_and_off": "e2e",
    "test_frontend_decode.py::test_the_encoder_does_not_fetch_or_decode_and_items_keep_their_uuid": "e2e",
    "test_frontend_decode.py::test_forged_pixel_handles_get_a_4xx_and_the_deployment_keeps_serving": "e2e",
    "test_frontend_decode.py::test_no_lease_or_slab_outlives_its_use": "e2e",
    "test_kv_routing.py": "unit",
    "test_kv_routing.py::test_each_conversation_follows_its_kv": "e2e",
    "test_kv_routing.py::test_media_inside_the_workers_kv_are_not_encoded_and_a_lost_race_costs_an_encode": "e2e",
    "test_kv_routing.py::test_prefill_workers_are_chosen_by_kv_too": "e2e",
    "test_layering.py": "unit",
    "test_load_signal.py": "unit",
    "test_load_signal.py::test_the_router_recommends_more_workers_under_load_and_one_when_idle": "e2e",
    "test_qwen2_audio.py": "unit",
    "test_qwen2_audio.py::test_server_answers_input_audio_as_transformers": "integration",
    "test_qwen2_audio.py::test_server_resamples_44k_flac_as_scipy_would": "integration",
    "test_qwen2_audio.py::test_server_refuses_bad_audio_clearly": "integration",
    "test_qwen2_audio.py::test_topologies_answer_input_audio_as_transformers": "e2e",
    "test_sweep.py": "unit",
    "test_sweep.py::test_git_commit_marks_a_dirty_tree": "integration",
    "test_sweep.py::test_tiny_sweep_end_to_end": "e2e",
    "test_training.py": "unit",
    "test_training.py::test_workers_average_gradients_and_loss": "integration",
    "test_training.py::test_two_workers_train_and_export": "integration",
    "test_training.py::test_workers_end_when_the_trainer_is_killed": "integration",
    "test_transfer.py": "unit",
    "test_transfer.py::test_round_trip_across_processes": "integration",
    "test_transfer.py::test_killed_shm_producer_leaves_a_slab_the_next_start_removes": "integration",
    "test_transfer.py::test_stale_slab_of_dead_pid_is_removed_on_start": "integration",
    "test_transfer.py::test_fs_files_of_dead_producers_are_removed_and_writes_are_atomic": "integration",
    # real processes: one role, one connector, a store, a tool
    "test_allocator.py": "integration",
    "test_bench_serve.py": "integration",
    "test_core_failure.py": "integration",
    "test_encoder.py": "integration",
    "test_engine_client.py": "integration",
    "test_kernels.py": "integration",
    "test_isa.py": "integration",
    "test_logprobs.py": "integration",
    "test_mooncake_store.py": "integration",
    "test_health.py": "unit",
    "test_health.py::test_a_router_never_takes_an_encoder_for_a_language_model_worker": "integration",
    "test_router.py": "integration",
    "test_router.py::test_pool_policies": "unit",
    "test_router.py::test_affinity_keeps_media_on_one_encoder_and_spills_when_busy": "unit",
    "test_server.py": "integration",
    "test_store.py": "integration",
    # whole deployments: topologies, families, failures
    "test_fairness.py": "e2e",
    "test_families.py": "e2e",
    "test_families.py::test_an_unrecognised_architecture_fails_at_once_naming_what_is_supported": "integration",
    "test_gpu_check.py": "e2e",
    "test_media_attacks.py": "e2e",
    "test_multihost.py": "e2e",
    "test_newcomer.py": "e2e",
    "test_observability.py": "e2e",
    "test_observability.py::test_server_timing_round_trips": "unit",
    "test_peer_auth.py": "e2e",
    "test_real_size.py": "e2e",
    "test_topologies.py": "e2e",
    "test_topologies.py::test_topology_parsing": "unit",
    "test_topologies.py::test_pd_topology_parsing": "unit",
    "test_trust.py": "e2e",
    "test_up.py": "e2e",
    "test_vllm_connector.py": "e2e",
    "test_vllm_connector.py::test_the_installed_vllm_has_the_interface_the_connector_implements": "unit",
    "test_vllm_up.py": "e2e",
    "test_up.py::test_restart_backoff_doubles_to_the_cap": "unit",
    "test_up.py::test_pinned_engine_cores_get_cores_of_their_own": "unit",
    "test_up.py::test_engine_cpus_are_a_core_list": "unit",
    "test_up.py::test_stop_ends_the_router_before_the_roles_behind_it": "integration",
    "test_up.py::test_a_router_that_does_not_stop_holds_the_others_back_half_the_grace": "integration",
}

# quick tests beyond the unit tier that, with it, reach every subsystem: a role of each kind on its
# own (serve, encoder, router), the engine core as a process, each connector across processes, the
# shared store on Redis, and one small disaggregated deployment
SMOKE: set[str] = {
    "test_store.py::test_an_entry_round_trips_and_only_for_its_model",
    "test_logprobs.py::test_without_logprobs_none_are_sent_and_bad_values_are_refused",
    "test_encoder.py::test_models_and_health",
    "test_router.py::test_registration_is_off_without_an_admin_key",
    "test_engine_client.py::test_core_that_cannot_start_says_why",
    "test_transfer.py::test_round_trip_across_processes",
    "test_cli.py::test_up_parses_its_flags_without_loading_torch",
    "test_observability.py::test_the_router_answers_completions_and_version",
}

# connector x family combinations that only the full matrix runs (``file::test[params]``): in the
# default run every connector runs end to end (test_topologies: shm, tcp and fs in 1e+1pd, mooncake
# in the 2e+1pd deployment on a Mooncake master; each KV connector through E/P/D in test_families),
# and each family once per kind of topology, with the connectors spread over the families; the
# connectors' own tests (test_transfer) run whole
FULL_MATRIX: set[str] = {
    "test_topologies.py::test_1e1pd_equals_aggregated[mooncake]",
    "test_topologies.py::test_1e1p1d_equals_aggregated[tcp]",
    "test_families.py::test_e_pd_equals_aggregated[qwen2_5_vl-tcp]",
    "test_families.py::test_e_pd_equals_aggregated[qwen2_5_vl-fs]",
    "test_families.py::test_e_pd_equals_aggregated[qwen2_5_vl-mooncake]",
    "test_families.py::test_e_pd_equals_aggregated[qwen3_vl-shm]",
    "test_families.py::test_e_pd_equals_aggregated[qwen3_vl-fs]",
    "test_families.py::test_e_pd_equals_aggregated[qwen3_vl-mooncake]",
    "test_families.py::test_e_p_d_equals_aggregated[qwen2_5_vl-tcp]",
    "test_families.py::test_e_p_d_equals_aggregated[qwen3_vl-shm]",
    "test_qwen2_audio.py::test_topologies_answer_input_audio_as_transformers[tcp]",
    "test_qwen2_audio.py::test_topologies_answer_input_audio_as_transformers[fs]",
    "test_qwen2_audio.py::test_topologies_answer_input_audio_as_transformers[mooncake]",
    "test_multihost.py::test_roles_on_separate_hosts_answer_as_aggregated[mooncake]",
}

# test files that need an optional extra: skipped, with the reason, where its module does not load
EXTRAS: dict[str, str] = {
    "test_store.py": "redis",
    "test_mooncake_store.py": "mooncake.store",
    "test_vllm_connector.py": "vllm",  # scripts/test_vllm.sh installs vLLM's CPU build and runs it
    "test_vllm_up.py": "vllm",
}


def tier_of(file: str, test: str) -> str:
    """The tier of ``test`` (a test function's name) in ``file``, a file with a row in TIERS."""
    return TIERS.get(f"{file}::{test}", TIERS[file])
