"""The result store: one Parquet file per trial attempt, written atomically, under a fixed versioned schema.

Layout: STORE/sweep=NAME/TRIALID__STAMP.parquet. A file appears whole or not at all (temp file in the same
directory, fsync, rename), so readers never see partial rows and a killed writer leaves only a dot-file that
readers skip. Re-running a trial adds a new attempt file; `read_results` returns the latest attempt of each
measurement (a trial id in a sweep on a system and GPU type: MEASUREMENT_SQL) unless asked for all of them.

Bulk imports (`write_rows`) write `batch-STAMP.parquet` files, compaction `compacted-STAMP.parquet` files.
Every row carries a unique `attempt_id` (a one-row file's stem; files from before that column get
`STEM#ROW`). Compaction (`raybench.results.compaction`) merges many files into one and deletes the originals only
after the merged file is committed, so a reader may briefly see a row in two files: readers keep one row
per attempt_id, and re-list when a listed file has vanished (its rows are then in a committed merged file).

Schema evolution: a file lacking some of this version's columns reads with nulls there; columns this version
does not know (written by a newer raybench) are dropped by `read_table` but kept in the files, by compaction
too, and visible to `raybench query`. Adding a column does not bump SCHEMA_VERSION; renaming or retyping does.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import time
import types
import typing
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import BaseModel

from raybench.spec import options, schema
from raybench.spec.sweep_spec import TrialConfig, config_id

SCHEMA_VERSION = 1
DEFAULT_STORE = "./raybench-results"


def _arrow_type(annotation) -> pa.DataType:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _arrow_type(args[0])
    if origin is typing.Literal or origin is typing.Annotated or annotation is str:
        return pa.string()
    if origin is list:
        return pa.list_(_arrow_type(args[0]))
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

_ARROW = {"int32": pa.int32(), "int64": pa.int64(), "float64": pa.float64(), "string": pa.string(),
          "bool": pa.bool_(), "timestamp": pa.timestamp("us", tz="UTC"), "list<int32>": pa.list_(pa.int32()),
          "list<float64>": pa.list_(pa.float64()), "list<string>": pa.list_(pa.string())}


def _arrow(columns: list[tuple[str, str]]) -> list[tuple[str, pa.DataType]]:
    return [(name, _ARROW[kind]) for name, kind in columns]


IDENTITY_COLUMNS = _arrow(schema.IDENTITY_COLUMNS)
DERIVED_COLUMNS = _arrow(schema.DERIVED_COLUMNS)
METRIC_COLUMNS = _arrow(schema.METRIC_COLUMNS)
PROVENANCE_COLUMNS = _arrow(schema.PROVENANCE_COLUMNS)

SCHEMA = pa.schema(
    IDENTITY_COLUMNS + [(c, t) for c, _, t in CONFIG_COLUMNS] + DERIVED_COLUMNS + METRIC_COLUMNS + PROVENANCE_COLUMNS,
    metadata={"raybench_schema_version": str(SCHEMA_VERSION)},
)
METRIC_NAMES = schema.METRIC_NAMES


def flatten_config(config: dict) -> dict:
    """Config columns of a row from a trial config as plain data."""
    row = {}
    for col, path, _ in CONFIG_COLUMNS:
        node = config
        for part in path:  # a field the config dump leaves out while unset (train.ac_saved_ops) is null
            node = node.get(part) if node is not None else None
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
    directory = sweep_dir(store, row["sweep"])
    final = directory / f"{row['trial_id']}__{file_stamp()}.parquet"
    row = {"schema_version": SCHEMA_VERSION, **row, "attempt_id": final.stem}
    write_file_atomic(final, pa.Table.from_pylist([row], schema=SCHEMA))
    return final


def write_rows(store: str | Path, rows: list[dict]) -> list[Path]:
    """Atomically write many rows, one file per sweep (bulk imports; a sweep's trials use write_row)."""
    for row in rows:
        _check_row(row)
    paths = []
    for sweep in dict.fromkeys(row["sweep"] for row in rows):
        stamp = file_stamp()
        batch = [{"schema_version": SCHEMA_VERSION, **row, "attempt_id": f"{row['trial_id']}__{stamp}.{i}"}
                 for i, row in enumerate(r for r in rows if r["sweep"] == sweep)]
        path = sweep_dir(store, sweep) / f"batch-{stamp}.parquet"
        write_file_atomic(path, pa.Table.from_pylist(batch, schema=SCHEMA))
        paths.append(path)
    return paths


def file_stamp() -> str:
    return f"{time.time_ns()}_{os.getpid()}"


class StoreWriteError(OSError):
    """A result file could not be written (a full filesystem, a quota, no permission): the message names the file,
    the operating system's reason and the space left there. Nothing of the file is left behind."""


def write_file_atomic(final: Path, table: pa.Table) -> None:
    """Write `table` to `final` so that it appears whole or not at all (dot-temp file, fsync, rename).
    Raises StoreWriteError when it cannot, after removing the temp file (a full disk leaves it empty or torn)."""
    tmp = final.parent / f".{final.name}.tmp"
    try:
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        with open(tmp, "wb") as f:
            pq.write_table(table, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # results are shared read-only; nobody else may rewrite them
        os.replace(tmp, final)
    except OSError as err:
        _remove(tmp)
        raise StoreWriteError(f"cannot write the result file {final}: {err.strerror or err}; "
                              f"{_space_left(final.parent)}") from err
    except BaseException:  # Ctrl-C, SIGTERM as Terminated: no temp file either
        _remove(tmp)
        raise


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):  # the reason the write failed is the error to report, not this one
        path.unlink(missing_ok=True)


def _space_left(directory: Path) -> str:
    """The free space of the filesystem holding `directory` (or its nearest existing parent), in words."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    try:
        usage = shutil.disk_usage(directory)
    except OSError as err:
        return f"free space of {directory} unknown ({err.strerror or err})"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB on the filesystem of {directory}"


def result_files(store: str | Path, sweep: str | None = None) -> list[Path]:
    """Committed result files (temp files of in-flight or killed writers start with a dot and are skipped)."""
    root = Path(store)
    pattern = f"sweep={sweep}/*.parquet" if sweep else "sweep=*/*.parquet"
    return sorted(p for p in root.glob(pattern) if not p.name.startswith("."))


def trial_row_files(store: str | Path, sweep: str, trial_id: str) -> list[Path]:
    """The committed row files write_row wrote for one trial (its attempts; a batch or compacted file holding
    some of them is not looked into)."""
    return sorted(sweep_dir(store, sweep).glob(f"{glob.escape(trial_id)}__*.parquet"))


def trial_id_of(path: Path) -> str | None:
    """The trial id of a row file write_row named (TRIALID__STAMP.parquet): known from a listing, without a read.
    None for a file of many rows (batch-STAMP, compacted-STAMP)."""
    trial_id, separator, _ = path.stem.rpartition("__")
    return trial_id if separator else None


def read_table(store: str | Path, sweep: str | None = None, latest: bool = True) -> pa.Table:
    """All rows as one Arrow table under the current schema (older files gain null columns), one row per
    attempt_id; with `latest`, only the latest attempt of each measurement (MEASUREMENT_SQL)."""
    tables = _read_all(store, sweep)
    if not tables:
        return SCHEMA.empty_table()
    table = unique_attempts(conform_all(tables))
    if latest:
        table = latest_per_trial(table)
    return table


def _read_all(store: str | Path, sweep: str | None) -> list[pa.Table]:
    """Every committed file's rows. A compaction deletes files only after the merged file holding their rows is
    committed: when a listed file is gone, listing again finds its rows (rows read twice are deduplicated)."""
    read: dict[Path, pa.Table] = {}
    while True:
        vanished = False
        for path in result_files(store, sweep):
            if path in read:
                continue
            try:
                read[path] = read_file(path)
            except FileNotFoundError:
                vanished = True
        if not vanished:
            return list(read.values())


def read_table_since(attempts: pa.Table, listed: set[Path], store: str | Path, sweep: str) -> pa.Table:
    """read_table(store, sweep) now, without reading the store again: `attempts` is read_table(store, latest=False)
    read after the sweep's files were `listed` (result_files), and only the files committed since are read (a file
    committed between the listing and that read is read twice; its rows count once)."""
    added = []
    for path in result_files(store, sweep):
        if path in listed:
            continue
        try:
            added.append(read_file(path))
        except FileNotFoundError:  # a compaction merged it into a file listed after it: read the sweep whole
            return read_table(store, sweep)
    earlier = attempts.filter(pc.equal(attempts.column("sweep"), sweep))
    return latest_per_trial(unique_attempts(conform_all([earlier, *added])))


def row_status(path: Path) -> dict:
    """The status and ended_at of a one-row file (trial_row_files), read without the rest of the row."""
    with pq.ParquetFile(path) as f:
        return f.read(columns=["status", "ended_at"]).to_pylist()[0]


def write_document(path: Path, document: dict, indent: int | None = None) -> Path:
    """Atomically write one of the store's JSON documents (a rehearsal, a device profile), replacing the earlier."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(document, indent=indent, sort_keys=True))
    tmp.replace(path)
    return path


