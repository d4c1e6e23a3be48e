"""Render the result-schema page (docs/schema.md) from store.SCHEMA itself, so the page cannot drift.

Column types come from the schema, meanings of configuration columns from the config models' field
descriptions, and every other meaning from DESCRIPTIONS below; units follow the name's suffix unless UNITS says
otherwise. A test checks that the page is current and that every column has a meaning:
`python -m raybench.results.schema_doc > docs/schema.md`.
"""

from __future__ import annotations

import pyarrow as pa
from pydantic import BaseModel

from raybench.results import store
from raybench.spec.sweep_spec import TrialConfig

DESCRIPTIONS = {
    # identity
    "schema_version": "Version of the row layout the file was written under (columns are only ever added within one).",
    "sweep": "Sweep name; the store partition `sweep=NAME`.",
    "trial_id": "`CONFIGHASH-rN`: content hash of the resolved trial config and the repeat index.",
    "attempt_id": ("Unique id of this attempt of the trial (TRIALID__STAMP; rows written in a batch add .i, rows of "
                   "files that predate the column read as FILESTEM#ROW); a re-run is a new attempt."),
    "config_id": "Content hash of the resolved trial config (equal across repeats, sweeps and sites).",
    "repeat": "Repeat index of the configuration (`repeats:` in the sweep).",
    "status": "ok, oom, error, timeout, invalid, skipped or interrupted (the sweep was stopped while the trial ran: "
              "SIGTERM at the end of an allocation, scancel, Ctrl-C; the next run runs it again).",
    "message": "One line saying why the trial did not end ok (empty when ok).",
    "error_detail": ("Failed trials: the end of the error text (the failing rank's traceback, or torchrun's log "
                     "tail), with secret values removed; null otherwise."),
    "executor": "How the ranks were started: train, pool or torchrun.",
    "started_at": "When the trial driver started the trial.",
    "ended_at": ("When the trial's row was built; the latest attempt of each measurement (trial id, sweep, system, "
                 "GPU type) wins."),
    "trial_wall_s": "Trial wall time seen by its driver, launch and teardown included.",
    # derived from the config
    "world_size": "Ranks of the trial (resources.workers): GPUs on GPU trials, worker processes on CPU.",
    "num_layers": "Decoder blocks of the model.",
    "ac_blocks": "0-based indices of the activation-checkpointed decoder blocks.",
    "axis_values_json": "The grid point: the sweep's axis values for this trial, as JSON.",
    "config_json": "The whole resolved trial config as canonical JSON.",
    # measurements
    "steps_timed": "Steps measured after the warm-up steps.",
    "tokens_per_step": "micro_batch × seq_len × grad_accum × data-parallel ranks (padding included).",
    "nonpad_tokens_per_step": "Non-padding tokens per timed step, all ranks together, as the batches held them.",
    "step_time_p50_s": "Median step time over the timed steps (a step lasts as long as its slowest rank).",
    "step_time_p90_s": "90th percentile step time.",
    "step_time_mean_s": "Mean step time.",
    "step_time_std_s": "Standard deviation of the step time.",
    "tok_per_s": ("Processed tokens (padding included) per second, all ranks together, over the timed window's real "
                  "elapsed time (timed_window_s)."),
    "tok_per_s_per_device": "tok_per_s / world_size: per GPU on GPU trials, per worker process on CPU.",
    "nonpad_tok_per_s": "Non-padding tokens per second, all ranks together.",
    "nonpad_tok_per_s_per_device": "nonpad_tok_per_s / world_size.",
    "tflops_per_device": "Model FLOP/s per device: tok_per_s_per_device × flops_per_token / 10¹².",
    "mfu": "Model FLOPs utilization: tflops_per_device / the GPU's dense peak; null on CPU and unknown GPUs.",
    "flops_per_token": "Model FLOPs per processed token, forward and backward (docs/metrics.md).",
    "loss_first": "Training loss of the first step, averaged over ranks.",
    "loss_final": "Training loss of the last step, averaged over ranks.",
    "loss_by_step": ("Training loss of every step, warm-up included, averaged over ranks (null where a user's stack "
                     "reported none): `raybench losses` compares points of one axis step by step."),
    "peak_rss_gib": ("Peak resident host memory of a rank during training (max over ranks), net of host_held_gib "
                     "and of library code first run in the window (docs/metrics.md)."),
    "peak_alloc_gib": ("Peak CUDA memory allocated by tensors (max over ranks), net of tensors still allocated "
                       "before the build (left by a warm pool actor's earlier trials; 0 fresh); null on CPU."),
    "peak_reserved_gib": ("Peak CUDA memory reserved by the caching allocator (max over ranks), net of the same; "
                          "null on CPU."),
    "peak_rss_gib_by_rank": "peak_rss_gib of every rank, in rank order.",
    "step_time_p50_s_by_rank": ("Each rank's own median step, in rank order: alike in a synchronous step, where "
                                "every rank waits for the slowest inside the collectives."),
    "local_time_p50_s_by_rank": ("Each rank's median local work per step, in rank order: loading its batch plus "
                                 "its optimizer step, the parts no collective waits in (null for a user's stack)."),
    "slowest_rank": "The rank with the most local work (local_time_p50_s_by_rank).",
    "slowest_rank_node": "The node of slowest_rank: its SLURM node name under SLURM, else its hostname.",
    "straggler": ("True when slowest_rank's local work is beyond the other ranks' median by more than 1/0.8 and by "
                  "5% of the step or more (raybench/runtime/stragglers.py); null for a user's stack."),
    "straggler_why": "What made slowest_rank a straggler, with its host and its share of the step.",
    "build_peak_rss_gib": ("Peak resident host memory of a rank during the model build (meta model, techniques, wrap, "
                           "its own values), max over ranks; peak_rss_gib covers training only."),
    "build_peak_alloc_gib": "Peak CUDA memory allocated during the model build (max over ranks); null on CPU.",
    "build_peak_reserved_gib": "Peak CUDA memory reserved during the model build (max over ranks); null on CPU.",
    "build_peak_rss_gib_by_rank": "build_peak_rss_gib of every rank, in rank order.",
    "rss_before_build_gib_by_rank": ("Resident host memory of every rank just before the model build, net of "
                                     "host_held_gib, in rank order."),
    "host_held_gib": ("Host memory a warm pool actor held from its earlier trials when this one began (its resident "
                      "memory then minus at its first trial: weights and data caches, libraries those trials "
                      "imported, allocator pages), max over ranks; 0 in a fresh process. The host figures above "
                      "are net of it, and resources.memory_limit_gib caps the trial's memory on top of it."),
    "peak_alloc_gib_by_rank": "peak_alloc_gib of every rank, in rank order.",
    "peak_reserved_gib_by_rank": "peak_reserved_gib of every rank, in rank order.",
    "params_total": "Parameters of the model (a QLoRA 4-bit weight counts its original shape, not its packed "
                    "storage).",
    "params_trainable": ("Parameters that receive gradients (LoRA adapters only under LoRA). A command stack: as its "
                         "script reported them to the probe (StepProbe.count_params); null where it did not, and "
                         "then flops_per_token and mfu are null too."),
    "model_build_s": ("Building the model and giving it its values (random init or a weights read; under sharding "
                      "strategies only the rank's own shards), slowest rank."),
    "weights_cache": "Pool executor: hit when the weights came from the actor's in-memory copy, else miss.",
    "weights_copy_s": "Copying a model directory to node-local disk before loading it.",
    "wrap_s": "Applying the strategy (sharding, wrapping, engine start), slowest rank.",
    "warmup_s": "Total time of the warm-up steps.",
    "timed_window_s": ("Real elapsed time of the timed steps: the earliest rank's start of the first timed step to "
                       "the latest rank's end of the last one (wall clock); throughput divides by it."),
    "process_trial_index": ("Trials the worker processes had run before this one: 0 for a fresh process (torchrun, "
                            "Ray Train), the warm pool actor's count otherwise."),
    "time_to_first_step_s": "Worker start to the end of the first step, slowest rank.",
    "first_step_s": "The first step (compilation and allocator warm-up included).",
    "compile_s": "First step's excess over the median step, when train.compile is on.",
    "compile_graphs": "Graphs dynamo compiled over the trial's steps (rank 0), when train.compile is on.",
    "compile_graph_breaks": ("Graph breaks dynamo met over the trial's steps (rank 0): each splits a compiled block, "
                             "and what is either side of it is fused apart. When train.compile is on."),
    "compile_graph_break_reasons_json": ("JSON: each graph break's reason (dynamo's heading and explanation) -> its "
                                         "count, the five most frequent; null without breaks."),
    "fp8_linears": ("Linear layers that ran their matmuls in FP8 (train.fp8, torchao's Float8Linear), counted over the "
                    "whole model; null when train.fp8 is off."),
    "fp8_linear_kinds_json": ("JSON: which linears ran in FP8, by name inside a decoder block (\"mlp.up_proj\"; under "
                              "LoRA \"mlp.up_proj.base_layer\"); the head and the adapters stay in bf16."),
    "fp8_flops_frac": ("Share of flops_per_token in the FP8 linears' matmuls. MFU stays on the bf16 peak. A frozen "
                       "LoRA base counts 4 FLOPs a weight a token, as flops_per_token does, though torchao also runs "
                       "its discarded weight gradient."),
    **{f"profile_{category}_s": (f"Step profile (train.profile_steps; rank 0, after the timed steps): {what} per "
                                 "profiled step; on CUDA the device's kernel time, on CPU the ops' self time. Null "
                                 "when train.profile_steps is 0 (docs/metrics.md, Step profile).")
       for category, what in (
           ("matmul", "mm, addmm, bmm, baddbmm, _scaled_mm, linear and their backward, GEMM kernels"),
           ("attention", "scaled-dot-product attention (flash, efficient, math) and its backward"),
           ("elementwise", "every other op or kernel: norms, activations, casts, copies, the loss"),
           ("optimizer", "everything inside torch.optim's optimizer step and zero_grad"),
           ("comm", "collectives (c10d, NCCL, gloo) and their waits"))},
    "profile_idle_s": ("Step profile: a profiled step's wall time the device left idle (CUDA: no kernel, memcpy or "
                       "memset running) or, on CPU, the step's thread spent outside any op (Python, the profiler's "
                       "own recording). Null when train.profile_steps is 0."),
    "profile_step_s": ("Step profile: wall time of a profiled step, the profiler's overhead included. On CPU the "
                       "profile_* categories and profile_idle_s add up to it; on CUDA to more, by the time kernels "
                       "overlapped (communication beside compute)."),
    "worker_wall_s": "Wall time of the benchmark in the rank-0 worker.",
    **{f"phase_{phase}_{stat}_s": f"{stat_text} per timed step of the {phase} phase ({what}), averaged over ranks."
       for phase, what in (("data", "waiting for the next batch and its copy to the device"),
                           ("forward", "FSDP2's all-gathers included"),
                           ("backward", "the gradient reduction DDP/FSDP2 overlap with it included"),
                           ("optimizer", "clipping, step, zeroing"))
       for stat, stat_text in (("p50", "Median"), ("p90", "90th percentile"), ("mean", "Mean"),
                               ("std", "Standard deviation"))},
    "phase_sum_over_step": "Sum of the phase means / mean step time (near 1 when the phases account for the step).",
    "comm_exposed_p50_s": "DDP: all-reduce time per step not hidden behind the backward pass; null otherwise.",
    "comm_exposed_frac": "comm_exposed_p50_s / step_time_p50_s.",
    "comm_bus_gb_per_step": ("Rank 0's collectives per step of the timed window, in bus bytes as nccl-tests sizes "
                             "them (an all-reduce's buffer times 2(n-1)/n, an all-gather's output or a "
                             "reduce-scatter's input times (n-1)/n), read from torch's flight recorder; null on one "
                             "rank (docs/metrics.md, Collectives)."),
    "comm_busbw_over_step_gbps": ("comm_bus_gb_per_step / step_time_p50_s: the least bus bandwidth the step needs; "
                                  "above allreduce_busbw_gbps it cannot have hidden its collectives."),
    "comm_busbw_gbps": ("comm_bus_gb_per_step / profile_comm_s: the bus bandwidth the collectives achieved over "
                        "their own time in the profiled steps (their waits included); null unless profiled."),
    "comm_busbw_of_probe": "comm_busbw_gbps / allreduce_busbw_gbps: the trial's collectives against its ranks' probe.",
    "comm_busbw_of_link": ("comm_busbw_gbps against the link's nominal rate in the hardware table: NVLink when every "
                           "rank is on one node, one NIC across nodes; null on CPUs."),
    "cpu_util_pct": "CPU utilization of each rank's process over the timed steps, averaged over ranks.",
    "gpu_util_pct": "GPU utilization (NVML) over the timed steps, averaged over ranks.",
    "gpu_power_w": "GPU power draw (NVML) over the timed steps, averaged over ranks.",
    "gpu_sm_clock_mhz": "GPU SM clock (NVML) over the timed steps, averaged over ranks.",
    "gpu_mem_clock_mhz": "GPU memory clock (NVML) over the timed steps, averaged over ranks.",
    "projected_steps": "Steps of the full run given in `projection:` (dataset tokens × epochs / real, non-padding "
                       "tokens per step, rounded up).",
    "projected_hours": "Hours of that run: dataset tokens × epochs / nonpad_tok_per_s (or total_steps × "
                       "tokens_per_step / tok_per_s).",
    "projected_device_hours": "projected_hours × world_size (GPU-hours on GPU trials).",
    "est_peak_gib": "The plan's raw peak-memory estimate per device.",
    "est_peak_calibrated_gib": "The estimate after calibration with earlier measured rows.",
    "est_step_time_s": ("The plan's step-time guess: FLOPs per step at an assumed 40% MFU of the GPU's peak; "
                        "null on CPU."),
    "est_peak_error": "ok rows: measured peak / the part of the raw estimate it covers − 1.",
    # the data (data.source hf and json; null otherwise)
    "dataset_name": "Last component of data.path.",
    "dataset_hash": "Content hash of the data files.",
    "data_cache_key": ("Key of the tokenized data in the store's cache: the hash of the data files, the tokenizer "
                       "files and the options that change the token ids."),
    "data_cache": "hit (the sweep found the data tokenized in the store) or build (the sweep tokenized it).",
    "data_build_s": ("Seconds the sweep's driver spent tokenizing the data before launch, shared by all its trials "
                     "and apart from every setup time; null on a hit."),
    "data_samples": "Records (samples) of the tokenized split.",
    "sample_tokens_mean": "Mean tokens per sample, before truncation to seq_len.",
    "sample_tokens_max": "Most tokens in one sample, before truncation to seq_len.",
    "packing_efficiency": ("Real tokens over the row positions they occupy at the trial's seq_len and layout "
                           "(data.packing, overflow, pack_order), over the whole dataset, each row counted seq_len "
                           "wide whatever data.pad_to: 1 is no padding (packed rows' tails and padded rows are "
                           "padding)."),
    "samples_cut": ("Samples longer than seq_len that data.overflow cut: truncate, those that lost their tail; "
                    "drop, those left out whole; split, 0 (none is cut, each is laid out in pieces)."),
    "tokens_cut": ("Tokens data.overflow left out of the whole dataset at the trial's seq_len: the truncated "
                   "tails (truncate) or the dropped samples (drop); 0 with split."),
    "label_tokens_cut": ("Label tokens (those the loss counts: the assistant's with data.loss_on assistant, every "
                         "one but a sample's first otherwise) data.overflow left out: in the truncated tails, in "
                         "the dropped samples, or (split) the first token of each piece after a sample's first, "
                         "which is never a label."),
    "label_tokens_cut_frac": ("label_tokens_cut over all the dataset's label tokens; above 0.01 the live view and "
                              "the trial's summary line say so."),
    # provenance
    "device_type": "cuda or cpu.",
    "gpu_name": "GPU model as CUDA reports it; null on CPU.",
    "gpu_count": "GPUs visible on rank 0's node.",
    "gpu_memory_gib": "Memory of one GPU.",
    "gpu_mem_clock_max_mhz": "Maximum GPU memory clock (NVML): the HBM generation shows here.",
    "gpu_sm_clock_max_mhz": "Maximum GPU SM clock (NVML).",
    "gpu_power_limit_w": "Enforced GPU power limit (NVML).",
    "gpu_driver_version": "NVIDIA driver version.",
    "gpu_topology": "`nvidia-smi topo -m` of rank 0's node (NV# = NVLink, PIX/PXB/PHB/NODE/SYS = PCIe paths).",
    "data_fs_type": "Filesystem type of the data (or model) path.",
    "allreduce_busbw_gbps": "Best all-reduce bus bandwidth over the trial's ranks (nccl-tests definition).",
    "allreduce_busbw_json": "Bus bandwidth per message size (MiB → GB/s), as JSON.",
    "nccl_transports_json": ("The transports NCCL's channels chose over every rank's communicators (P2P/CUMEM, "
                             "SHM/direct, NET/IB, NET/Socket…), the most nodes a communicator spans and the network "
                             "NCCL used, from its INIT log, as JSON; null on CPU."),
    "nccl_transport_check": ("'ok', 'fallback: WHAT (usual causes: VARS; set here: …)' when a collective ran on "
                             "sockets between nodes, or on the network or shared memory inside one, or why it "
                             "was not checked ('not checked (gloo)' on CPU)."),
    "cpu_model": "Host CPU model.",
    "cpu_count": "Host logical CPUs.",
    "ram_gib": "Host memory.",
    "system": "Label rows are grouped and compared by: RAYBENCH_SYSTEM, else the SLURM cluster name, else the host.",
    "hostname": "Host of rank 0.",
    "hostnames": "Hosts of all ranks.",
    "slurm_job_id": "SLURM job id, when run inside a job.",
    "platform": "Operating system, kernel release and Python implementation.",
    "env_json": "Allow-listed environment (NCCL_, CUDA_, OMP_, TORCH_, ...; no secrets), as JSON.",
    "torch_version": "PyTorch version.",
    "ray_version": "Ray version.",
    "transformers_version": "transformers version.",
    "peft_version": "PEFT version.",
    "deepspeed_version": "DeepSpeed version.",
    "raybench_version": "raybench version.",
    "python_version": "Python version.",
    "cuda_version": "CUDA runtime version torch was built with; null on CPU builds.",
    "nccl_version": "NCCL version; null without CUDA.",
    "git_sha": "Commit of the raybench checkout, when run from one.",
    "stack_version": "The user's training stack and its libraries' versions (e.g. 'transformers 5.23.0, trl 1.16.0'); "
                     "null for raybench's own loop (stack_kind raybench).",
}
# Units a suffix rule would get wrong or cannot know.
UNITS = {
    "tok_per_s": "tokens/s", "nonpad_tok_per_s": "tokens/s",
    "tok_per_s_per_device": "tokens/s per device", "nonpad_tok_per_s_per_device": "tokens/s per device",
    "tflops_per_device": "TFLOP/s", "flops_per_token": "FLOP/token", "mfu": "fraction (0–1)",
    "tokens_per_step": "tokens", "nonpad_tokens_per_step": "tokens", "sample_tokens_mean": "tokens",
    "sample_tokens_max": "tokens", "data_samples": "samples", "packing_efficiency": "fraction (0–1)",
    "samples_cut": "samples", "tokens_cut": "tokens", "label_tokens_cut": "tokens",
    "label_tokens_cut_frac": "fraction (0–1)",
    "steps_timed": "steps", "projected_steps": "steps", "projected_hours": "h",
    "projected_device_hours": "device-hours", "phase_sum_over_step": "ratio", "est_peak_error": "fraction",
    "loss_first": "nats", "loss_final": "nats", "loss_by_step": "nats",
    "train_seq_len": "tokens", "train_micro_batch": "sequences",
    "train_steps": "steps", "train_warmup_steps": "steps", "resources_cpus_per_worker": "CPUs",
    "compile_graphs": "graphs", "compile_graph_breaks": "breaks", "fp8_linears": "linears",
}
_SUFFIX_UNITS = (("_gib_by_rank", "GiB"), ("_gib", "GiB"), ("_mhz", "MHz"), ("_pct", "%"), ("_gbps", "GB/s"),
                 ("_frac", "fraction"), ("_w", "W"), ("_s", "s"))
