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