def read_document(path: Path) -> dict:
    return json.loads(path.read_text())


def read_file(path: Path) -> pa.Table:
    """One committed file's rows, each with its attempt_id (`STEM#ROW` for files from before that column)."""
    # ParquetFile.read skips the dataset discovery that pq.read_table does per call (~2x faster per file).
    with pq.ParquetFile(path) as f:
        table = f.read()
    if "attempt_id" in table.column_names and not table.column("attempt_id").null_count:
        return table
    derived = pa.array([f"{path.stem}#{i}" for i in range(len(table))], pa.string())
    if "attempt_id" not in table.column_names:
        return table.append_column("attempt_id", derived)
    position = table.column_names.index("attempt_id")
    return table.set_column(position, "attempt_id", pc.coalesce(table.column("attempt_id"), derived))


def conform_all(tables: list[pa.Table], keep_unknown: bool = False) -> pa.Table:
    """Concatenate file tables under the current schema: missing columns become null; columns this version does
    not know are dropped, or kept after the known ones with `keep_unknown` (compaction must not lose them)."""
    # Files written under one schema are concatenated first and conformed once: conforming each one-row file
    # on its own cost ~9 ms a file (minutes for a store of thousands of rows).
    groups: list[tuple[pa.Schema, list[pa.Table]]] = []
    for table in tables:
        same = next((g for s, g in groups if s.equals(table.schema, check_metadata=True)), None)
        if same is None:
            groups.append((table.schema, [table]))
        else:
            same.append(table)
    conformed = [_conform(pa.concat_tables(g), keep_unknown) for _, g in groups]
    return pa.concat_tables(conformed, promote_options="permissive").replace_schema_metadata(SCHEMA.metadata)


