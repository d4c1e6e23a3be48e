"""Seed 003's CPU twin (sweeps/seed003-hf-lora-cpu.yaml) as shipped, on `raybench example-data`'s files: one of its
four trials under `raybench trial` (torchrun, no Ray: the cheap way to run a trial), the one that exercises what its
GPU sweep adds to the hf stack: TRL loading model.path with SFTConfig's model_init_kwargs, LoRA adapters from the
entry, and an optimizer swapped by the `change` bundle (stack.overrides.optim). train.ac_ratio's mapping onto
SFTConfig: tests/unit/test_stack_hf_config.py. The whole sweep runs under `raybench run` in
tests/integration/test_shipped_cpu_sweeps.py (-m slow)."""

from __future__ import annotations

import json

import pytest

from raybench.cli import main as cli
from raybench.results import store
from tests.unit.test_example_data import clone_of_sweeps

pytestmark = pytest.mark.integration
SWEEP = "seed003-hf-lora-cpu.yaml"
SEQ_LEN, SEQUENCES_PER_STEP = 64, 4  # the sweep's train.seq_len, micro_batch x grad_accum
ADAFACTOR = 3  # plan index: the `change` bundle's fourth point


def test_seed003_cpu_twin_trials_run_as_shipped(tmp_path):
    sweeps = clone_of_sweeps(tmp_path)
    assert cli.main(["example-data", str(sweeps / "example-data")]) == 0
    assert cli.main(["trial", str(sweeps / SWEEP), str(ADAFACTOR), "--store", str(tmp_path / "store")]) == 0
    rows = store.read_results(tmp_path / "store")
    assert len(rows) == 1 and set(rows.status) == {"ok"}
    # LoRA r16 on the 7 projections of each decoder layer trains (r x (in + out) each), the base does not.
    config = json.loads((sweeps / "example-data" / "tiny-model" / "config.json").read_text())
    hidden, mlp, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    per_layer = 16 * (2 * (hidden + hidden) + 2 * (hidden + kv) + 3 * (hidden + mlp))  # q, o; k, v; gate, up, down
    assert set(rows.params_trainable) == {layers * per_layer} and (rows.params_total > layers * per_layer).all()
    assert (rows.tokens_per_step <= SEQUENCES_PER_STEP * SEQ_LEN).all() and (rows.tokens_per_step > 0).all()
    overrides = json.loads(rows.stack_overrides_json.iloc[0])
    assert overrides["optim"] == "adafactor" and overrides["model_init_kwargs"] == {"dtype": "float32"}
    assert rows.stack_version.str.contains("peft").all()  # the entry's PEFT model is what trained
