"""The result store: one Parquet file per trial attempt, written atomically, under a fixed versioned schema.

Layout: STORE/sweep=NAME/TRIALID__STAMP.parquet. A file appears whole or not at all (temp file in the same
directory, fsync, rename), so readers never see partial rows and a killed writer leaves only a dot-file that
readers skip. Re-running a trial adds a new attempt file; `read_results` returns the latest attempt per
trial id unless asked for all of them.
"""

from __future__ import annotations

import json
import os
import time
import types
import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel

from raybench.config import TRIAL_SECTIONS, TrialConfig

SCHEMA_VERSION = 1
DEFAULT_STORE = "./raybench-results"


def _arrow_type(annotation) -> pa.DataType:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _arrow_type(args[0])
    if origin is typing.Literal or origin is typing.Annotated or annotation is str:
        return pa.string()
    return {bool: pa.bool_(), int: pa.int64(), float: pa.float64()}[annotation]


def config_fields(model: type[BaseModel] = TrialConfig, prefix: str = "") -> list[tuple[str, tuple, pa.DataType]]:
    """(column name, path into the config, arrow type) for every leaf field of a trial config."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += [(col, (name, *path), t) for col, path, t in config_fields(ann, f"{prefix}{name}_")]
        elif typing.get_origin(ann) is dict:
            # A mapping (train.env) has no fixed keys to become columns: it is stored as sorted-key JSON text.
            out.append((f"{prefix}{name}_json", (name,), pa.string()))
        else:
            out.append((f"{prefix}{name}", (name,), _arrow_type(ann)))
    return out


CONFIG_COLUMNS = config_fields()

IDENTITY_COLUMNS = [
    ("schema_version", pa.int32()), ("sweep", pa.string()), ("trial_id", pa.string()),
    ("config_id", pa.string()), ("repeat", pa.int32()), ("status", pa.string()), ("message", pa.string()),
    ("executor", pa.string()), ("started_at", pa.timestamp("us", tz="UTC")), ("ended_at", pa.timestamp("us", tz="UTC")),
    ("trial_wall_s", pa.float64()),
]
DERIVED_COLUMNS = [
    ("world_size", pa.int32()), ("num_layers", pa.int32()), ("ac_blocks", pa.list_(pa.int32())),
    ("axis_values_json", pa.string()), ("config_json", pa.string()),
]
METRIC_COLUMNS = [
    ("steps_timed", pa.int32()), ("tokens_per_step", pa.int64()),
    ("step_time_p50_s", pa.float64()), ("step_time_p90_s", pa.float64()),
    ("step_time_mean_s", pa.float64()), ("step_time_std_s", pa.float64()),
    ("tok_per_s", pa.float64()), ("tok_per_s_per_device", pa.float64()),
    ("nonpad_tok_per_s", pa.float64()), ("nonpad_tok_per_s_per_device", pa.float64()),
    ("tflops_per_device", pa.float64()), ("mfu", pa.float64()), ("flops_per_token", pa.float64()),
    ("loss_first", pa.float64()), ("loss_final", pa.float64()),
    ("peak_rss_gib", pa.float64()), ("peak_alloc_gib", pa.float64()), ("peak_reserved_gib", pa.float64()),
    ("peak_rss_gib_by_rank", pa.list_(pa.float64())), ("peak_alloc_gib_by_rank", pa.list_(pa.float64())),
    ("peak_reserved_gib_by_rank", pa.list_(pa.float64())),
    ("params_total", pa.int64()), ("params_trainable", pa.int64()),
    ("model_build_s", pa.float64()), ("wrap_s", pa.float64()), ("warmup_s", pa.float64()),
    ("time_to_first_step_s", pa.float64()), ("first_step_s", pa.float64()), ("compile_s", pa.float64()),
    ("worker_wall_s", pa.float64()),
    *[(f"phase_{phase}_{stat}_s", pa.float64())
      for phase in ("data", "forward", "backward", "optimizer") for stat in ("p50", "p90", "mean", "std")],
    ("phase_sum_over_step", pa.float64()),
    ("cpu_util_pct", pa.float64()), ("gpu_util_pct", pa.float64()), ("gpu_power_w", pa.float64()),
    ("gpu_sm_clock_mhz", pa.float64()), ("gpu_mem_clock_mhz", pa.float64()),
    ("projected_steps", pa.int64()), ("projected_hours", pa.float64()), ("projected_device_hours", pa.float64()),
]
PROVENANCE_COLUMNS = [
    ("device_type", pa.string()), ("gpu_name", pa.string()), ("gpu_count", pa.int32()),
    ("gpu_memory_gib", pa.float64()), ("gpu_mem_clock_max_mhz", pa.float64()),
    ("gpu_sm_clock_max_mhz", pa.float64()), ("gpu_power_limit_w", pa.float64()), ("gpu_driver_version", pa.string()),
    ("gpu_topology", pa.string()), ("data_fs_type", pa.string()),
    ("allreduce_busbw_gbps", pa.float64()), ("allreduce_busbw_json", pa.string()), ("cpu_model", pa.string()), ("cpu_count", pa.int32()),
    ("ram_gib", pa.float64()), ("hostname", pa.string()), ("hostnames", pa.list_(pa.string())),
    ("slurm_job_id", pa.string()), ("platform", pa.string()), ("env_json", pa.string()),
    ("torch_version", pa.string()), ("ray_version", pa.string()), ("transformers_version", pa.string()),
    ("peft_version", pa.string()), ("deepspeed_version", pa.string()), ("raybench_version", pa.string()),
    ("python_version", pa.string()), ("cuda_version", pa.string()), ("nccl_version", pa.string()),
    ("git_sha", pa.string()),
]

SCHEMA = pa.schema(
    IDENTITY_COLUMNS + [(c, t) for c, _, t in CONFIG_COLUMNS] + DERIVED_COLUMNS + METRIC_COLUMNS + PROVENANCE_COLUMNS,
    metadata={"raybench_schema_version": str(SCHEMA_VERSION)},
)
METRIC_NAMES = [name for name, _ in METRIC_COLUMNS]


def flatten_config(config: dict) -> dict:
    """Config columns of a row from a trial config as plain data."""
    row = {}
    for col, path, _ in CONFIG_COLUMNS:
        node = config
        for part in path:
            node = node[part]
        row[col] = json.dumps(node, sort_keys=True) if isinstance(node, dict) else node
    return row


def _check_row(row: dict) -> None:
    unknown = set(row) - set(SCHEMA.names)
    if unknown:
        raise ValueError(f"row has columns outside the schema: {sorted(unknown)}")
    for col in ("sweep", "trial_id", "status"):
        if not row.get(col):
            raise ValueError(f"row needs a non-empty '{col}'")


def sweep_dir(store: str | Path, sweep: str) -> Path:
    return Path(store) / f"sweep={sweep}"


def write_row(store: str | Path, row: dict) -> Path:
    """Atomically write one result row as its own Parquet file; returns the file's path."""
    _check_row(row)
    row = {"schema_version": SCHEMA_VERSION, **row}
    table = pa.Table.from_pylist([row], schema=SCHEMA)
    directory = sweep_dir(store, row["sweep"])
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    final = directory / f"{row['trial_id']}__{time.time_ns()}_{os.getpid()}.parquet"
    tmp = directory / f".{final.name}.tmp"
    with open(tmp, "wb") as f:
        pq.write_table(table, f)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o644)  # results are shared read-only; nobody else may rewrite them
    os.replace(tmp, final)
    return final


