"""The result row's columns: names, kinds and units, as data (no pyarrow here; `store` maps kinds to Arrow).

Config columns are not listed here: `store` derives them from the trial config's fields. What a trial's ranks
measure is one typed record, `TrialMetrics`; its fields are the measured metric columns, so a metric the worker
does not declare cannot be built, and a row with a key outside the schema is refused (`store.write_row`). What a
trial's rank 0 returns is one typed `RankResult`: those metrics, the provenance columns and the environment.
Units are in the names: *_s seconds, *_gib GiB (2**30 bytes), *_mhz, *_w, *_pct, *_gbps.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field

GIB = 2**30

# Column kinds; `store` turns each into an Arrow type.
NUMERIC_KINDS = ("int32", "int64", "float64")
INT32 = {"kind": "int32"}  # field metadata for the few integer columns stored as int32

IDENTITY_COLUMNS = [
    ("schema_version", "int32"), ("sweep", "string"), ("trial_id", "string"), ("attempt_id", "string"),
    ("config_id", "string"), ("repeat", "int32"), ("status", "string"), ("message", "string"),
    ("error_detail", "string"), ("executor", "string"), ("started_at", "timestamp"), ("ended_at", "timestamp"),
    ("trial_wall_s", "float64"),
]
DERIVED_COLUMNS = [
    ("world_size", "int32"), ("num_layers", "int32"), ("ac_blocks", "list<int32>"),
    ("axis_values_json", "string"), ("config_json", "string"),
]


@dataclass(frozen=True)
class TrialMetrics:
    """What a trial measured, reduced over its ranks (`raybench.runtime.rank_metrics.reduce_ranks` builds it).

    A user's own stack (`stack.kind` other than raybench) measures steps, tokens, losses and peaks with the probe;
    what only raybench's loop knows (phases, the build's own peaks and times) is null in its rows."""

    steps_timed: int = field(metadata=INT32)
    tokens_per_step: int
    nonpad_tokens_per_step: float
    step_time_p50_s: float
    step_time_p90_s: float
    step_time_mean_s: float
    step_time_std_s: float
    tok_per_s: float
    tok_per_s_per_device: float
    nonpad_tok_per_s: float
    nonpad_tok_per_s_per_device: float
    tflops_per_device: float | None
    mfu: float | None
    flops_per_token: float | None
    loss_first: float | None
    loss_final: float | None
    loss_by_step: list[float | None] | None  # every step's loss, warm-up included (reports.losses compares them)
    peak_rss_gib: float
    peak_alloc_gib: float | None
    peak_reserved_gib: float | None
    peak_rss_gib_by_rank: list[float]
    peak_alloc_gib_by_rank: list[float] | None
    peak_reserved_gib_by_rank: list[float] | None
    build_peak_rss_gib: float | None
    build_peak_alloc_gib: float | None
    build_peak_reserved_gib: float | None
    build_peak_rss_gib_by_rank: list[float] | None
    rss_before_build_gib_by_rank: list[float] | None
    host_held_gib: float
    params_total: int
    params_trainable: int | None  # null: a command stack's script did not report it (probe.count_params)
    model_build_s: float | None
    weights_cache: str | None
    weights_copy_s: float | None
    wrap_s: float | None
    warmup_s: float
    time_to_first_step_s: float | None
    timed_window_s: float
    first_step_s: float
    compile_s: float | None
    compile_graphs: int | None
    compile_graph_breaks: int | None
    compile_graph_break_reasons_json: str | None
    fp8_linears: int | None  # train.fp8: linears that ran in FP8 (null when off)
    fp8_linear_kinds_json: str | None
    fp8_flops_frac: float | None  # their share of flops_per_token
    # train.profile_steps: rank 0's profiled steps, seconds per step by category (null when off)
    profile_matmul_s: float | None
    profile_attention_s: float | None
    profile_elementwise_s: float | None
    profile_optimizer_s: float | None
    profile_comm_s: float | None
    profile_idle_s: float | None
    profile_step_s: float | None
    worker_wall_s: float
    process_trial_index: int
    phase_data_p50_s: float | None
    phase_data_p90_s: float
    phase_data_mean_s: float | None
    phase_data_std_s: float
    phase_forward_p50_s: float | None
    phase_forward_p90_s: float
    phase_forward_mean_s: float | None
    phase_forward_std_s: float
    phase_backward_p50_s: float | None
    phase_backward_p90_s: float
    phase_backward_mean_s: float | None
    phase_backward_std_s: float
    phase_optimizer_p50_s: float | None
    phase_optimizer_p90_s: float
    phase_optimizer_mean_s: float | None
    phase_optimizer_std_s: float
    phase_sum_over_step: float | None
    comm_exposed_p50_s: float | None
    comm_exposed_frac: float | None
    # The timed steps' collectives, from torch's flight recorder (runtime/collectives.py; null with one rank)
    comm_bus_gb_per_step: float | None
    comm_busbw_over_step_gbps: float | None
    comm_busbw_gbps: float | None  # over the profiled steps' collective time (train.profile_steps)
    comm_busbw_of_probe: float | None
    comm_busbw_of_link: float | None
    cpu_util_pct: float | None
    gpu_util_pct: float | None
    gpu_power_w: float | None
    gpu_sm_clock_mhz: float | None
    gpu_mem_clock_mhz: float | None
    step_time_p50_s_by_rank: list[float]  # each rank's own median step (alike: every rank waits for the slowest)
    local_time_p50_s_by_rank: list[float] | None  # each rank's median data + optimizer work (runtime.stragglers)
    slowest_rank: int | None
    slowest_rank_node: str | None
    straggler: bool | None
    straggler_why: str | None


# What a trial took of raybench's tokenized data (data.source hf): its rows as raybench's loop lays them out, or
# only the samples (a user's stack laid out its own rows, so the row's packing efficiency does not apply).
DataTaken = typing.Literal["rows", "samples"]


@dataclass(frozen=True)
class RankResult:
    """What a trial's rank 0 returns: the measurements and where and with what they were taken
    (`raybench.runtime.rank_metrics.rank_result` builds it; `raybench.drivers.trial.build_row` makes it the row).

    Ray pickles it as it is; it becomes plain data only at a process boundary (`to_dict`/`from_dict`: torchrun's
    result file)."""

    metrics: TrialMetrics
    provenance: dict  # the row's hardware and software columns by name (runtime.provenance.columns)
    env: dict[str, str]  # the ranks' allow-listed environment variables (runtime.fingerprint.captured_env): env_json
    system: str | None  # the label rows are compared by (runtime.fingerprint.system_label)
    stack_version: str | None  # a user's stack: what ran, with its libraries' versions; None: raybench's own loop
    data_taken: DataTaken | None  # what it took of raybench's tokenized data; None: neither (raybench's loop: rows)

    def to_dict(self) -> dict:
        """Plain data (JSON-ready): the metrics as a nested dict of their fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RankResult:
        """The result `to_dict` gave, back."""
        return cls(**{**data, "metrics": TrialMetrics(**data["metrics"])})

    @classmethod
    def from_columns(cls, columns: dict) -> RankResult:
        """A result from row columns by name, for rows whose measurements are made up (tests, the store's
        benchmarks): TrialMetrics fields left out are null; `env`, `system` and `stack_version` are those
        fields; every other column is a provenance column. The data taken is raybench's rows, as its loop's."""
        metric_names = [f.name for f in dataclasses.fields(TrialMetrics)]
        rest = {name: value for name, value in columns.items() if name not in metric_names}
        return cls(metrics=TrialMetrics(**{name: columns.get(name) for name in metric_names}),
                   env=rest.pop("env", {}), system=rest.pop("system", None),
                   stack_version=rest.pop("stack_version", None), data_taken="rows", provenance=rest)


