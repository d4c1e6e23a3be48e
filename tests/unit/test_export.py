"""Export to a real local MLflow store (sqlite, read back with the MLflow client) and to real W&B offline runs
(run files read back record by record); no server, no login, no network."""

from __future__ import annotations

import json
import struct
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from planted_rows import plant_gpu_store

from raybench.cli.main import main
from raybench.reports import export
from raybench.results import store
from raybench.spec.errors import ConfigError


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    plant_gpu_store(path)
    return path


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory):
    # One database for the module: creating MLflow's schema costs seconds; tests use their own experiments.
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture()
def offline_wandb(tmp_path, monkeypatch):
    """W&B confined to tmp_path: offline mode, its own config/cache dirs, no API key."""
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    return tmp_path / "runs"


def runs_of(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], max_results=1000)


def test_mlflow_one_run_per_row_with_params_metrics_tags(planted, tracking_uri):
    rows = store.read_results(planted)
    result = export.to_mlflow(rows, tracking_uri, "planted")
    assert (result.exported, result.skipped) == (len(rows), 0) == (37, 0)
    runs = runs_of(tracking_uri, "planted")
    assert len(runs) == len(rows)
    by_trial = {r.data.tags["raybench.trial_id"]: r for r in runs}
    row = rows[(rows.system == "della") & (rows.world_size == 2) & (rows.train_ac_ratio == "1/2")].iloc[0]
    run = by_trial[row.trial_id]
    assert run.info.run_name == row.trial_id and run.info.status == "FINISHED"
    assert run.data.params["train_ac_ratio"] == "1/2" and run.data.params["resources_workers"] == "2"
    assert run.data.params["ac_blocks"] == ",".join(map(str, row.ac_blocks))
    assert run.data.metrics["tok_per_s_per_device"] == pytest.approx(row.tok_per_s_per_device)
    assert run.data.metrics["phase_backward_mean_s"] == pytest.approx(row.phase_backward_mean_s)
    assert run.data.tags["raybench.status"] == "ok" and run.data.tags["raybench.sweep"] == "planted"
    assert run.data.tags["raybench.weights_cache"] == row.weights_cache  # measured text is a tag
    assert run.data.tags["raybench.system"] == "della" and run.data.tags["raybench.gpu_mem_clock_max_mhz"] == "2619.0"
    oom = next(r for r in runs if r.data.tags["raybench.status"] == "oom")
    assert oom.info.status == "FAILED" and "out of memory" in oom.data.tags["raybench.message"]
    assert "tok_per_s_per_device" not in oom.data.metrics  # a failed trial measured nothing


def test_mlflow_reexport_is_idempotent_and_adds_new_attempts(tracking_uri, tmp_path):
    path = tmp_path / "store"
    failed = next(r for r in plant_gpu_store(path) if r["status"] == "error")
    rows = store.read_results(path)
    export.to_mlflow(rows, tracking_uri, "again")
    result = export.to_mlflow(rows, tracking_uri, "again")
    assert (result.exported, result.skipped) == (0, len(rows))
    assert len(runs_of(tracking_uri, "again")) == len(rows)

    # The failed trial is run again and now succeeds: a new attempt, hence one new run; history keeps the old one.
    rerun = {**failed, "status": "ok", "message": "", "ended_at": failed["ended_at"] + timedelta(hours=1),
             "tok_per_s_per_device": 1.0}
    store.write_row(path, rerun)
    result = export.to_mlflow(store.read_results(path), tracking_uri, "again")
    assert (result.exported, result.skipped) == (1, len(rows) - 1)
    attempts = [r for r in runs_of(tracking_uri, "again") if r.data.tags["raybench.trial_id"] == rerun["trial_id"]]
    assert sorted(r.data.tags["raybench.status"] for r in attempts) == ["error", "ok"]


def test_mlflow_redoes_a_run_an_interrupted_export_left_unfinished(planted, tracking_uri):
    rows = store.read_results(planted).head(2)
    client = MlflowClient(tracking_uri)
    experiment_id = client.create_experiment("interrupted")
    # What an export killed after create_run leaves: the attempt tag, no params or metrics, still RUNNING.
    stale = client.create_run(experiment_id, tags={export.ATTEMPT_TAG: rows.iloc[0].attempt_id})
    result = export.to_mlflow(rows, tracking_uri, "interrupted")
    assert (result.exported, result.skipped) == (2, 0)
    runs = runs_of(tracking_uri, "interrupted")
    assert len(runs) == 2 and stale.info.run_id not in {r.info.run_id for r in runs}
    assert all(r.info.status == "FINISHED" and r.data.params for r in runs)


def wandb_records(run_file: Path):
    """Records of a W&B run file: a 7-byte header, then LevelDB-log chunks (7-byte headers) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def test_wandb_offline_runs(planted, offline_wandb):
    rows = store.read_results(planted)
    few = rows[rows.system == "della"].head(3)
    result = export.to_wandb(few, offline_wandb, project="bench")
    assert (result.exported, result.skipped) == (3, 0)
    run_dirs = sorted((offline_wandb / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 3
    row = few.iloc[0]
    run_id = export.wandb_run_id(row.to_dict())
    (run_file,) = (offline_wandb / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    records = list(wandb_records(run_file))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.run_id == run_id and run.project == "bench" and run.display_name == row.trial_id
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["train_ac_ratio"] == row.train_ac_ratio and config["resources_workers"] == row.world_size
    assert config["raybench.attempt"] == export.attempt_key(row.to_dict())
    summary = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for u in r.summary.update if u.key}
    assert summary["tok_per_s_per_device"] == pytest.approx(row.tok_per_s_per_device)

    again = export.to_wandb(few, offline_wandb, project="bench")
    assert (again.exported, again.skipped) == (0, 3)
    assert len(list((offline_wandb / "wandb").glob("offline-run-*"))) == 3


def test_missing_tracker_package_names_the_extra(planted, monkeypatch):
    rows = store.read_results(planted)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if wandb were not installed
    with pytest.raises(ConfigError, match=r"raybench\[trackers\]"):
        export.to_wandb(rows, "unused")
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    with pytest.raises(ConfigError, match="mlflow-skinny"):
        export.to_mlflow(rows)


def test_cli_export(planted, tracking_uri, offline_wandb, capsys):
    assert main(["export", str(planted), "--to", "mlflow", "--tracking-uri", tracking_uri,
                 "--experiment", "cli"]) == 0
    assert "37 run(s) exported, 0 already there" in capsys.readouterr().out
    assert len(runs_of(tracking_uri, "cli")) == 37
    assert main(["export", str(planted), "--to", "wandb", "--sweep", "nope", "--dir", str(offline_wandb)]) == 2
    assert "STORE" in capsys.readouterr().err and not offline_wandb.exists()
    assert main(["export", str(planted), "--to", "wandb", "--tracking-uri", tracking_uri]) == 2
    assert "--tracking-uri" in capsys.readouterr().err