def result_files(store: str | Path, sweep: str | None = None) -> list[Path]:
    """Committed result files (temp files of in-flight or killed writers start with a dot and are skipped)."""
    root = Path(store)
    pattern = f"sweep={sweep}/*.parquet" if sweep else "sweep=*/*.parquet"
    return sorted(p for p in root.glob(pattern) if not p.name.startswith("."))


def read_table(store: str | Path, sweep: str | None = None, latest: bool = True) -> pa.Table:
    """All rows as one Arrow table under the current schema (older files gain null columns)."""
    files = result_files(store, sweep)
    if not files:
        return SCHEMA.empty_table()
    # Files written under one schema are concatenated first and conformed once: conforming each one-row file
    # on its own cost ~9 ms a file (minutes for a store of thousands of rows).
    groups: list[tuple[pa.Schema, list[pa.Table]]] = []
    for f in files:
        table = _read_file(f)
        same = next((g for s, g in groups if s.equals(table.schema, check_metadata=True)), None)
        if same is None:
            groups.append((table.schema, [table]))
        else:
            same.append(table)
    table = pa.concat_tables([_conform(pa.concat_tables(g)) for _, g in groups])
    if latest:
        table = _latest_per_trial(table)
    return table


def _read_file(path: Path) -> pa.Table:
    # ParquetFile.read skips the dataset discovery that pq.read_table does per call (~2x faster per file).
    with pq.ParquetFile(path) as f:
        return f.read()


def _conform(table: pa.Table) -> pa.Table:
    """Cast a file's table to the current schema: missing columns become null, extra ones are dropped."""
    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
        for f in SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def _latest_per_trial(table: pa.Table) -> pa.Table:
    if len(table) == 0:
        return table
    order = table.sort_by([("trial_id", "ascending"), ("ended_at", "ascending")])
    ids = order.column("trial_id").to_pylist()
    keep = [i for i in range(len(ids)) if i == len(ids) - 1 or ids[i] != ids[i + 1]]
    return order.take(keep)


def read_results(store: str | Path = DEFAULT_STORE, sweep: str | None = None, latest: bool = True):
    """Result rows as a pandas DataFrame (latest attempt per trial id unless latest=False)."""
    return read_table(store, sweep, latest).to_pandas()


def ok_trial_ids(store: str | Path, sweep: str) -> set[str]:
    table = read_table(store, sweep, latest=False)
    ids = table.column("trial_id").to_pylist()
    statuses = table.column("status").to_pylist()
    return {i for i, s in zip(ids, statuses) if s == "ok"}


def json_column(value) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)