# Metric columns a trial's row derives from its plan: the projected full run and the memory estimate.
PLAN_METRIC_COLUMNS = [
    ("projected_steps", "int64"), ("projected_hours", "float64"), ("projected_device_hours", "float64"),
    # The plan's memory/step-time estimate (raybench/planning/estimate.py) and, for ok rows, measured peak /
    # estimate - 1.
    ("est_peak_gib", "float64"), ("est_peak_calibrated_gib", "float64"), ("est_step_time_s", "float64"),
    ("est_peak_error", "float64"),
]
# What the tokens were (data.source hf): the dataset, its tokenized cache, and the trial's layout of it. The sweep's
# driver knows them before launch (spec.tokenized_data.TokenizedData.row_fields); null for other sources.
DATA_COLUMNS = [
    ("dataset_name", "string"), ("dataset_hash", "string"), ("data_cache_key", "string"), ("data_cache", "string"),
    ("data_build_s", "float64"), ("data_samples", "int64"), ("sample_tokens_mean", "float64"),
    ("sample_tokens_max", "int64"), ("packing_efficiency", "float64"),
    # What data.overflow leaves out at the trial's seq_len (data.packing.cut).
    ("samples_cut", "int64"), ("tokens_cut", "int64"), ("label_tokens_cut", "int64"),
    ("label_tokens_cut_frac", "float64"),
]
PROVENANCE_COLUMNS = [
    ("device_type", "string"), ("gpu_name", "string"), ("gpu_count", "int32"),
    ("gpu_memory_gib", "float64"), ("gpu_mem_clock_max_mhz", "float64"),
    ("gpu_sm_clock_max_mhz", "float64"), ("gpu_power_limit_w", "float64"), ("gpu_driver_version", "string"),
    ("gpu_topology", "string"), ("data_fs_type", "string"),
    ("allreduce_busbw_gbps", "float64"), ("allreduce_busbw_json", "string"),
    ("nccl_transports_json", "string"), ("nccl_transport_check", "string"),
    ("cpu_model", "string"), ("cpu_count", "int32"),
    ("ram_gib", "float64"), ("system", "string"), ("hostname", "string"), ("hostnames", "list<string>"),
    ("slurm_job_id", "string"), ("platform", "string"), ("env_json", "string"),
    ("torch_version", "string"), ("ray_version", "string"), ("transformers_version", "string"),
    ("peft_version", "string"), ("deepspeed_version", "string"), ("raybench_version", "string"),
    ("python_version", "string"), ("cuda_version", "string"), ("nccl_version", "string"),
    ("git_sha", "string"), ("stack_version", "string"),
]

