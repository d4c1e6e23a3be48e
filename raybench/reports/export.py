"""Export stored rows to the experiment trackers people already use: MLflow and Weights & Biases (offline).

One tracker run per trial row: config columns as parameters, numeric measurements as metrics, identity and
fingerprint as tags. Exports are idempotent: every run carries the store's attempt id, and an attempt already
in the tracker is skipped, so exporting a growing store again only adds the new rows.
Both packages are optional (`pip install 'raybench[trackers]'`); nothing here ever needs the network except
an MLflow tracking server the user names.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

import pandas as pd
import pyarrow as pa

from raybench.reports import frames
from raybench.results import store
from raybench.spec.errors import ConfigError, Problem

ATTEMPT_TAG = "raybench.attempt"
_PARAM_COLUMNS = [name for name, _, _ in store.CONFIG_COLUMNS] + ["world_size", "num_layers", "ac_blocks"]
_MEASURED = [*store.METRIC_COLUMNS, ("trial_wall_s", pa.float64())]
# Numbers are metrics; measured text (weights_cache: hit/miss) is a tag. Per-rank lists stay in the store.
_METRIC_COLUMNS = [name for name, t in _MEASURED if pa.types.is_floating(t) or pa.types.is_integer(t)]
_TAG_COLUMNS = ["sweep", "trial_id", "config_id", "repeat", "status", "message", "executor",
                *(name for name, t in _MEASURED if pa.types.is_string(t)),
                *(name for name, _ in store.PROVENANCE_COLUMNS)]
_MLFLOW_BATCH = 100  # MLflow accepts at most 100 params and 100 tags per log_batch call


@dataclass
class ExportResult:
    exported: int
    skipped: int
    where: str


def _missing(package: str, tracker: str) -> ConfigError:
    return ConfigError("raybench export", [Problem(
        "--to", tracker, f"the optional package '{package}' is not installed; install the trackers extra: "
                         f"pip install 'raybench[trackers]'")])


def _present(value) -> bool:
    """A stored value that is not null (a list counts when it is not empty)."""
    if value is None:
        return False
    if not pd.api.types.is_scalar(value):
        return len(value) > 0
    return not pd.isna(value)


def _text(value) -> str:
    if not pd.api.types.is_scalar(value):  # list columns (ac_blocks, hostnames) become comma-separated text
        return ",".join(str(v) for v in value)
    return str(value)


def _plain(value):
    """Python values from pandas/numpy ones (W&B config keeps numbers as numbers)."""
    if not pd.api.types.is_scalar(value):
        return [_plain(v) for v in value]
    return value.item() if hasattr(value, "item") else value


def attempt_key(row: dict) -> str:
    """The store's id of this attempt of the trial (a re-run of the trial is a new attempt, with a new id)."""
    return str(row["attempt_id"])


def params_of(row: dict) -> dict:
    """The trial's configuration: every config column, world size, layers and checkpointed blocks."""
    return {c: _plain(row[c]) for c in _PARAM_COLUMNS if c in row and _present(row[c])}


def metrics_of(row: dict) -> dict[str, float]:
    return {c: float(row[c]) for c in _METRIC_COLUMNS if c in row and _present(row[c])}


def tags_of(row: dict) -> dict[str, str]:
    """Identity and fingerprint; `system` is the label reports group by (the hostname for older rows)."""
    tags = {f"raybench.{c}": _text(row[c]) for c in _TAG_COLUMNS if c in row and _present(row[c])}
    tags["raybench.system"] = row["system_label"]
    tags[ATTEMPT_TAG] = attempt_key(row)
    return tags


def _records(df: pd.DataFrame) -> list[dict]:
    return df.assign(system_label=frames.system_label(df)).to_dict("records")


def _millis(timestamp) -> int | None:
    return int(timestamp.timestamp() * 1000) if _present(timestamp) else None


