"""`compare` on a real store of planted rows: two systems that differ in memory clock, NVLink vs PCIe, all-reduce
bandwidth and NCCL version (and agree on everything else) must come out as exactly those differences."""

from __future__ import annotations

import json
import socket

import pandas as pd
import pytest
from planted_rows import GPU_SYSTEMS, plant_gpu_store

from raybench.cli.main import main
from raybench.drivers.trial import build_row
from raybench.planning.plan import plan
from raybench.reports import compare, frames
from raybench.results import store
from raybench.runtime import fingerprint
from raybench.spec.errors import ConfigError
from raybench.spec.load import parse_sweep

PLANTED_DIFFERENCES = {"gpu_mem_clock_max_mhz", "interconnect", "allreduce_busbw_gbps", "nccl_version"}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = tmp_path_factory.mktemp("store")
    plant_gpu_store(path)
    return path


@pytest.fixture()
def rows(planted) -> pd.DataFrame:
    return store.read_results(planted)


def test_finds_planted_fingerprint_differences(rows):
    result = compare.compare(rows, ["della", "snellius"])
    found = {d.column: d.values for d in result.differences}
    assert set(found) == PLANTED_DIFFERENCES
    assert found["gpu_mem_clock_max_mhz"] == {"della": "2619", "snellius": "1593"}
    assert found["interconnect"] == {"della": "NVLink", "snellius": "PCIe"}
    assert {"device", "gpu_power_limit_w", "torch_version", "cpu_model", "gpu_memory_gib"} <= set(result.same)


def test_matched_configurations_and_ratios(rows):
    result = compare.compare(rows, ["della", "snellius"])
    # 9 configurations; the one that ran out of memory on snellius has no ok match and is left out.
    assert len(result.table) == 8 and result.unmatched == {"della": 1, "snellius": 0}
    speed = compare.ratios(result, "tok_per_s_per_device")["snellius"]
    one_gpu = result.table[result.table[("world_size", "")] == 1]
    one_gpu_ratios = (one_gpu[("tok_per_s_per_device", "snellius")] / one_gpu[("tok_per_s_per_device", "della")])
    # The planted 15% gap on one GPU, and the wider one at 4 GPUs where PCIe scales worse.
    assert one_gpu_ratios.tolist() == pytest.approx([1 / GPU_SYSTEMS["della"]["speed"]] * 3)
    expected_4 = GPU_SYSTEMS["snellius"]["efficiency"][4] / (GPU_SYSTEMS["della"]["speed"] *
                                                            GPU_SYSTEMS["della"]["efficiency"][4])
    assert min(speed) == pytest.approx(expected_4)
    text = compare.comparison_text(result)
    assert "snellius/della tok/s/device: geometric mean" in text and "NVLink" in text


def test_sampled_clocks_are_summarised_where_recorded(rows):
    """A GPU at its power limit runs below the SM clock its fingerprint records: the clocks sampled over the
    timed steps come out as a ratio, and not at all where no row recorded them (CPU trials)."""
    clocked = rows.assign(gpu_sm_clock_mhz=rows["system"].map({"della": 1900.0, "snellius": 1710.0}))
    lines = compare.summary_lines(compare.compare(clocked, ["della", "snellius"]))
    assert "snellius/della SM clock MHz (sampled): geometric mean 0.900 (min 0.900, max 0.900)" in " ".join(lines)
    unrecorded = rows.assign(gpu_sm_clock_mhz=None, gpu_power_w=None)
    assert not [line for line in compare.summary_lines(compare.compare(unrecorded)) if "sampled" in line]


def test_systems_by_hostname_and_old_rows_without_a_label(rows):
    assert compare.resolve_systems(rows, ["della-gpu01", "snellius"], "s") == ["della", "snellius"]
    unlabelled = rows.assign(system=None)  # rows written before the system column existed
    ok = unlabelled[unlabelled.status == "ok"]  # failed rows carry no hostname: their system is unknown
    assert sorted(frames.system_label(ok).unique()) == ["della-gpu01", "snellius-gpu01"]
    assert {d.column for d in compare.compare(unlabelled).differences} == PLANTED_DIFFERENCES


