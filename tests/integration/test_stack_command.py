"""A `command` stack in a real Ray sweep: the user's own script under torchrun on 2 gloo ranks, timed by the probe,
as three trials of one sweep: one that trains, one that crashes, one that hangs past resources.timeout_s."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from raybench import read_results
from raybench.cli import main as cli
from tests.conftest import write_sweep

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[1] / "stacks_user" / "probe_train.py"
WORKERS, MICRO_BATCH, SEQ_LEN, HANG_TIMEOUT_S = 2, 2, 16, 25

SWEEP = f"""
name: stack-command
model: {{preset: tiny}}
train: {{steps: 5, warmup_steps: 1, micro_batch: {MICRO_BATCH}, seq_len: {SEQ_LEN}}}
resources: {{workers: {WORKERS}, cpus_per_worker: 1, timeout_s: 180}}
stack:
  kind: command
  command: ["{{python}}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{{workers}}",
            "{SCRIPT}", "--steps", "{{steps}}", "--micro-batch", "{{micro_batch}}", "--seq-len", "{{seq_len}}",
            "--mode", "{{mode}}"]
  overrides: {{mode: ok}}
axes:
  case:
    - {{stack.overrides.mode: ok}}
    - {{stack.overrides.mode: crash}}
    - {{stack.overrides.mode: hang, resources.timeout_s: {HANG_TIMEOUT_S}}}
"""


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack-command")
    sweep = write_sweep(tmp / "sweep.yaml", SWEEP)
    assert cli.main(["run", str(sweep), "--store", str(tmp / "store")]) == 1  # trials that were not ok
    frame = read_results(str(tmp / "store"), "stack-command")  # read back from the Parquet files
    return {json.loads(row.axis_values_json)["stack.overrides.mode"]: row for row in frame.itertuples()}


def test_the_script_that_trains_gets_an_ok_row_measured_by_the_probe(rows):
    row = rows["ok"]
    assert row.status == "ok" and row.stack_kind == "command" and row.executor == "train"
    assert row.tokens_per_step == WORKERS * MICRO_BATCH * SEQ_LEN  # every rank's batch, as the script drew it
    assert row.tok_per_s > 0 and row.tok_per_s_per_device == pytest.approx(row.tok_per_s / WORKERS)
    assert row.steps_timed == 4 and row.world_size == WORKERS
    assert math.isfinite(row.loss_first) and math.isfinite(row.loss_final)
    assert row.time_to_first_step_s > row.step_time_p50_s > 0
    assert row.stack_version.startswith("python -m torch.distributed.run (python ")
    assert "torch " in row.stack_version and pd.isna(row.phase_forward_p50_s)  # no phases in a user's loop


def test_a_crash_is_an_error_row_with_the_scripts_own_last_error_line(rows):
    row = rows["crash"]
    assert row.status == "error" and row.message == "ValueError: bad batch shape 7"
    assert "ChildFailedError" in row.error_detail  # the launcher's summary is kept in the detail


def test_a_hang_is_a_timeout_row(rows):
    row = rows["hang"]
    assert row.status == "timeout" and f"resources.timeout_s={HANG_TIMEOUT_S} s" in row.message
    assert row.trial_wall_s < HANG_TIMEOUT_S + 30  # killed at the limit, not left to run
