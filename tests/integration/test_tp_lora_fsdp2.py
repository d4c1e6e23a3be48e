"""LoRA under TP x FSDP2 (4 gloo ranks, TP groups of 2) equals the unsplit model: test_tp_lora.py's cases for
tp_fsdp2, in a file of their own so that they can run in another test process than the 2-rank tp cases."""

from __future__ import annotations

import pytest
from test_tp_lora import DEFAULT_CASES, SLOW_CASES, run_cases

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("strategy", ["tp_fsdp2"])
def test_lora_under_tensor_parallelism_equals_the_unsplit_model(strategy):
    run_cases(strategy, DEFAULT_CASES[strategy])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tp_fsdp2"])
def test_every_other_combination_equals_the_unsplit_model(strategy):
    run_cases(strategy, SLOW_CASES[strategy])
