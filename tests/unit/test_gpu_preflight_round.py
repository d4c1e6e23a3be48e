"""GPU round 11's CPU twin: bench/preflight_round.py's NCCL part on two gloo ranks (its pre-flight part is
`raybench cluster check`'s path, run on a local Ray by tests/integration/test_preflight_ray.py), so the round's
command cannot rot before a GPU comes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_rounds_nccl_part_runs_and_says_gloo_is_not_checked(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "bench" / "preflight_round.py"), str(tmp_path), "--nccl-only"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        said = json.loads((tmp_path / f"nccl-rank{rank}.json").read_text())
        assert said == {"transports": None, "check": "not checked (gloo)"}
    assert done.stdout.count("not checked (gloo)") == 2
