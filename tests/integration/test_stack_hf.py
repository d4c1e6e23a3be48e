"""The hf stack for real: TRL's SFTTrainer on a tiny Llama and a local JSONL file, 2 gloo ranks of a Ray Train
run, measured by raybench's probe. The entry is tests/stacks_user/hf_user.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from raybench import read_results
from raybench.cli import main as cli

from tests.conftest import WORDS, make_model_dir

pytestmark = pytest.mark.integration
USER_DIR = Path(__file__).resolve().parents[1] / "stacks_user"
WORKERS, MICRO_BATCH, GRAD_ACCUM, SEQ_LEN = 2, 2, 2, 32


def test_sft_trainer_rows_measured_by_the_probe(tmp_path):
    model = make_model_dir(tmp_path / "model")
    data = tmp_path / "text.jsonl"
    # Texts of 10 to 39 words: the longer ones are cut at max_length, the shorter padded up to it.
    data.write_text("\n".join(json.dumps({"text": " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(10 + i))})
                              for i in range(30)))
    sweep = tmp_path / "stack-hf.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "stack-hf", "model": {"path": str(model)},
        "data": {"source": "hf", "path": str(data), "format": "text"},
        "train": {"steps": 4, "warmup_steps": 1, "seq_len": SEQ_LEN, "micro_batch": MICRO_BATCH,
                  "grad_accum": GRAD_ACCUM, "precision": "fp32", "lr": 1e-3},
        "resources": {"workers": WORKERS, "cpus_per_worker": 1},
        # Every batch padded to max_length: the tokens each step holds are known exactly.
        "stack": {"kind": "hf", "entry": "hf_user:build_trainer", "pythonpath": [str(USER_DIR)],
                  "overrides": {"pad_to_multiple_of": SEQ_LEN}}}))
    store = tmp_path / "store"
    assert cli.main(["run", str(sweep), "--store", str(store)]) == 0
    rows = read_results(str(store), "stack-hf")
    assert len(rows) == 1
    row = rows.iloc[0]
    assert row.status == "ok", row.error_detail
    assert row.executor == "train" and row.stack_kind == "hf" and row.world_size == WORKERS
    assert row.tokens_per_step == WORKERS * MICRO_BATCH * SEQ_LEN * GRAD_ACCUM
    assert 0 < row.nonpad_tokens_per_step < row.tokens_per_step  # the padding is counted apart
    assert row.tok_per_s_per_device > 0 and row.steps_timed == 3
    assert math.isfinite(row.loss_first) and math.isfinite(row.loss_final)
    assert "trl" in row.stack_version and "transformers" in row.stack_version
    assert row.flops_per_token > 0  # the model's shape and the batches' sequence length are known
