"""Docs that are generated from code stay in sync with it, and the sweep files the docs name ship."""

import re
from pathlib import Path

from raybench.spec.reference import render

REPO = Path(__file__).resolve().parents[2]
# A sweep file named in prose or a command: sweeps/NAME.yaml or bench/sweeps/NAME.yaml (a glob such as
# sweeps/seed00*.yaml must match at least one file).
SWEEP_PATH = re.compile(r"(?<![\w/.-])((?:bench/)?sweeps/[\w.*-]+\.ya?ml)")


def test_sweep_reference_is_current():
    assert (REPO / "docs" / "sweep-reference.md").read_text() == render(), (
        "regenerate: python -m raybench.spec.reference > docs/sweep-reference.md")


def user_docs() -> list[Path]:
    """README.md, docs/*.md and cluster_yaml/README.md; docs/results/ are dated records whose commands keep the paths
    of their day."""
    return [REPO / "README.md", REPO / "cluster_yaml" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_sweep_file_the_docs_name_ships():
    missing = [f"{doc.relative_to(REPO)}: {path}" for doc in user_docs()
               for path in sorted(set(SWEEP_PATH.findall(doc.read_text()))) if not list(REPO.glob(path))]
    assert not missing, "sweep files named in the docs but not shipped (fix the path or ship the file):\n" + \
        "\n".join(missing)


def test_the_readme_and_user_guide_point_at_user_sweeps_only():
    # bench/sweeps/ holds the project's own regression sweeps; a user starts from sweeps/.
    for doc in (REPO / "README.md", REPO / "docs" / "user-guide.md"):
        named = set(SWEEP_PATH.findall(doc.read_text()))
        assert named and not {p for p in named if p.startswith("bench/")}, (doc.name, sorted(named))
