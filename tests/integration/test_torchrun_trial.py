"""`raybench trial` runs one planned trial under plain torchrun, with no Ray involved."""

from __future__ import annotations

import pytest

from raybench.cli import main as cli
from raybench.results import store

pytestmark = pytest.mark.integration


def test_trial_on_local_model_and_json_data(tmp_path, model_dir, alpaca_file, capsys):
    sweep = tmp_path / "local.yaml"
    sweep.write_text(f"""
name: local
model: {{path: {model_dir}}}
data: {{source: json, path: {alpaca_file}, packing: true}}
train: {{steps: 6, warmup_steps: 1, seq_len: 32, micro_batch: 2, precision: fp32, lr: 1.0e-3, strategy: fsdp2,
         profile_steps: 2}}
resources: {{workers: 2}}
store: {tmp_path / 'store'}
""")
    assert cli.main(["trial", str(sweep), "0"]) == 0
    rows = store.read_results(tmp_path / "store")
    row = rows.iloc[0]
    assert row.status == "ok" and row.executor == "torchrun" and row.world_size == 2
    assert row.tokens_per_step == 2 * 32 * 2
    assert row.steps_timed == 5 and row.tok_per_s > 0 and row.step_time_p90_s >= row.step_time_p50_s
    assert row.nonpad_tok_per_s == pytest.approx(row.tok_per_s, rel=1e-6)  # packed: no padding
    assert row.loss_final < row.loss_first  # a real training run on real text
    assert row.mfu is None or row.mfu != row.mfu  # CPU: no peak, no MFU
    # The step profile (two more steps after the timed ones): where a step's time went on rank 0.
    categories = [row[f"profile_{c}_s"] for c in ("matmul", "attention", "elementwise", "optimizer", "comm", "idle")]
    assert row.train_profile_steps == 2 and min(categories) >= 0
    assert row.profile_matmul_s > 0 and row.profile_attention_s > 0 and row.profile_optimizer_s > 0
    assert row.profile_comm_s > 0  # FSDP2 gathers and reduce-scatters across the two ranks
    assert sum(categories) == pytest.approx(row.profile_step_s, rel=1e-6)  # CPU: one thread, no overlap


def test_failed_trial_becomes_a_row(tmp_path, capsys):
    sweep = tmp_path / "gpu.yaml"
    sweep.write_text(f"name: gpu\nmodel: {{preset: tiny}}\ntrain: {{steps: 2, warmup_steps: 0, seq_len: 16}}\n"
                     f"resources: {{gpus_per_worker: 1}}\nstore: {tmp_path / 'store'}\n")
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU-only error path")
    assert cli.main(["trial", str(sweep), "0"]) == 1
    row = store.read_results(tmp_path / "store").iloc[0]
    assert row.status == "error" and "CUDA is not available" in row.message
