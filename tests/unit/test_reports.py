"""The seams between the command line and the modules that do its work: which planned trials a key names, a query
result as text, what a rehearse run says priced it, the device calibration a rehearsal is priced with, and the
settling sweep of `best --predict` (the commands themselves: test_cli_commands.py, test_rehearse.py)."""

from __future__ import annotations

import json

import pyarrow as pa

from raybench.planning.plan import matching, plan
from raybench.rehearse.fitted import SHIPPED, SHIPPED_CALIBRATION, Calibration
from raybench.rehearse.trials import device_calibration
from raybench.reports import prediction, report
from raybench.reports.report import format_table
from raybench.reports.tables import rehearsal_report
from raybench.spec.load import parse_sweep

SWEEP = {"name": "seams", "model": {"preset": "tiny"}, "repeats": 2, "axes": {"train.micro_batch": [1, 2]}}


def test_a_key_names_a_trial_its_configuration_or_its_plan_index():
    trials = plan(parse_sweep(SWEEP))
    first = trials[0]
    assert matching(trials, first.trial_id) == [first]
    assert matching(trials, first.config_id) == [t for t in trials if t.config_id == first.config_id] == trials[:2]
    assert matching(trials, str(trials[3].index)) == [trials[3]]
    assert matching(trials, "no such trial") == []


def test_a_query_result_prints_as_a_table_csv_or_json_lines():
    table = pa.table({"gpu": ["H100", None], "tok_s": [1234.5678, float("nan")]})
    assert format_table(table, "table").splitlines() == ["gpu   tok_s", "----  -------", "H100  1234.57",
                                                           "-     -"]
    assert format_table(table, "csv").splitlines() == ["gpu,tok_s", "H100,1234.5678", ",nan"]
    assert [json.loads(line)["gpu"] for line in format_table(table, "json").splitlines()] == ["H100", None]


def _row(method: str, gpu: str | None, calibration: Calibration) -> dict:
    return {"index": 0, "config_id": "c", "axis_values": {}, "world_size": 1, "method": method, "gpu": gpu,
            "memory_gib": {}, "comm_bytes": {}, "peak_gib": 1.0, "reserved_gib": None, "compute_s": None,
            "exposed_comm_s": None, "step_time_s": None, "trace_s": 0.0, "notes": [],
            "intervals": {"peak_gib": (0.9, 1.1), "reserved_gib": None, "step_time_s": None},
            "calibration": calibration.as_dict() if method == "traced" else None}


def test_a_rehearse_run_names_what_priced_its_traced_rows():
    profiled = Calibration(source="profile: CPU 2026-01-01")
    rows = [_row("traced", "H100 SXM", SHIPPED_CALIBRATION), _row("traced", None, profiled),
            _row("traced", None, SHIPPED_CALIBRATION), _row("analytic", "A100", SHIPPED_CALIBRATION)]
    text = rehearsal_report(rows, "STORE", "s.yaml")
    assert "4 configuration(s) rehearsed; stored in STORE/" in text and "`raybench estimate s.yaml`" in text
    # A CPU row the shipped constants priced has no time, so it names no calibration; analytic rows none either.
    assert text.splitlines()[-1] == f"priced with: profile: CPU 2026-01-01; {SHIPPED}"
    assert "priced with" not in rehearsal_report(rows[2:], "STORE", "s.yaml")
    assert "fabric" not in text


def test_a_rehearse_run_says_when_its_steps_cross_nodes_on_nominal_links():
    """A step that crosses nodes on links nobody measured is the least certain figure: the run says how many and
    how to give the fabric; one node, or a measured or stated bus bandwidth, says nothing."""
    def row(world: int, source: str) -> dict:
        return {**_row("traced", "A100 80GB", SHIPPED_CALIBRATION), "world_size": world, "busbw_source": source,
                "layout": {"gpus_per_node": 8, "nics_per_node": 8}}

    text = rehearsal_report([row(16, "links"), row(32, "links"), row(8, "links"), row(16, "probe"), row(16, "set")],
                            "STORE", "s.yaml")
    assert text.splitlines()[-1].startswith("fabric: 2 configuration(s) cross nodes on nominal links")
    assert "estimate.nics_per_node" in text.splitlines()[-1]
    assert "fabric" not in rehearsal_report([row(8, "links"), row(16, "set")], "STORE", "s.yaml")


def test_a_device_without_a_stored_profile_is_priced_by_the_shipped_constants(tmp_path):
    assert device_calibration(tmp_path, "H100 SXM") is SHIPPED_CALIBRATION
    assert device_calibration(tmp_path, None) is SHIPPED_CALIBRATION


def test_nothing_in_doubt_writes_no_settling_sweep(tmp_path):
    spec = parse_sweep(SWEEP)
    out = tmp_path / "settle.yaml"
    said = prediction.write_settle_sweep(spec, [{"in_doubt": []}], str(out), "train.ac_ratio")
    assert said == f"nothing in doubt: {out} not written" and not out.exists()


def test_a_cpu_sweep_whose_trials_all_failed_is_not_reported_per_gpu(tmp_path):
    from raybench.drivers.trial import build_row
    from raybench.results import store
    from raybench.reports.report import results_table

    for gpus, per in ((0, "tok/s/worker"), (1, "tok/s/GPU")):
        trials = plan(parse_sweep({"name": f"failed{gpus}", "model": {"preset": "tiny"},
                                   "resources": {"gpus_per_worker": gpus}}))
        root = tmp_path / str(gpus)
        store.write_row(root, build_row(trials[0].payload, f"failed{gpus}", "error", "boom"))
        table = results_table(store.read_results(root, f"failed{gpus}"))
        assert per in table.splitlines()[0]
        assert ("CPU run" in table) == (gpus == 0)


def test_a_table_wider_than_the_terminal_is_fitted_to_it_not_wrapped():
    """On a terminal narrower than the table, headers fold, the droppable columns go in their order, the last
    column is cut short, and a last line names what was left out; ids and figures are never cut. Without a
    terminal (width None) the table is whole, one line per row."""
    headers = ["sweep", "trial_id", "status", "strategy", "tok/s/worker", "nonpad tok/s/worker", "step p50 ms",
               "step p90 ms", "peak GiB", "message"]
    rows = [["smoke-cpu", "495119074fcf193e-r0", "ok", "ddp", "4,119", "4,119", "59.7", "71.3", "0.48", ""],
            ["smoke-cpu", "fecab8780c74e211-r0", "error", "fsdp2", "-", "-", "-", "-", "-",
             "RuntimeError: [rank 1] something failed in the backward pass"]]
    whole = report.render(headers, rows)
    assert len(whole.splitlines()) == 4 and report.render(headers, rows, width=500) == whole
    assert report.render(["a", "bb"], []) == "a  bb\n-  --"  # no rows: the headers' widths
    droppable = report.droppable_columns(headers)
    assert droppable == ("nonpad tok/s/worker", "step p90 ms", "sweep", "step p50 ms")
    for width in (110, 80):
        fitted = report.render(headers, rows, width, droppable)
        lines = fitted.splitlines()
        assert max(map(len, lines)) <= width, fitted
        assert all(any(r[1] in line and r[4] in line for line in lines) for r in rows)  # ids and figures whole
        assert "RuntimeError" in fitted and "backward pass" not in fitted and "…" in fitted
        assert "left out at this width: nonpad tok/s/worker" in " ".join(lines)
    assert "step p90 ms" in report.render(headers, rows, 80, droppable).splitlines()[-2]  # more go at 80
    assert report.render(headers, rows, 110, droppable).splitlines()[0].split() == ["step", "step"]  # folded
