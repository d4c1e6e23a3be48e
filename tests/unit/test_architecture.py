"""The package's shape: `import raybench` stays cheap, and no module reaches into another's private names.
(The layer and Ray/torch contracts themselves are checked by `lint-imports`, configured in pyproject.toml.)"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "raybench"


def test_import_raybench_loads_no_pyarrow_torch_or_ray():
    code = "import sys, raybench; print(sorted(m for m in ('pyarrow', 'torch', 'ray', 'pandas', 'optuna') " \
           "if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # ... and the public API is still there, loaded on first use.
    code = "import raybench; print(raybench.load_sweep.__module__, raybench.run_sweep.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["raybench.config", "raybench.api"]


# Private Ray APIs raybench relies on (Ray is pinned): each behind one function, and pinned by a test of its own.
ALLOWED_PRIVATE = {
    # The GCS placement-group table with each group's creator, which no public API returns
    # (release_orphaned_placement_groups; test_faults_ray.py::test_ended_ray_train_trials_leave_...).
    "train.py: ray._private.state",
}


def test_no_module_imports_another_modules_private_names():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("raybench", "ray", "optuna"):
                offenders += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray._private"):
                offenders.append(f"{path.name}: {node.module}")
    assert sorted(set(offenders) - ALLOWED_PRIVATE) == []
