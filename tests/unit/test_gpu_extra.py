"""The gpu extra declares every package the GPU-only code imports, each pinned to the version that was run.

Modules the CPU install lacks are imported lazily by GPU code paths (QLoRA, Liger, NVML clocks and power); a
module no extra declares leaves its feature silently off on a GPU machine. pyproject.toml is parsed and every
module of the package scanned for imports, so a new GPU-only import fails here until the extra declares it.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The distribution that provides each GPU-only module (module and distribution names differ for NVML).
GPU_MODULE_DISTRIBUTIONS = {"bitsandbytes": "bitsandbytes", "liger_kernel": "liger-kernel", "pynvml": "nvidia-ml-py"}
# Imported only by a launcher that runs in a stack's own environment, never in raybench's (docs/stacks/).
OWN_ENVIRONMENT_MODULES = {"torchtune", "torchtitan"}
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([0-9][A-Za-z0-9.+!-]*)$")


def imported_top_level_modules() -> set[str]:
    """Top-level names of every absolute import in the package, at module level or inside functions."""
    names = set()
    for path in (REPO / "raybench").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"raybench", "__future__"}


def gpu_extra() -> dict[str, str]:
    """The gpu extra as {distribution: exact version}; any requirement not pinned with == is an error."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for requirement in project["optional-dependencies"]["gpu"]:
        match = PIN.match(requirement.replace(" ", ""))
        assert match, f"gpu extra: {requirement!r} is not pinned; pin the tested version, e.g. name==1.2.3"
        pins[match[1].lower()] = match[2]
    return pins


def test_every_module_missing_from_the_cpu_install_is_a_known_gpu_module():
    missing = {m for m in imported_top_level_modules() if importlib.util.find_spec(m) is None}
    unknown = missing - set(GPU_MODULE_DISTRIBUTIONS) - OWN_ENVIRONMENT_MODULES
    assert not unknown, (f"raybench imports {sorted(unknown)}, which the install lacks: add each to the gpu extra "
                         "in pyproject.toml and to GPU_MODULE_DISTRIBUTIONS here (or to the dependencies)")


def test_the_gpu_extra_declares_every_gpu_module_the_code_imports():
    declared = gpu_extra()
    imported = imported_top_level_modules() & set(GPU_MODULE_DISTRIBUTIONS)
    assert imported, "no GPU-only import found: the scan is broken"
    undeclared = {m: GPU_MODULE_DISTRIBUTIONS[m] for m in imported if GPU_MODULE_DISTRIBUTIONS[m] not in declared}
    assert not undeclared, f"imported but not in the gpu extra (module: distribution): {undeclared}"


def test_the_gpu_extra_pins_match_the_constraints():
    constraints = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if match := PIN.match(line.strip()):
            constraints[match[1].lower()] = match[2]
    for name, version in gpu_extra().items():
        assert constraints.get(name) == version, (
            f"constraints.txt pins {name} to {constraints.get(name)}, the gpu extra to {version}: make them equal")


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="pynvml is installed")
def test_a_fingerprint_without_pynvml_says_so(caplog):
    from raybench.runtime import fingerprint

    fingerprint.warn_nvml_missing.cache_clear()
    with caplog.at_level("WARNING", logger=fingerprint.__name__):
        assert fingerprint.nvml_details(0) == {}
    assert "pynvml is not installed" in caplog.text and "raybench[gpu]" in caplog.text
