"""`slurm submit --requeue` before anything is submitted: the check that every trial fits one allocation, and the
script it renders (no SLURM needed: tests/integration/test_slurm_requeue.py runs it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from raybench.cli import main as cli
from raybench.drivers import requeue
from raybench.drivers.slurm import SlurmOptions, render

SMOKE = Path(__file__).resolve().parents[2] / "sweeps" / "smoke-cpu.yaml"


@pytest.mark.parametrize("text,seconds", [("1", 60), ("90", 5400), ("2:30", 150), ("01:00:00", 3600),
                                          ("1-0", 86400), ("1-02:03", 93780), ("0-00:01:05", 65), ("1h", None)])
def test_time_limit_in_seconds_takes_every_sbatch_form(text, seconds):
    assert requeue.time_limit_s(text) == seconds


def _sweep(tmp_path: Path, timeout_s: float) -> str:
    spec = yaml.safe_load(SMOKE.read_text())
    spec["resources"]["timeout_s"] = timeout_s
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_a_trial_that_may_outlast_an_allocation_is_refused_with_the_numbers(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYBENCH_HOME", str(tmp_path / "home"))
    code = cli.main(["slurm", "submit", str(SMOKE), "--requeue", "--time", "01:00:00"])
    err = capsys.readouterr().err
    assert code == 2 and "nothing was launched" in err, err
    # The smoke sweep keeps the default bound of an hour: with the start-up and the warning it cannot fit.
    assert "resources.timeout_s = 3600.0" in err and "4 of 4 may not" in err
    assert "3600 s (a trial's bound" in err and "start-up 30 s + --signal-time 60 s = 3690 s > --time 01:00:00 " \
                                                "(3600 s)" in err
    assert "at most 3510 s, or ask for --time of at least 01:01:30" in err
    assert "sbatch" not in err and not (tmp_path / "home").exists()  # refused before any job directory or sbatch


def test_a_sweep_whose_trials_fit_passes_and_the_signal_time_counts(tmp_path):
    from raybench.planning.plan import plan
    from raybench.spec.load import load_sweep

    sweep = _sweep(tmp_path, 60)
    trials = plan(load_sweep(sweep), source=sweep)
    assert requeue.fit_problems(trials, "2", 20) == []  # 60 + 30 + 20 <= 120
    [problem] = requeue.fit_problems(trials, "2", 31)  # 121 > 120
    assert problem.field == "resources.timeout_s" and "at most 59 s" in problem.message
    assert [p.field for p in requeue.fit_problems(trials, "2", 0)] == ["--signal-time"]


def test_signal_time_without_requeue_is_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYBENCH_HOME", str(tmp_path / "home"))
    assert cli.main(["slurm", "submit", _sweep(tmp_path, 60), "--signal-time", "30"]) == 2
    assert "--signal-time = 30: only with --requeue" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()


def test_requeued_job_script_asks_for_the_warning_and_is_valid_bash(tmp_path):
    run = "python -m raybench run s.yaml --address \"$RAY_ADDRESS\""
    text = render(SlurmOptions(cpus_per_node=4), tmp_path, requeue.payload(run, 45),
                  directives=requeue.directives(45))
    lines = text.splitlines()
    for line in ("#SBATCH --signal=B:USR1@45", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --cpus-per-task=4"):
        assert line in lines
    # sbatch reads #SBATCH lines only up to the first command
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert lines.index("#SBATCH --open-mode=append") < first_command
    assert "trap 'end_warned=1' USR1" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_a_stop_that_lands_inside_ray_wait_still_stores_the_running_trial_as_interrupted(tmp_path):
    """SIGTERM while the sweep driver waits in ray.wait: Ray's own code turns the handler's Terminated into a
    SystemError (seen on the tests' SLURM when a job requeued itself). It is still a stop: the running trial is
    stored `interrupted` and Terminated goes on to the command line (exit 130)."""
    import pyarrow.parquet as pq

    from raybench.drivers.progress import as_progress
    from raybench.drivers.ray_cluster import Terminated
    from raybench.drivers.sweep import record_interrupted
    from raybench.planning.plan import plan
    from raybench.spec.load import load_sweep

    trials = plan(load_sweep(str(SMOKE)), source=str(SMOKE))
    progress = as_progress(lambda line: None)
    progress.start(len(trials))
    progress.trial_started(trials[1].trial_id, trials[1].axis_values)
    store = tmp_path / "store"
    with pytest.raises(Terminated):
        with record_interrupted(progress, trials, "smoke-cpu", str(store), "train", set()):
            try:
                raise Terminated("received signal 15")
            except Terminated as stop:
                raise SystemError("<cyfunction CoreWorker.wait> returned a result with an exception set") from stop
    [path] = (store / "sweep=smoke-cpu").glob("*.parquet")
    row = pq.read_table(path, columns=["trial_id", "status"]).to_pylist()
    assert row == [{"trial_id": trials[1].trial_id, "status": "interrupted"}]
