"""Docs that are generated from code stay in sync with it, and the sweep files the docs name ship."""

import os
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


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_command_stack_doc_lists_the_environment_the_code_gives(tmp_path):
    """docs/stacks/command.md names every variable raybench sets for a command, and exactly the train.env prefixes
    the spec accepts."""
    from raybench.drivers.executors import command
    from raybench.planning.plan import plan
    from raybench.spec.load import parse_sweep
    from raybench.spec.values import ENV_PREFIXES

    section = _section((REPO / "docs" / "stacks" / "command.md").read_text(), "Environment")
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE))
    set_by_raybench = set()
    for gpus in (0, 1):
        sweep = {"name": "env", "model": {"preset": "tiny"}, "resources": {"gpus_per_worker": gpus},
                 "train": {"env": {"NCCL_DEBUG": "INFO"}},
                 "stack": {"kind": "command", "command": ["{python}", "train.py"]}}
        payload = plan(parse_sweep(sweep))[0].payload
        env = command._command_env(payload, tmp_path, str(tmp_path))
        set_by_raybench |= {name for name, value in env.items() if os.environ.get(name) != value} - {"NCCL_DEBUG"}
    assert documented == set_by_raybench
    prefixes = section.split("`train.env` takes", 1)[1].split(":", 1)[0]
    assert re.findall(r"`(\w+)`", prefixes) == list(ENV_PREFIXES)