SECTIONS = (
    ("Identity", store.IDENTITY_COLUMNS),
    ("Configuration (one column per trial-config field, `section_field`)", [(c, t) for c, _, t in
                                                                           store.CONFIG_COLUMNS]),
    ("Derived from the configuration", store.DERIVED_COLUMNS),
    ("Measurements (rank 0's summary of all ranks; null when not measured)", store.METRIC_COLUMNS),
    ("Provenance (hardware and software fingerprint)", store.PROVENANCE_COLUMNS),
)


def unit_of(column: str, arrow_type: pa.DataType) -> str:
    if column in UNITS:
        return UNITS[column]
    if pa.types.is_timestamp(arrow_type):
        return "UTC, µs"
    return next((unit for suffix, unit in _SUFFIX_UNITS if column.endswith(suffix)), "")


def type_name(arrow_type: pa.DataType) -> str:
    if pa.types.is_list(arrow_type):
        return f"list<{type_name(arrow_type.value_type)}>"
    return {"double": "float64", "timestamp[us, tz=UTC]": "timestamp"}.get(str(arrow_type), str(arrow_type))


def _config_descriptions(model: type[BaseModel] = TrialConfig) -> dict[tuple, str]:
    """Path into the trial config → the field's description."""
    out = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out.update({(name, *path): text for path, text in _config_descriptions(field.annotation).items()})
        else:
            out[(name,)] = field.description or ""
    return out


