"""An Optuna search on a real local Ray (`raybench run`, warm pool): invalid and OOM points are stored and told to
the searcher as infeasible, and running the same command again adds no row."""

from __future__ import annotations

import pytest

from raybench.cli import main as cli
from raybench.drivers.api import run_sweep
from raybench.drivers.ray_cluster import ray_cluster
from raybench.results import store
from raybench.spec.load import parse_sweep

pytestmark = pytest.mark.integration

SWEEP = """name: search-it
model: {{preset: tiny}}
executor: pool
store: {store}
train: {{steps: 4, warmup_steps: 1, seq_len: 32, precision: fp32}}
resources: {{workers: 1, timeout_s: 120}}
axes:
  train.micro_batch: [1, 2]
  setup:
    - {{train.strategy: ddp}}
    # invalid: strategy tp needs tp_size == workers (1), and 3 divides neither 4 heads nor 2 KV heads
    - {{train.strategy: tp, train.tp_size: 3}}
    # oom: a worker process holds more than 0.3 GiB before its first step: the cap fails the trial at once
    - {{train.seq_len: 1024, resources.memory_limit_gib: 0.3}}
search: {{algo: optuna, seed: 0, max_concurrent: 1{extra}}}
"""


@pytest.fixture(scope="module")
def warm_pool(tmp_path_factory):
    """One Ray for the three runs, its pool group warmed by a plain trial first: a worker's first trial imports
    libraries, and under a 0.3 GiB cap that import fails (an error row) before the model can run out (oom)."""
    with ray_cluster(None):
        warm = parse_sweep({"name": "warm", "model": {"preset": "tiny"}, "executor": "pool",
                            "train": {"steps": 2, "warmup_steps": 1, "seq_len": 32, "precision": "fp32"}})
        run_sweep(warm, store_path=str(tmp_path_factory.mktemp("warm")), progress=lambda line: None)
        yield


def test_optuna_sweep_records_infeasible_and_resumes_without_duplicates(warm_pool, tmp_path, capsys):
    sweep = tmp_path / "search.yaml"
    # Stopped after 2 points (as an interrupted search would be), then run in full: the 2 are not run again.
    sweep.write_text(SWEEP.format(store=tmp_path / "store", extra=", num_samples: 2"))
    cli.main(["run", str(sweep)])
    first = store.read_results(tmp_path / "store", "search-it")
    assert "search: 2 point(s) run, 0 answered from the store" in capsys.readouterr().out
    sweep.write_text(SWEEP.format(store=tmp_path / "store", extra=""))
    code = cli.main(["run", str(sweep)])
    out = capsys.readouterr().out
    rows = store.read_results(tmp_path / "store", "search-it")
    statuses = rows.status.value_counts().to_dict()
    # Every runnable point ran; the search ends then, so it may not have proposed every invalid point.
    assert statuses["ok"] == 2 and statuses["oom"] == 2 and statuses["invalid"] >= 1, out
    assert code == 1  # the oom trials ran and did not end ok
    invalid = rows[rows.status == "invalid"]
    assert set(invalid.train_strategy) == {"tp"} and invalid.message.str.contains("must divide").all()
    # Refused in Python before the cap is set, not raced by the process's other threads' allocations.
    assert rows[rows.status == "oom"].message.str.contains("over its cap of").all()
    # Every infeasible point was told to the searcher, and the end says how the search stopped.
    assert out.count("told the searcher: infeasible") == len(rows) - 2, out
    ran_first = (first.status != "invalid").sum()
    assert f"search: {4 - ran_first} point(s) run, {ran_first} answered from the store, infeasible: " in out
    assert set(first.trial_id) <= set(rows.trial_id)
    assert "stopped: every runnable grid point evaluated" in out
    assert "best of 2 configuration(s) over tok_per_s_per_device (max)" in out
    files = store.result_files(tmp_path / "store", "search-it")
    assert len(files) == len(rows)

    # The same command again: every point is answered from the store, nothing runs, no file is added.
    assert cli.main(["run", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "search: 0 point(s) run, 4 answered from the store" in out, out
    assert store.result_files(tmp_path / "store", "search-it") == files
    assert len(store.read_results(tmp_path / "store", "search-it", latest=False)) == len(rows)