def _chunks(items: list, size: int = _MLFLOW_BATCH):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def to_mlflow(df: pd.DataFrame, tracking_uri: str | None = None, experiment: str = "raybench") -> ExportResult:
    """One MLflow run per row in `experiment` (created if absent); attempts already there are skipped."""
    # Exporting benchmark rows must not phone home (clusters are often offline or secure enclaves); a user who
    # wants MLflow's usage telemetry sets the variable to false.
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    try:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise _missing("mlflow-skinny", "mlflow") from None
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    done = _mlflow_attempts(client, experiment_id)
    exported = skipped = 0
    for row in _records(df):
        key = attempt_key(row)
        if key in done:
            skipped += 1
            continue
        run = client.create_run(experiment_id, start_time=_millis(row.get("started_at")), run_name=row["trial_id"],
                                tags={ATTEMPT_TAG: key})
        run_id = run.info.run_id
        ended_ms = _millis(row.get("ended_at")) or 0
        metrics = [Metric(k, v, ended_ms, 0) for k, v in metrics_of(row).items()]
        params = [Param(k, _text(v)) for k, v in params_of(row).items()]
        tags = [RunTag(k, v) for k, v in tags_of(row).items()]
        for batch_metrics, batch_params, batch_tags in zip_longest(
                _chunks(metrics), _chunks(params), _chunks(tags), fillvalue=[]):
            client.log_batch(run_id, metrics=batch_metrics, params=batch_params, tags=batch_tags)
        client.set_terminated(run_id, "FINISHED" if row["status"] == "ok" else "FAILED", end_time=ended_ms or None)
        done.add(key)
        exported += 1
    return ExportResult(exported, skipped, f"MLflow {client.tracking_uri}, experiment '{experiment}'")


def _mlflow_attempts(client, experiment_id: str) -> set[str]:
    """Attempt keys of the runs already exported. A run an interrupted export left unfinished is deleted, so that
    its attempt is exported again in full."""
    keys, unfinished, token = set(), [], None
    while True:
        page = client.search_runs([experiment_id], max_results=1000, page_token=token)
        for run in page:
            key = run.data.tags.get(ATTEMPT_TAG)
            if key is not None and run.info.status == "RUNNING":
                unfinished.append(run.info.run_id)
            elif key is not None:
                keys.add(key)
        token = page.token
        if not token:
            break
    for run_id in unfinished:
        client.delete_run(run_id)
    return keys


def wandb_run_id(row: dict) -> str:
    """A run id derived from the attempt: the same attempt always maps to the same W&B run."""
    return hashlib.sha256(attempt_key(row).encode()).hexdigest()[:16]


def to_wandb(df: pd.DataFrame, directory: str | Path, project: str = "raybench") -> ExportResult:
    """One offline W&B run per row under `directory`/wandb (upload later with `wandb sync`); never online."""
    try:
        import wandb
    except ImportError:
        raise _missing("wandb", "wandb") from None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Offline: runs are written to disk only; no login, no network. Host stats and git state are not the trial's.
    settings = wandb.Settings(mode="offline", silent=True, console="off", disable_git=True, disable_code=True,
                              x_disable_stats=True, x_disable_machine_info=True)
    exported = skipped = 0
    # An offline run directory is named offline-run-STAMP-ID: the same id means this attempt is there.
    existing = {p.name.rsplit("-", 1)[-1] for p in (directory / "wandb").glob("offline-run-*")}
    for row in _records(df):
        run_id = wandb_run_id(row)
        if run_id in existing:
            skipped += 1
            continue
        existing.add(run_id)
        tags = tags_of(row)
        run = wandb.init(project=project, dir=str(directory), id=run_id, name=row["trial_id"], group=row["sweep"],
                         job_type=row["status"], tags=[row["status"], tags["raybench.system"]],
                         config={**params_of(row), **tags}, settings=settings)
        run.summary.update(metrics_of(row))
        run.finish(exit_code=0 if row["status"] == "ok" else 1)
        exported += 1
    return ExportResult(exported, skipped, f"W&B offline runs in {directory / 'wandb'} (upload: wandb sync)")