def descriptions() -> dict[str, str]:
    """Every column's meaning: config columns from the config models, the others from DESCRIPTIONS."""
    from_config = _config_descriptions()
    config = {column: f"`{'.'.join(path)}`: {from_config.get(path, '')}" for column, path, _ in store.CONFIG_COLUMNS}
    return {**DESCRIPTIONS, **config}


def undescribed() -> list[str]:
    known = descriptions()
    return [name for name in store.SCHEMA.names if not known.get(name)]


def render() -> str:
    known = descriptions()
    lines = [
        "# Result schema",
        "",
        "Generated from `raybench/results/store.py` (`python -m raybench.results.schema_doc > docs/schema.md`).",
        f"Every trial attempt is one row (schema version {store.SCHEMA_VERSION}) in `STORE/sweep=NAME/*.parquet`;",
        "unknown values are null, never guessed. Read with `raybench.read_results`, `raybench query`, DuckDB,",
        "pandas or polars (docs/user-guide.md). How the measurements are taken: docs/metrics.md.",
    ]
    for title, columns in SECTIONS:
        lines += ["", f"## {title}", "", "| column | type | unit | meaning |", "| --- | --- | --- | --- |"]
        lines += [f"| `{name}` | {type_name(t)} | {unit_of(name, t)} | {known.get(name, '')} |" for name, t in columns]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
