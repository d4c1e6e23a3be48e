"""The hf stack on raybench's tokenized data, one rank and no Ray: the config path's SFTTrainer trains on the data
spec's tokenized samples, and nothing TRL derives from them is written into the store's cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from raybench.data.prepare import with_prepared_data
from raybench.planning.plan import plan
from raybench.runtime.probe import StepProbe
from raybench.runtime.stacks import hf
from raybench.runtime.strategies import RankContext
from raybench.spec.load import load_sweep

SEQ_LEN, BATCH, STEPS = 64, 2, 2


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)  # what the launcher sets; restored after the test
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    yield RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    dist.destroy_process_group()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer's device state stays with this test


def test_the_config_path_trains_on_the_tokenized_samples(tmp_path, model_dir, chat_file, chat_tokenizer, one_rank):
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({"packing": False}))
    spec = {"name": "hf-rows", "model": {"path": str(model_dir)},
            "data": {"source": "hf", "path": str(chat_file), "tokenizer": str(chat_tokenizer), "format": "messages",
                     "loss_on": "assistant"},
            "train": {"steps": STEPS, "warmup_steps": 0, "seq_len": SEQ_LEN, "micro_batch": BATCH,
                      "precision": "fp32"},
            "resources": {"workers": 1, "cpus_per_worker": 1}, "stack": {"kind": "hf", "config": "sft.yaml"}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    (trial,) = with_prepared_data(plan(load_sweep(tmp_path / "sweep.yaml")), str(tmp_path / "store"),
                             progress=lambda line: None)
    payload = trial.payload.replace(cache_dir=str(tmp_path / "store" / "_cache"))
    cached = sorted(p.name for p in Path(payload.tokenized.path).iterdir())
    probe = StepProbe(one_rank.device)
    run = hf.build(payload, one_rank, probe)
    run.train()
    record = probe.record
    assert run.data.used == "samples" and len(record.step_times_s) == STEPS and "trl" in run.version
    # TRL pads each batch to its longest sample, one sample per row: padding is counted apart from the real tokens.
    assert all(0 < nonpad <= tokens <= BATCH * SEQ_LEN for tokens, nonpad in zip(record.tokens,
                                                                                record.nonpad_tokens))
    assert all(loss == loss for loss in record.losses)  # not NaN
    assert sorted(p.name for p in Path(payload.tokenized.path).iterdir()) == cached


@pytest.mark.parametrize("ratio", ["0", "1"])
def test_layers_checkpointed_against_ac_ratio_fail_the_trial_before_its_first_step(tmp_path, model_dir, chat_file,
                                                                                  chat_tokenizer, one_rank, ratio):
    """An entry (or a library default, as SFTConfig's on transformers before 5.23) that checkpoints the layers at
    ac_ratio 0 would measure something the row does not say: the trial fails naming train.ac_ratio. At ac_ratio 1
    the same entry trains."""
    spec = {"name": "hf-ac", "model": {"path": str(model_dir)},
            "data": {"source": "hf", "path": str(chat_file), "tokenizer": str(chat_tokenizer), "format": "messages"},
            "train": {"steps": 1, "warmup_steps": 0, "seq_len": SEQ_LEN, "micro_batch": BATCH, "precision": "fp32",
                      "ac_ratio": ratio},
            "resources": {"workers": 1, "cpus_per_worker": 1},
            "stack": {"kind": "hf", "entry": "hf_user:build_checkpointed_trainer",
                      "pythonpath": [str(Path(__file__).resolve().parents[1] / "stacks_user")]}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    (trial,) = with_prepared_data(plan(load_sweep(tmp_path / "sweep.yaml")), str(tmp_path / "store"),
                             progress=lambda line: None)
    probe = StepProbe(one_rank.device)
    run = hf.build(trial.payload.replace(cache_dir=str(tmp_path / "store" / "_cache")), one_rank, probe)
    if ratio == "1":
        run.train()
        assert len(probe.record.step_times_s) == 1
        return
    with pytest.raises(ValueError, match="the trainer checkpoints the model's layers but train.ac_ratio is 0"):
        run.train()
    assert not probe.record.step_times_s
