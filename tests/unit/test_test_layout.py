"""The test folders say what their tests start: tests/unit runs in the test's own process (a short-lived
interpreter that checks a clean import is allowed); tests/integration starts Ray, torchrun, SLURM or worlds of
several processes (gloo ranks, concurrent writers), and every file there is marked `integration`."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# What starts Ray, torchrun, SLURM or another long-lived process from a test's source.
STARTERS = re.compile(r"ray_cluster\(|ray\.init\(|get_context\(|\.Process\(|torchrun\.execute\(|executors\.get\("
                      r"|slurm_cluster|mark\.integration")


def starters_in(path: Path) -> list[str]:
    return [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if STARTERS.search(line)]


def test_unit_tests_start_no_ray_torchrun_slurm_or_process_world():
    found = [hit for path in sorted((TESTS / "unit").glob("*.py")) if path != Path(__file__)
             for hit in starters_in(path)]
    assert found == [], "move these tests to tests/integration:\n" + "\n".join(found)


def test_the_scan_finds_a_starter(tmp_path):
    test = tmp_path / "test_x.py"
    test.write_text("def test_x():\n    ctx = mp.get_context('spawn')\n")
    assert starters_in(test) == ["test_x.py:2: ctx = mp.get_context('spawn')"]


def test_every_integration_test_file_is_marked():
    marked = re.compile(r"^pytestmark = \[?pytest\.mark\.integration\b", re.M)
    unmarked = [p.name for p in sorted((TESTS / "integration").glob("test_*.py")) if not marked.search(p.read_text())]
    assert unmarked == []


def test_no_two_test_files_share_a_name():
    """The test folders are not packages: pytest imports each file by its base name, so a second file of the same
    name in the other folder fails the collection of whichever comes second."""
    names = [p.name for p in sorted(TESTS.rglob("test_*.py"))]
    assert sorted({n for n in names if names.count(n) > 1}) == []
