"""What a `command` stack's row says of the script that ran: the parameters and FLOPs of what it trained, as it
reported them to the probe (a LoRA script is no full fine-tune)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from raybench.drivers.executors import command as command_executor
from raybench.planning.estimate import param_counts
from raybench.planning.plan import plan
from raybench.runtime.probe import RECORD_DIR_ENV, StepProbe
from raybench.spec import metrics
from raybench.spec.load import load_sweep
from raybench.spec.presets import PRESETS
from tests.conftest import write_sweep

SEQ_LEN = 64
TINY = PRESETS["tiny"]


def _command_config(tmp_path, command: str = '["{python}", "train.py", "--seq-len", "{seq_len}"]'):
    text = f"""
name: command-facts
model: {{preset: tiny}}
train: {{seq_len: {SEQ_LEN}}}
stack: {{kind: command, command: {command}}}
"""
    return plan(load_sweep(write_sweep(tmp_path / "sweep.yaml", text)))[0].config


class _LoraLinear(nn.Module):
    """A frozen linear layer with a rank-2 update that trains, as a LoRA script builds it."""

    def __init__(self, features: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(features, features, bias=False).requires_grad_(False)
        self.a = nn.Linear(features, rank, bias=False)
        self.b = nn.Linear(rank, features, bias=False)


def test_the_probe_records_the_parameters_the_script_trains(tmp_path, monkeypatch):
    monkeypatch.setenv(RECORD_DIR_ENV, str(tmp_path))
    probe = StepProbe(torch.device("cpu"))
    probe.count_params(_LoraLinear(16))
    probe.start()
    probe.step(tokens=8)
    written = json.loads(probe.finish().read_text())
    assert written["params"] == {"total": 16 * 16 + 2 * 2 * 16, "trainable": 2 * 2 * 16}
    with pytest.raises(ValueError, match="trainable parameters must be at least 1 and at most the total"):
        probe.set_params(total=10, trainable=11)


def test_a_lora_scripts_row_has_its_adapters_trainable_and_their_flops(tmp_path):
    config = _command_config(tmp_path)
    base = param_counts(TINY, config.train).total
    adapters = 65_536
    total, trainable, flops = command_executor._model_facts(config, {"total": base + adapters, "trainable": adapters})
    assert (total, trainable) == (base + adapters, adapters)
    matmul = metrics.matmul_params(base + adapters, TINY.vocab_size, TINY.hidden_size, TINY.tie_word_embeddings)
    # A frozen base: forward and activation gradients (4 a weight a token), weight gradients only for the adapters.
    assert flops == metrics.flops_per_token(matmul, adapters, False, TINY.num_hidden_layers, SEQ_LEN,
                                            TINY.hidden_size)
    full = metrics.flops_per_token(matmul, base + adapters, True, TINY.num_hidden_layers, SEQ_LEN, TINY.hidden_size)
    assert flops < 0.8 * full  # the full fine-tune's figure would overstate its MFU


def test_a_full_fine_tune_reported_by_the_script_gets_six_flops_a_weight(tmp_path):
    config = _command_config(tmp_path)
    base = param_counts(TINY, config.train).total
    _, trainable, flops = command_executor._model_facts(config, {"total": base, "trainable": base})
    matmul = metrics.matmul_params(base, TINY.vocab_size, TINY.hidden_size, TINY.tie_word_embeddings)
    assert trainable == base
    assert flops == metrics.flops_per_token(matmul, base, True, TINY.num_hidden_layers, SEQ_LEN, TINY.hidden_size)


def test_without_the_scripts_report_trainable_parameters_and_flops_are_null(tmp_path):
    config = _command_config(tmp_path)
    total, trainable, flops = command_executor._model_facts(config, None)
    assert total == param_counts(TINY, config.train).total  # the model section's model
    assert trainable is None and flops is None  # not a full fine-tune's guess: MFU null


def test_a_report_of_a_smaller_model_than_the_model_section_gives_no_flops(tmp_path):
    config = _command_config(tmp_path)
    total, trainable, flops = command_executor._model_facts(config, {"total": 4160, "trainable": 4160})
    assert (total, trainable, flops) == (4160, 4160, None)
