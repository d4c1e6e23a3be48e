"""LoRA under tensor parallelism equals the unsplit model: on 2 gloo ranks (tp) and 4 (tp_fsdp2, TP groups of 2),
the same weights and batch give the same loss and the same gathered adapter gradients as one whole LoRA model,
for each adapter target set, with and without selective AC and compile; the frozen base stays frozen
(tests/integration/tp_lora_values.py does the comparing). The default run takes one case per target set, selective
AC, and dropout; `-m slow` runs the rest, the compiled cases among them (compiled TP trains in the default run:
test_strategies.py's tp case). The tp_fsdp2 cases run from test_tp_lora_fsdp2.py: a file of
their own, so that the two runs can go to different test processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
VALUES_SCRIPT = Path(__file__).with_name("tp_lora_values.py")
# targets:ac_ratio:compile[:dropout]
DEFAULT_CASES = {"tp": ["attention:0:0", "attention_mlp:1/2:0", "all_linear:1/2:0", "all_linear:0:0:0.1"],
                 "tp_fsdp2": ["all_linear:1/2:0"]}
SLOW_CASES = {"tp": ["attention:1/2:1", "attention_mlp:0:1", "all_linear:1/2:1", "all_linear:1:0"],
              "tp_fsdp2": ["attention:0:0", "attention_mlp:1/2:1", "all_linear:0:1", "all_linear:0:0:0.1"]}
WORLD = {"tp": 2, "tp_fsdp2": 4}


def run_cases(strategy: str, cases: list[str]) -> None:
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc-per-node={WORLD[strategy]}", str(VALUES_SCRIPT), strategy, *cases],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{strategy}: {len(cases)} cases equal to the unsplit model" in run.stdout


@pytest.mark.parametrize("strategy", ["tp"])
def test_lora_under_tensor_parallelism_equals_the_unsplit_model(strategy):
    run_cases(strategy, DEFAULT_CASES[strategy])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tp"])
def test_every_other_combination_equals_the_unsplit_model(strategy):
    run_cases(strategy, SLOW_CASES[strategy])
