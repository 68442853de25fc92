"""The SGLang server args dvfs deliberately does not compare between the arms of a journal
(nor between a drafter's servers), each group with its reason. With the compared ones
(`ARM_ARGS`, `SERVER_INVARIANTS`), the drafters' own (`DRAFTER_ARGS`, `speculative_*`) and
those SGLang derives from the GPU (`dvfs.cube.merge.GPU_DERIVED_ARGS`, `AUTO_KERNEL_ARGS`),
they name every option of SGLang 0.5.9's and 0.5.23's launch_server once
(tests/test_arm_invariants.py checks it against tests/data/sglang-args/), so that a new option
is classified, not passed over."""

from __future__ import annotations

# fmt: off
#: Each reason, in words, and the resolved args (as /server_info names them) it covers.
NOT_COMPARED: dict[str, tuple[str, tuple[str, ...]]] = {
    "serving": (
        "how the server is reached and answers: its HTTP and gRPC front, keys and TLS, chat "
        "templates and parsers, what a response carries and how a stream splits it, its warm-up "
        "and its cap on queued requests (dvfs queues no more than a cell's batch): dvfs sends "
        "/generate its text and reads the tokens, so none changes a decode step",
        (
            "admin_api_key", "allow_auto_truncate", "api_key", "asr_max_buffer_seconds",
            "asr_max_concurrent_sessions", "batch_notify_size", "chat_template",
            "completion_template", "default_chat_template_kwargs", "enable_cache_report",
            "enable_http2", "enable_http_worker_reuseport", "enable_response_store",
            "enable_ssl_refresh", "enable_streaming_session", "engine_info_bootstrap_port",
            "fastapi_root_path", "file_storage_path", "gated_launch_port", "grpc_mode",
            "grpc_port", "grpc_response_timeout_secs", "hf_chat_template_name", "host",
            "http2_initial_connection_window_size", "http2_max_concurrent_streams",
            "incremental_streaming_output", "max_queued_requests", "port", "reasoning_parser",
            "return_input_ids", "return_output_ids", "served_model_name", "sidecar",
            "sidecar_args", "skip_server_warmup", "skip_tokenizer_init", "smg_grpc_mode",
            "smg_http_sidecar_port", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
            "ssl_keyfile_password", "stream_output", "stream_response_default_include_usage",
            "tool_call_parser", "tool_server", "trust_request_chat_template", "warmups",
            "weight_version",
        ),
    ),
    "processes": (
        "the server's processes, ports and place on the host: which GPUs and nodes (the GPU is "
        "compared apart: the session's GPUs), NUMA binding, tokenizer workers and batching, "
        "Python's collector, start-up checks and the config file its args are read from (those "
        "args are compared as they resolve)",
        (
            "base_gpu_id", "config", "custom_sigquit_handler", "detokenizer_worker_num", "device",
            "disable_hicache_numa_detect", "disable_tokenizer_batch_decode", "dist_init_addr",
            "dynamic_batch_tokenizer_batch_size", "dynamic_batch_tokenizer_batch_timeout",
            "enable_cudagraph_gc", "enable_dynamic_batch_tokenizer", "enable_p2p_check",
            "enable_tokenizer_batch_encode", "gc_threshold", "gpu_id_step", "nccl_port", "nnodes",
            "node_rank", "numa_node", "pre_warm_nccl", "tokenizer_worker_num", "use_ray",
        ),
    ),
    "observability": (
        "what the server reports about its work (logs, metrics and their buckets, traces, crash "
        "dumps, watchdogs and timeouts), not the work",
        (
            "bucket_e2e_request_latency", "bucket_inter_token_latency",
            "bucket_time_to_first_token", "collect_tokens_histogram", "crash_dump_folder",
            "decode_log_interval", "dist_timeout", "enable_expert_distribution_metrics",
            "enable_forward_pass_metrics", "enable_metrics", "enable_metrics_for_all_schedulers",
            "enable_mfu_metrics", "enable_profile_cuda_graph",
            "enable_request_time_stats_logging", "enable_trace",
            "expert_balancedness_report_mode", "export_metrics_to_file",
            "export_metrics_to_file_dir", "extra_metric_labels", "forward_pass_metrics_ipc_name",
            "forward_pass_metrics_worker_id", "gc_warning_threshold_secs",
            "generation_tokens_buckets", "kv_events_config", "load_publish_endpoint",
            "load_snapshot_publish_interval", "log_level", "log_level_http", "log_requests",
            "log_requests_format", "log_requests_level", "log_requests_target",
            "otlp_service_name", "otlp_traces_endpoint", "prefill_delayer_forward_passes_buckets",
            "prefill_delayer_wait_seconds_buckets", "prompt_tokens_buckets", "show_time_cost",
            "soft_watchdog_timeout", "tokenizer_metrics_allowed_custom_labels",
            "tokenizer_metrics_custom_labels_header", "trace_modules",
            "uvicorn_access_log_exclude_prefixes", "watchdog_timeout",
        ),
    ),
    "loading": (
        "where and how the weights are fetched and loaded (download folder, loader threads and "
        "page cache, a weight-cache daemon, another instance, a checkpoint engine, a checksum; "
        "saving or exporting a quantized copy): the same weights, whose Hub commit is compared "
        "apart (`model_commit`)",
        (
            "checkpoint_engine_wait_weights_before_ready", "delete_ckpt_after_loading",
            "download_dir", "enable_weights_cpu_backup", "model_checksum", "modelexpress_config",
            "modelopt_checkpoint_save_path", "modelopt_export_path",
            "remote_instance_weight_loader_backend",
            "remote_instance_weight_loader_seed_instance_ip",
            "remote_instance_weight_loader_seed_instance_service_port",
            "remote_instance_weight_loader_send_weights_group_ports",
            "remote_instance_weight_loader_start_seed_via_transfer_engine",
            "startup_weight_load_mode", "weight_cache_mode", "weight_cache_socket",
            "weight_cache_timeout", "weight_loader_disable_mmap",
            "weight_loader_drop_cache_after_load", "weight_loader_prefetch_checkpoints",
            "weight_loader_prefetch_num_threads",
        ),
    ),
    "unused": (
        "features no request of dvfs uses: disaggregated prefill and encoders, multimodal "
        "inputs, structured output and logit processors, multi-item scoring, request priorities "
        "(priority scheduling itself is compared), sessions, embeddings, diffusion models, "
        "elastic experts, weight updates, MLX, and LoRA adapters' loading (LoRA layers are "
        "compared, `enable_lora`): a text /generate runs no step of them",
        (
            "abort_on_priority_when_disabled", "allowed_media_domains",
            "constrained_json_disable_any_whitespace", "constrained_json_max_whitespace_cnt",
            "constrained_json_whitespace_pattern", "custom_weight_loader",
            "default_priority_value", "disable_fast_image_processor",
            "disable_outlines_disk_cache", "disable_priority_preemption",
            "disaggregation_bootstrap_port", "disaggregation_decode_allocation_policy",
            "disaggregation_decode_dp", "disaggregation_decode_enable_offload_kvcache",
            "disaggregation_decode_enable_radix_cache", "disaggregation_decode_extra_slots",
            "disaggregation_decode_host_receive_threshold",
            "disaggregation_decode_polling_interval", "disaggregation_decode_retraction_backup",
            "disaggregation_decode_tp", "disaggregation_enable_kv_checksum",
            "disaggregation_ib_device", "disaggregation_mode", "disaggregation_prefill_pp",
            "disaggregation_transfer_backend", "dllm_algorithm", "dllm_algorithm_config",
            "dllm_fdfo", "elastic_ep_backend", "elastic_ep_initial_size",
            "elastic_ep_scale_timeout", "enable_adaptive_dispatch_to_encoder",
            "enable_broadcast_mm_inputs_process", "enable_custom_logit_processor",
            "enable_elastic_expert_backup", "enable_linker_mla_dedup", "enable_mis",
            "enable_mm_global_cache", "enable_multimodal", "enable_pd_role_switch",
            "enable_pdmux", "enable_precise_embedding_interpolation", "enable_prefix_mm_cache",
            "enable_session_radix_cache", "encoder_bootstrap_port", "encoder_only",
            "encoder_register_urls", "encoder_transfer_backend", "encoder_urls", "ep_join_mode",
            "ep_join_rank_offset", "grammar_backend", "image_processor_backend", "is_embedding",
            "keep_mm_feature_on_device", "language_model_only", "language_only",
            "limit_mm_data_per_request", "lora_drain_wait_threshold", "lora_eviction_policy",
            "lora_paths", "max_ep_size", "max_loaded_loras", "media_url_max_file_size_mb",
            "mlx_enable_sampling", "mm_attention_backend", "mm_enable_dp_encoder",
            "mm_feature_transport", "mm_global_cache_backend", "mm_io_worker_num",
            "mm_max_concurrent_calls", "mm_per_request_timeout", "mm_preprocess_cache_size_mb",
            "mm_process_config", "mm_processor_worker_num", "mooncake_ib_device",
            "multi_item_scoring_delimiter", "optimistic_prefill_attempts", "pdmux_config_path",
            "prefill_only_disable_kv_cache", "priority_scheduling_preemption_threshold",
            "sampling_mask_max_tokens", "schedule_low_priority_values_first", "sm_group_num",
            "trust_mm_content_hashes",
        ),
    ),
    "drafter": (
        "the drafter's own, beside its speculative_* args: its config file, weights backup, "
        "decoupled drafting and traces, UNO's LoRA, ReplaySSM's speculative verify; arms differ "
        "in them as in their drafters",
        (
            "decoupled_spec_bind_endpoint", "decoupled_spec_connect_endpoints",
            "decoupled_spec_rank", "decoupled_spec_role", "decrypted_draft_config_file",
            "enable_draft_weights_cpu_backup", "enable_linear_replayssm_spec", "spec_trace_dir",
            "uno_lora_path",
        ),
    ),
    "decode_graph": (
        "compared as the decode CUDA graph each batch replays (`decode_graph`), which they "
        "make: SGLang captures other batch sizes for speculation, so dvfs gives every arm one "
        "list",
        (
            "cuda_graph_bs", "cuda_graph_bs_decode", "cuda_graph_config", "cuda_graph_max_bs",
            "cuda_graph_max_bs_decode",
        ),
    ),
    "dp_dealing": (
        "held to round_robin at start where the server has several DP ranks (dvfs gives it; "
        "a server dealing by load snapshots is refused, `dvfs.engines.sglang."
        "load_balance_refusal`), and dealing nothing where it has one",
        ("load_balance_method",),
    ),
    "deprecated": (
        "deprecated by 0.5.9: ignored, or read into the arg that replaced it",
        (
            "hybrid_kvcache_ratio", "prefill_round_robin_balance",
        ),
    ),
    "unverified": (
        "unverified: they may change the target's kernels, memory or schedule on some model, "
        "parallelism or device, or add work to a step (debugging dumps and canaries), but "
        "SGLang sets some of them from other args, models or its environment, and no one has "
        "read both releases' sources for a per-algorithm setting, so comparing them might "
        "refuse a legitimate resume",
        (
            "attn_dp_size", "boundary_reduction", "dcp_comm_backend", "dcp_replicate_q_proj",
            "debug_cuda_graph", "debug_tensor_dump_inject", "debug_tensor_dump_input_file",
            "debug_tensor_dump_layers", "debug_tensor_dump_output_folder",
            "decrypted_config_file", "deepep_v2_mode",
            "disable_aiter_allreduce_fusion_in_prefill", "dwdp_size",
            "enable_aiter_allreduce_fusion", "enable_attn_tp_input_scattered",
            "enable_cp_decode_attn_tp", "enable_decoder_swa_bounded_replay",
            "enable_dp_attention_local_control_broadcast", "enable_flexkv",
            "enable_layerwise_nvtx_marker", "enable_lmcache", "enable_megamoe_for_layernorm_sp",
            "enable_memory_saver", "enable_return_aux_hidden_states",
            "enable_return_indexer_topk", "enable_return_routed_experts",
            "enable_strict_thinking", "enable_torch_compile_debug_mode",
            "enable_tp_lm_head_all_to_all", "enable_unified_cache_external_linker",
            "enforce_disable_flashinfer_allreduce_fusion", "eplb_algorithm",
            "expert_distribution_recorder_buffer_size", "expert_distribution_recorder_mode",
            "experts_shared_outer_loras", "flashinfer_a2a_dispatch_type",
            "flashinfer_allreduce_fusion_backend", "flexkv_config_file", "forward_hooks",
            "hicache_host_memory_fraction", "hicache_host_memory_mode", "hicache_ratio",
            "hicache_size", "hicache_storage_backend", "hicache_storage_backend_extra_config",
            "hicache_storage_prefetch_policy", "hicache_storage_prefetch_retry_max_attempts",
            "hicache_storage_prefetch_retry_poll_interval", "kt_weight_path", "kv_canary",
            "kv_canary_real_data", "kv_canary_sweep_interval", "lmcache_config_file",
            "lora_backend", "lora_target_modules",
            "lora_use_virtual_experts", "mamba_full_memory_ratio", "mamba_radix_cache_strategy",
            "mamba_scheduler_strategy", "mamba_track_interval", "max_lora_chunk_size",
            "max_lora_rank", "max_loras_per_batch", "model_config_parser",
            "model_loader_extra_config", "modelopt_checkpoint_restore_path", "moe_dp_size",
            "msprobe_dump_config", "ple_offload_backend", "ple_offload_dir",
            "ple_offload_embedding", "prefill_kv_cache_dequant_dtype", "radix_cache_backend",
            "radix_eviction_policy_config", "return_aux_hidden_state_layer_ids",
            "return_hidden_states_mode", "rl_quant_profile", "strip_thinking_cache",
            "unified_cache_external_linker_backend", "unified_cache_external_linker_config",
        ),
    ),
}
# fmt: on
