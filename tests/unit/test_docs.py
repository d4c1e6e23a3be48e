"""Docs that are generated from code stay in sync with it."""

from pathlib import Path

from raybench.spec.reference import render

REPO = Path(__file__).resolve().parents[2]


def test_sweep_reference_is_current():
    assert (REPO / "docs" / "sweep-reference.md").read_text() == render(), (
        "regenerate: python -m raybench.spec.reference > docs/sweep-reference.md")
