"""A Lightning stack as a trial on a real local Ray: Ray Train starts 2 gloo workers, each joins the process group
with Lightning's DDP strategy and trains the user's tiny Llama (tests/stacks_user/lightning_user.py); the probe's
records come back as one row. DDP, as on CPU Lightning runs neither DeepSpeed nor FSDP (docs/stacks/lightning.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raybench import read_results
from raybench.cli import main as cli
from tests.conftest import write_sweep

pytestmark = pytest.mark.integration
USER_DIR = Path(__file__).resolve().parents[1] / "stacks_user"

WORKERS, GRAD_ACCUM, BATCH, SEQ_LEN, PAD = 2, 2, 2, 32, 4


def test_lightning_trial_on_ray(tmp_path, model_dir):
    sweep = write_sweep(tmp_path / "lightning.yaml", f"""
name: stack-lightning-test
model: {{path: {model_dir}}}
train: {{steps: 4, warmup_steps: 1, grad_accum: {GRAD_ACCUM}, precision: fp32, seed: 3}}
resources: {{workers: {WORKERS}, cpus_per_worker: 1, timeout_s: 600}}
stack:
  kind: lightning
  entry: lightning_user:build
  pythonpath: [{USER_DIR}]
  overrides:
    strategy: ddp
    model_path: {model_dir}
    batch_size: {BATCH}
    seq_len: {SEQ_LEN}
    pad_tokens: {PAD}
    log_every_n_steps: 1
""")
    assert cli.main(["run", str(sweep), "--store", str(tmp_path / "store")]) == 0
    rows = read_results(str(tmp_path / "store"), "stack-lightning-test")
    assert len(rows) == 1
    row = rows.iloc[0]
    assert row.status == "ok", row.message
    assert row.stack_kind == "lightning" and row.stack_entry == "lightning_user:build"
    assert json.loads(row.stack_overrides_json)["pad_tokens"] == PAD
    assert "lightning 2." in row.stack_version and row.world_size == WORKERS
    # Every micro-batch of the optimizer step on every rank: the probe counted what the batches held.
    assert row.tokens_per_step == WORKERS * GRAD_ACCUM * BATCH * SEQ_LEN
    assert row.nonpad_tokens_per_step == WORKERS * GRAD_ACCUM * BATCH * (SEQ_LEN - PAD)
    assert row.steps_timed == 3 and row.tok_per_s_per_device > 0 and row.step_time_p50_s > 0
    assert math.isfinite(row.loss_first) and math.isfinite(row.loss_final)
    # The module holds a transformers decoder and nothing else: its shape gives FLOPs per token.
    assert row.params_total > 0 and row.flops_per_token > 0