def _conform(table: pa.Table, keep_unknown: bool) -> pa.Table:
    columns = [
        table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
        for f in SCHEMA
    ]
    fields = list(SCHEMA)
    if keep_unknown:
        unknown = [f for f in table.schema if f.name not in SCHEMA.names]
        columns += [table.column(f.name) for f in unknown]
        fields += unknown
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=SCHEMA.metadata))


def unique_attempts(table: pa.Table) -> pa.Table:
    """One row per attempt_id (the first seen): a row is in two files while a compaction is deleting them."""
    if pc.count_distinct(table.column("attempt_id")).as_py() == len(table):
        return table
    numbered = table.append_column("_row", pa.array(range(len(table)), pa.int64()))
    first = numbered.group_by("attempt_id").aggregate([("_row", "min")]).column("_row_min")
    return table.take(pc.take(first, pc.sort_indices(first)))  # in their original order


# One measurement: the latest attempt of a trial id in its sweep, on its system (the `system` label, else the host)
# and its GPU type. Every view of the store keeps these (read_results, `raybench query`'s `trials` view, report,
# best, compare): a retry or a re-run replaces the attempt before it; the same configuration stored by two sweeps,
# or measured on two systems or two GPU types, is two measurements (repeats of one configuration), never one
# hiding the other. Trial ids do not name the hardware: the same sweep run at two sites gives the same ids.
MEASUREMENT_SQL = ("sweep, coalesce(system, hostname, 'unknown'), coalesce(gpu_name, 'cpu'), trial_id")


def measurement_keys(table: pa.Table) -> pa.Array:
    """Each row's measurement (MEASUREMENT_SQL) as one string."""
    def filled(name: str, fallback: str) -> pa.ChunkedArray:
        return pc.fill_null(table.column(name).cast(pa.string()), fallback)

    system = pc.coalesce(table.column("system").cast(pa.string()), table.column("hostname").cast(pa.string()),
                         pa.scalar("unknown"))
    parts = [table.column("sweep"), system, filled("gpu_name", "cpu"), table.column("trial_id")]
    return pc.binary_join_element_wise(*parts, "\x1f")


