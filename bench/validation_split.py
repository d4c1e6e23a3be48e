"""The fitting / held-out split of the committed GPU rows (bench/validation_split.yaml).

A row is a (Parquet file, trial id) pair. It is in the fitting set when the split file lists it under a constant
for its file; every other committed row, in any file, listed or not, is held out. bench/rehearse_validate.py
reports the two sets apart; tests/unit/test_validation_split.py checks the file against docs/results/.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SPLIT = REPO / "bench" / "validation_split.yaml"
# Where committed GPU rows live: one folder per GPU run, one Parquet file per sweep.
GPU_PARQUETS = "docs/results/gpu-*/*.parquet"
FITTING, HELDOUT = "fitting", "held-out"


@dataclass(frozen=True)
class FileEntry:
    """One Parquet file of GPU rows: its sweep, the GPU it ran on (as the hardware table names it), the rows
    that fitted each constant, and held-out rows that are not blind tests (why)."""

    path: str  # relative to the repository root
    sweep: str
    gpu: str
    fitting: dict[str, tuple[str, ...]] = field(default_factory=dict)
    not_blind: dict[str, str] = field(default_factory=dict)
    listed: bool = True  # False: the file is not in the split file (held out whole by the rule)

    def constants_fitted_on(self, trial_id: str) -> tuple[str, ...]:
        return tuple(name for name, ids in self.fitting.items() if trial_id in ids)

    def set_of(self, trial_id: str) -> str:
        return FITTING if self.constants_fitted_on(trial_id) else HELDOUT

    def fitting_ids(self) -> set[str]:
        return {i for ids in self.fitting.values() for i in ids}


@dataclass(frozen=True)
class Split:
    constants: dict[str, dict]
    files: dict[str, FileEntry]

    def fitted_configs(self) -> set[str]:
        """The configurations (trial ids less their repeat) any constant was fitted on, in any file: a held-out
        row of one of them (another day, another GPU) repeats a fitted configuration."""
        return {config_of(i) for entry in self.files.values() for i in entry.fitting_ids()}

    def entry(self, path: str | Path) -> FileEntry:
        """The split's entry for a Parquet file (a path relative to the repository or absolute); an unlisted
        file is held out whole, its sweep and GPU read from its rows."""
        rel = relative(path)
        if rel in self.files:
            return self.files[rel]
        import pandas as pd

        from raybench.spec import hardware

        rows = pd.read_parquet(REPO / rel, columns=["sweep", "gpu_name"])
        sweeps, gpus = rows.sweep.dropna().unique(), rows.gpu_name.dropna().unique()
        found = hardware.find_gpu(gpus[0]) if len(gpus) == 1 else None
        return FileEntry(path=rel, sweep=str(sweeps[0]) if len(sweeps) == 1 else "",
                         gpu=found.label if found else "", listed=False)


def config_of(trial_id: str) -> str:
    """A trial id's configuration: the id without its `-rN` repeat."""
    return trial_id.rsplit("-r", 1)[0]


def relative(path: str | Path) -> str:
    path = Path(path)
    if path.is_absolute():
        path = path.resolve().relative_to(REPO)
    return path.as_posix()


def load(path: Path = SPLIT) -> Split:
    raw = yaml.safe_load(path.read_text())
    files = {}
    for rel, spec in (raw.get("files") or {}).items():
        fitting = {name: tuple(ids or ()) for name, ids in (spec.get("fitting") or {}).items()}
        files[rel] = FileEntry(path=rel, sweep=spec["sweep"], gpu=spec["gpu"], fitting=fitting,
                               not_blind=dict(spec.get("not_blind") or {}))
    return Split(constants=dict(raw.get("constants") or {}), files=files)


def committed_parquets() -> list[str]:
    """The GPU Parquet files git tracks under docs/results (every file matching the pattern when git cannot
    say), relative to the repository root."""
    try:
        out = subprocess.run(["git", "ls-files", "--", GPU_PARQUETS], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = []
    return sorted(out) or sorted(relative(p) for p in REPO.glob(GPU_PARQUETS))