_KINDS = {int: "int64", float: "float64", str: "string", bool: "bool"}


def _kind(annotation) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _kind(args[0])
    if typing.get_origin(annotation) is list:
        return f"list<{_kind(args[0])}>"
    return _KINDS[annotation]


def record_columns(record: type) -> list[tuple[str, str]]:
    """(column, kind) of each field of a dataclass record, in declaration order."""
    hints = typing.get_type_hints(record)
    return [(f.name, f.metadata.get("kind") or _kind(hints[f.name])) for f in dataclasses.fields(record)]


METRIC_COLUMNS = record_columns(TrialMetrics) + PLAN_METRIC_COLUMNS + DATA_COLUMNS
METRIC_NAMES = [name for name, _ in METRIC_COLUMNS]
# Measured on GPUs only: null in every CPU trial's row.
GPU_ONLY_METRICS = ("peak_alloc_gib", "peak_reserved_gib", "mfu", "gpu_util_pct", "gpu_power_w", "gpu_sm_clock_mhz",
                    "gpu_mem_clock_mhz")


def numeric_metric_names() -> list[str]:
    """Stored metric columns a search or `raybench best` can rank by (numbers, not per-rank lists)."""
    return [name for name, kind in METRIC_COLUMNS if kind in NUMERIC_KINDS]