def test_measured_values_within_tolerance_are_not_differences(rows):
    close = rows.assign(allreduce_busbw_gbps=rows["allreduce_busbw_gbps"].where(rows["system"] == "della", 175.0))
    assert "allreduce_busbw_gbps" not in {d.column for d in compare.compare(close).differences}


def test_environment_differences_skip_job_identifiers(rows):
    def env(system):
        return json.dumps({"NCCL_ALGO": "Ring" if system == "della" else "Tree", "SLURM_JOB_ID": f"{system}-1"})

    result = compare.compare(rows.assign(env_json=rows["system"].map(env)))
    found = {d.column: d.values for d in result.differences}
    assert found["env NCCL_ALGO"] == {"della": "Ring", "snellius": "Tree"}
    assert not any("SLURM" in column for column in found)


def test_match_by_axes_when_config_ids_differ(rows):
    # Sites whose sweep files differ only in a model path get different config ids for the same grid point.
    moved = rows.assign(config_id=rows["config_id"].where(rows["system"] == "della", "elsewhere-" + rows["config_id"]))
    assert compare.compare(moved).table.empty
    assert len(compare.compare(moved, match="axes").table) == 8


def test_same_trial_ids_from_two_sites_do_not_hide_each_other(tmp_path, capsys):
    # One sweep file run at both sites, rows copied into one store: a measurement is a trial id in a sweep on a
    # system (store.MEASUREMENT_SQL), so the store keeps each site's rows, and the `trials` view counts them alike.
    plant_gpu_store(tmp_path, ids_per_system=False)
    rows = store.read_results(tmp_path)
    assert rows.system.nunique() == 2
    assert main(["query", str(tmp_path), "select count(*) as n from trials", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == str(len(rows))
    assert main(["compare", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["systems"] == ["della", "snellius"] and len(out["configurations"]) == 8


def test_bad_systems_name_the_field(rows):
    with pytest.raises(ConfigError) as err:
        compare.compare(rows, ["della", "nowhere"])
    assert err.value.problems[0].field == "--systems" and "systems with ok rows: della, snellius" in str(err.value)
    with pytest.raises(ConfigError, match="two or more systems"):
        compare.compare(rows, ["della"])


def test_interconnect_and_natural_order():
    assert frames.interconnect("GPU0 X NV12\nGPU1 NV12 X") == "NVLink"
    assert frames.interconnect("GPU0 X SYS\nGPU1 SYS X") == "PCIe"
    assert frames.interconnect(None) is None
    assert frames.natural_order(["ac_ratio=1", "ac_ratio=1/2", "ac_ratio=0", "ac_ratio=0"]) == [
        "ac_ratio=0", "ac_ratio=1/2", "ac_ratio=1"]


def test_cli_compare(planted, capsys):
    assert main(["compare", str(planted), "--systems", "della,snellius", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {d["column"] for d in out["differences"]} == PLANTED_DIFFERENCES
    assert len(out["configurations"]) == 8
    assert main(["compare", str(planted), "--systems", "della,atlantis"]) == 2
    err = capsys.readouterr().err
    assert "--systems = 'atlantis'" in err and "systems with ok rows" in err


def test_system_label_precedence_and_failed_rows(monkeypatch):
    assert fingerprint.system_label({"RAYBENCH_SYSTEM": "a", "SLURM_CLUSTER_NAME": "b"}) == "a"
    assert fingerprint.system_label({"SLURM_CLUSTER_NAME": "b"}) == "b"
    assert fingerprint.system_label({}) == socket.gethostname()
    # A failed trial has no worker fingerprint: its row takes the driver's label (same system).
    monkeypatch.setenv("RAYBENCH_SYSTEM", "site-x")
    trial = plan(parse_sweep({"name": "s", "model": {"preset": "tiny"}}))[0]
    assert build_row(trial.payload, "s", "error", "boom")["system"] == "site-x"
