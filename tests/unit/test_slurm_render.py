"""The sbatch script raybench renders, and SLURM option checks (no SLURM needed: tests/integration runs it)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from raybench.cli import main as cli
from raybench.drivers.slurm import SlurmOptions, option_problems, render

SMOKE = str(Path(__file__).resolve().parents[2] / "sweeps" / "smoke-cpu.yaml")


def _script(tmp_path: Path, **options) -> str:
    return render(SlurmOptions(**options), tmp_path / "job dir", "exit 0\n")


def test_rendered_script_is_valid_bash_with_every_placeholder_filled(tmp_path):
    text = _script(tmp_path, nodes=3, gpus_per_node=4, cpus_per_node=32, mem="200G", partition="gpu",
                   account="proj-1", container_cmd="apptainer exec --nv '/img dir/x.sif'", port=7000)
    assert "{{" not in text
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    for line in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=32",
                 "#SBATCH --mem=200G", "#SBATCH --partition=gpu", "#SBATCH --account=proj-1"):
        assert line in text.splitlines()
    assert f"export RAYBENCH_JOB_DIR={shlex.quote(str(tmp_path / 'job dir'))}" in text  # quoted: has a space
    assert "apptainer exec --nv '/img dir/x.sif'" in text


def test_script_keeps_the_safety_settings(tmp_path):
    text = _script(tmp_path)
    assert "ray stop" not in text.replace("never `ray stop`", "")  # teardown is by PID only
    for needle in ("--block", "RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN_PATH", "--dashboard-host=127.0.0.1",
                   "NCCL_DEBUG=WARN", "/dev/shm", '{"raybench_driver": 1000}', "--temp-dir="):
        assert needle in text, needle
    assert not any(line.startswith("#SBATCH --gpus") for line in text.splitlines())  # CPU by default


@pytest.mark.parametrize("field,options", [
    ("--nodes", dict(nodes=0)), ("--gpus-per-node", dict(gpus_per_node=-1)), ("--time", dict(time="2h")),
    ("--partition", dict(partition="gpu;rm -rf /")), ("--account", dict(account="a b")),
    ("--mem", dict(mem="lots")), ("--port", dict(port=80)), ("--container-cmd", dict(container_cmd="'open")),
])
def test_each_bad_option_is_named(field, options):
    problems = option_problems(SlurmOptions(**options))
    assert [p.field for p in problems] == [field]


def test_bad_options_exit_2_before_anything_is_submitted(capsys):
    assert cli.main(["slurm", "submit", SMOKE, "--time", "soon", "--nodes", "0"]) == 2
    err = capsys.readouterr().err
    assert "--time = 'soon'" in err and "--nodes = 0" in err and "nothing was launched" in err


def test_a_bad_preflight_tolerance_exits_2_before_anything_is_submitted(capsys):
    assert cli.main(["slurm", "submit", SMOKE, "--tolerance", "1.5", "--time", "soon"]) == 2
    err = capsys.readouterr().err  # with the other options' problems, in one round
    assert "--tolerance = 1.5" in err and "must be a fraction in (0, 1]" in err and "--time = 'soon'" in err
    assert "nothing was launched" in err


def test_unknown_cluster_is_bad_input(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAYBENCH_HOME", str(tmp_path))
    assert cli.main(["run", SMOKE, "--cluster", "nope"]) == 2
    assert "raybench cluster up nope" in capsys.readouterr().err


def test_onprem_cluster_yaml_passes_rays_schema():
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((Path(SMOKE).parents[1] / "cluster_yaml" / "onprem.yaml").read_text())
    validate_config(prepare_config(config))  # what `ray up` does before it touches a machine
    head = config["head_start_ray_commands"][0]
    assert "--block" in head and "RAY_AUTH_MODE=token" in head and "ray stop" not in head