def latest_per_trial(table: pa.Table) -> pa.Table:
    """The latest attempt of each measurement (MEASUREMENT_SQL): greatest ended_at (unknown counts as oldest),
    then attempt_id."""
    if len(table) == 0:
        return table
    # Sort the key columns only, then take the kept rows once (sorting the whole table moved every
    # column twice). An unknown end sorts first (null placement per sort key needs pyarrow >= 25).
    ended = pc.fill_null(table.column("ended_at"), pa.scalar(0, table.schema.field("ended_at").type))
    keys = pa.table({"trial": measurement_keys(table), "attempt_id": table.column("attempt_id"), "ended": ended})
    order = pc.sort_indices(keys, sort_keys=[("trial", "ascending"), ("ended", "ascending"),
                                             ("attempt_id", "ascending")])
    ids = pc.take(keys.column("trial"), order).combine_chunks()
    last_of_trial = pa.concat_arrays([pc.not_equal(ids.slice(0, len(ids) - 1), ids.slice(1)), pa.array([True])])
    return table.take(pc.filter(order, last_of_trial))


def read_results(store: str | Path = DEFAULT_STORE, sweep: str | None = None, latest: bool = True):
    """Result rows as a pandas DataFrame (the latest attempt of each measurement unless latest=False)."""
    return read_table(store, sweep, latest).to_pandas()


def attempt_statuses(store: str | Path, sweep: str, executor: str | None = None) -> dict[str, set[str]]:
    """trial id -> the statuses of all its stored attempts in `sweep`; with `executor`, only the attempts run by
    that executor, and the plan's rows (invalid, skipped), which no executor ran."""
    return statuses_by_trial(read_table(store, sweep, latest=False), sweep, executor)


def statuses_by_trial(attempts: pa.Table, sweep: str, executor: str | None = None) -> dict[str, set[str]]:
    """attempt_statuses over attempts already read (read_table(store, latest=False), of any sweeps), each attempt
    under the id of what it measured (measured_trial_id)."""
    statuses: dict[str, set[str]] = {}
    columns = (attempts.column(c).to_pylist() for c in ("sweep", "trial_id", "status", "executor", "config_json"))
    for in_sweep, trial_id, status, ran_by, config_json in zip(*columns):
        if in_sweep == sweep and (executor is None or ran_by in (None, executor)):
            statuses.setdefault(measured_trial_id(trial_id, config_json), set()).add(status)
    return statuses


def measured_trial_id(trial_id: str, config_json: str | None) -> str:
    """The id of the trial a stored row measured. Ids leave an option out at the values the trials before it ran
    with (spec/options.py), but a row from before an option whose `before` is not one of them (train.loss: the
    full loss, where ids leave out chunked) ran something else than its id now stands for: it answers for the id
    of what it ran, so a resume never takes it for today's trial."""
    if not config_json or not options.ran_other_than_its_id(config_json):
        return trial_id
    repeat = trial_id.rpartition("-")[2]
    try:
        return f"{config_id(measured_trial_config(config_json))}-{repeat}"
    except ValueError:  # a row older than the fields it would need: its id is all it says
        return trial_id


def ok_trial_ids(store: str | Path, sweep: str) -> set[str]:
    return {i for i, statuses in attempt_statuses(store, sweep).items() if "ok" in statuses}


def json_column(value) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def measured_trial_config(config_json: str) -> TrialConfig:
    """The trial config a stored row measured, from its config_json (to rehearse it again, say).

    Rows from before train.lora.base_dtype existed do not hold it. Their LoRA base was fp32 under ddp, fsdp2 and
    tp, and under deepspeed the compute dtype (DeepSpeed casts the whole model: auto). Read as written, such a
    row would default to auto and stand for a 16-bit base it never had. Likewise a row from before any option of
    spec/options.py ran that option's `before` (train.loss: full, where the default is now auto)."""
    config = json.loads(config_json)
    train = options.with_older_values(config.setdefault("train", {}))
    if train.get("finetune") == "lora" and train.get("strategy", "ddp") != "deepspeed":
        train.setdefault("lora", {}).setdefault("base_dtype", "fp32")
    return TrialConfig.model_validate(config)
