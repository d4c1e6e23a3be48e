"""Every shipped CPU sweep (sweeps/*cpu*.yaml) passes `raybench validate` as shipped, once `raybench example-data
sweeps/example-data` has made its model, tokenizers and data (each sweep runs to completion:
tests/integration/test_shipped_cpu_sweeps.py, -m slow). The sweeps are copied as they are next to the data, as a
fresh clone holds them: nothing is written into the repository."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from raybench.cli import main as cli

REPO = Path(__file__).resolve().parents[2]
CPU_SWEEPS = sorted((REPO / "sweeps").glob("*cpu*.yaml"))
# Stacks that run in an environment of their own, built by scripts/KIND-venv.sh at the path their sweep names.
OWN_ENVIRONMENT = {"stack-torchtune-cpu": "torchtune", "stack-torchtitan-cpu": "torchtitan"}


def environment(kind: str) -> Path | None:
    """The directory of a stack's own environment: RAYBENCH_<KIND>_PYTHON's (the stacks' own tests read it too),
    else the repository's .venvs/KIND, where scripts/KIND-venv.sh puts it as the sweeps expect; None: neither."""
    python = os.environ.get(f"RAYBENCH_{kind.upper()}_PYTHON")
    if python:
        return Path(python).absolute().parent.parent  # DIR/bin/python, not resolved: a venv's python is a link
    built = REPO / ".venvs" / kind
    return built if (built / "bin" / "python").exists() else None


def clone_of_sweeps(root: Path) -> Path:
    """root/sweeps: the shipped sweeps and their stacks/ as a fresh clone has them, with root/.venvs/KIND each
    stack environment there is (`environment`), where the sweeps name it."""
    sweeps = root / "sweeps"
    sweeps.mkdir()
    for path in CPU_SWEEPS:
        shutil.copy(path, sweeps / path.name)
    (sweeps / "stacks").symlink_to(REPO / "sweeps" / "stacks", target_is_directory=True)
    (root / ".venvs").mkdir()
    for kind in OWN_ENVIRONMENT.values():
        if environment(kind) is not None:
            (root / ".venvs" / kind).symlink_to(environment(kind), target_is_directory=True)
    return sweeps


def skip_without_environment(root: Path, sweep: Path) -> None:
    kind = OWN_ENVIRONMENT.get(sweep.stem)
    if kind and not os.access(root / ".venvs" / kind / "bin" / "python", os.X_OK):
        pytest.skip(f"{sweep.name} runs in {kind}'s own environment: build it with scripts/{kind}-venv.sh "
                    f".venvs/{kind}, or set RAYBENCH_{kind.upper()}_PYTHON to its interpreter")


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory) -> Path:
    sweeps = clone_of_sweeps(tmp_path_factory.mktemp("clone"))
    assert cli.main(["example-data", str(sweeps / "example-data")]) == 0
    return sweeps


def test_no_shipped_cpu_sweep_holds_a_path_to_edit():
    assert len(CPU_SWEEPS) >= 8
    assert [p.name for p in CPU_SWEEPS if "/EDIT-ME/" in p.read_text()] == []


@pytest.mark.parametrize("shipped", CPU_SWEEPS, ids=lambda p: p.stem)
def test_each_shipped_cpu_sweep_validates_on_the_example_data(shipped, sweeps, capsys):
    skip_without_environment(sweeps.parent, shipped)
    assert cli.main(["validate", str(sweeps / shipped.name)]) == 0, capsys.readouterr().err


def test_the_example_data_fits_the_example_model(sweeps):
    data = sweeps / "example-data"
    config = json.loads((data / "tiny-model" / "config.json").read_text())
    vocab = json.loads((data / "chat-tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocab) <= config["vocab_size"] == 128 and config["hidden_size"] == 64
    records = [json.loads(line) for line in (data / "chat.jsonl").read_text().splitlines()]
    assert len(records) == 200 and all(r["messages"][-1]["role"] == "assistant" for r in records)
    assert list((data / "text").glob("*.jsonl")) and (data / "text-tokenizer" / "tokenizer.json").is_file()


def test_sweep_dir_in_a_stacks_own_keys_is_the_sweep_files_directory(sweeps):
    from raybench.spec.load import load_sweep

    overrides = load_sweep(sweeps / "stack-torchtune-cpu.yaml").stack.overrides
    assert overrides["tokenizer.path"] == str((sweeps / "example-data" / "tokenizer.model").resolve())
    assert overrides["dataset.packed"] is True  # values other than text stay as they are
