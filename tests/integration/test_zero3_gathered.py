"""What DeepSpeed ZeRO-3 holds gathered as backward begins, as the estimate counts it
(raybench/planning/zero3_gathered.py), against DeepSpeed's own parameter coordinator: real ZeRO-3 steps on 2 gloo
ranks (zero3_gathered.py under torchrun), with settings that set apart each rule: the head kept for its reuse,
more of the model's end kept under a longer reuse distance, the prefetch up to the live limit, the persistent
norms, and a model kept whole. In the same run: where in its step ZeRO-2 gathers its weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).with_name("zero3_gathered.py")

# The test model's modules hold 96 (norms), 4,608-24,576 (projections) and 49,152 (embedding, head) elements.
SETTINGS = [
    {"max_reuse_distance": 60_000, "param_persistence_threshold": 100, "max_live_parameters": 120_000},
    {"max_reuse_distance": 150_000, "param_persistence_threshold": 100, "max_live_parameters": 150_000},
    {"max_reuse_distance": 150_000, "param_persistence_threshold": 100, "max_live_parameters": 200_000},
    {"max_reuse_distance": 250_000, "param_persistence_threshold": 5_000, "max_live_parameters": 300_000},
    {"param_persistence_threshold": 100},  # DeepSpeed's reuse distance and live limit: the whole model kept
]


@pytest.fixture(scope="module")
def lines() -> list[dict]:
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(SCRIPT), json.dumps(SETTINGS)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


def test_zero3_holds_what_the_estimate_counts_as_backward_begins(lines):
    reports = [line for line in lines if "settings" in line]
    assert [r["settings"] for r in reports] == SETTINGS
    for report in reports:
        # The first step records the modules' order; DeepSpeed prefetches from the second on.
        assert report["gathered_by_step"][1:] == [report["predicted"]] * 2, report
    predicted = [r["predicted"] for r in reports]
    assert len(set(predicted)) == len(predicted)  # each settings' rule shows
    assert predicted[-1] == reports[-1]["model_elements"]


def test_zero2_gathers_its_weights_only_after_the_optimizer_step(lines):
    """What the rehearsal prices (step_time.gathered_after_step): in every ZeRO-2 step, DeepSpeed all-gathers the
    weights after the optimizer's step, and nothing is gathered before it."""
    (order,) = [line["collectives_by_step"] for line in lines if line.get("stage") == 2]
    assert len(order) == 2
    for step in order:
        gathers = [i for i, name in enumerate(step) if name.startswith("all_gather")]
        assert step.count("optimizer") == 1 and gathers and min(gathers) > step.index("optimizer"), step
