"""Every shipped CPU sweep (sweeps/*cpu*.yaml) runs to completion as shipped, on the data `raybench example-data`
makes, every trial ok: a fresh clone's first runs. Slow (every trial of every sweep, minutes on 2 cores): the
default run's tests/unit/test_example_data.py validates each one on the same data. The torchtune and torchtitan
sweeps need their own environments (scripts/KIND-venv.sh .venvs/KIND, or RAYBENCH_TORCHTUNE_PYTHON and
RAYBENCH_TORCHTITAN_PYTHON naming their interpreters), and are skipped without them, saying so."""

from __future__ import annotations

import pytest

from raybench import read_results
from raybench.cli import main as cli
from raybench.drivers.ray_cluster import ray_cluster
from raybench.spec.load import load_sweep
from tests.unit.test_example_data import CPU_SWEEPS, OWN_ENVIRONMENT, clone_of_sweeps, skip_without_environment

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    sweeps = clone_of_sweeps(tmp_path_factory.mktemp("clone"))
    torchtune = sweeps.parent / ".venvs" / "torchtune" / "bin" / "python"
    sentencepiece = ["--sentencepiece-python", str(torchtune)] if torchtune.exists() else []
    assert cli.main(["example-data", str(sweeps / "example-data"), *sentencepiece]) == 0
    with ray_cluster(None):
        yield sweeps


@pytest.mark.parametrize("shipped", CPU_SWEEPS, ids=lambda p: p.stem)
def test_each_shipped_cpu_sweep_runs_as_shipped(shipped, sweeps, tmp_path):
    skip_without_environment(sweeps.parent, shipped)
    sweep = sweeps / shipped.name
    assert cli.main(["run", str(sweep), "--store", str(tmp_path / "store")]) == 0
    rows = read_results(str(tmp_path / "store"), load_sweep(sweep).name)
    assert len(rows) > 0 and set(rows.status) == {"ok"}, rows[["status", "message"]].to_string()
    assert (rows.step_time_p50_s > 0).all() and (rows.tokens_per_step > 0).all()
    if shipped.stem in OWN_ENVIRONMENT:  # packed rows of seq_len tokens, every position a token the step counts
        assert (rows.steps_timed == rows.train_steps - rows.train_warmup_steps).all()
        assert (rows.tokens_per_step == rows.world_size * rows.train_micro_batch * rows.train_grad_accum
                * rows.train_seq_len).all()
        assert (rows.nonpad_tokens_per_step == rows.tokens_per_step).all()
