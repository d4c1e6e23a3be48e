"""A lightning entry that declares `ctx` trains on raybench's rows and collator over the trial's data spec: the
same packed batches raybench's loop takes. One rank, no Ray: the stack's build and Lightning's fit as a trial's rank
runs them, the probe counting every micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from raybench.data.prepare import with_prepared_data
from raybench.planning.plan import plan
from raybench.runtime.probe import StepProbe
from raybench.runtime.stacks import lightning
from raybench.runtime.strategies import RankContext
from raybench.spec.errors import ConfigError
from raybench.spec.load import load_sweep

USER_DIR = Path(__file__).resolve().parents[1] / "stacks_user"
# The chat data (tests/conftest.py) packs into 8 rows of 64 tokens: 2 steps of 2 x 2 rows are one epoch.
SEQ_LEN, BATCH, GRAD_ACCUM, STEPS = 64, 2, 2, 2


def _sweep(tmp_path: Path, model_dir: Path, chat_file: Path, chat_tokenizer: Path, entry: str,
           data: dict | None = None, overrides: dict | None = None) -> Path:
    spec = {"name": "lightning-rows", "model": {"path": str(model_dir)},
            "data": {"source": "hf", "path": str(chat_file), "tokenizer": str(chat_tokenizer), "format": "messages",
                     "loss_on": "assistant", "packing": True, **(data or {})},
            "train": {"steps": STEPS, "warmup_steps": 0, "seq_len": SEQ_LEN, "grad_accum": GRAD_ACCUM,
                      "precision": "fp32"},
            "resources": {"workers": 1, "cpus_per_worker": 1},
            "stack": {"kind": "lightning", "entry": entry, "pythonpath": [str(USER_DIR)],
                      "overrides": {"model_path": str(model_dir), "batch_size": BATCH, "strategy": "ddp",
                                    **(overrides or {})}}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(name, "0")  # seed_everything sets them: restored (removed) after the test
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    yield RankContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    dist.destroy_process_group()


def test_a_ctx_entry_trains_one_epoch_on_raybenchs_rows(tmp_path, model_dir, chat_file, chat_tokenizer,
                                                        chat_tokens, one_rank):
    path = _sweep(tmp_path, model_dir, chat_file, chat_tokenizer, "lightning_user:build_from_rows")
    (trial,) = with_prepared_data(plan(load_sweep(path)), str(tmp_path / "store"), progress=lambda line: None)
    payload = trial.payload.replace(cache_dir=str(tmp_path / "store" / "_cache"))
    probe = StepProbe(one_rank.device)
    run = lightning.build(payload, one_rank, probe)
    run.train()  # the entry's module refuses a batch with anything but model inputs: the count was taken out
    record = probe.record
    assert len(record.step_times_s) == STEPS and run.data.used == "rows" and run.seq_len == SEQ_LEN
    assert record.tokens == [GRAD_ACCUM * BATCH * SEQ_LEN] * STEPS
    # Packed rows carry no attention mask: the real tokens are the collator's own count, every one of the epoch.
    assert sum(record.nonpad_tokens) == sum(min(len(ids), SEQ_LEN) for ids, _ in chat_tokens)
    assert all(loss == loss for loss in record.losses)  # not NaN


# (case, entry, data fields, overrides, the field named, words of the message): what the function still does not take
BAD = [
    ("entry_without_ctx", "lightning_user:build", {}, {}, "data.source", "takes no 'ctx' parameter"),
    ("loader_field", "lightning_user:build_from_rows", {"num_workers": 2}, {}, "data.num_workers",
     "builds the DataLoader"),
    ("ctx_override", "lightning_user:build_from_rows", {}, {"ctx": 1}, "stack.overrides.ctx",
     "raybench passes the trial's context"),
]


@pytest.mark.parametrize("case, entry, data, overrides, field, words", BAD, ids=[case[0] for case in BAD])
def test_what_the_function_does_not_take_is_refused(case, entry, data, overrides, field, words, tmp_path, model_dir,
                                                    chat_file, chat_tokenizer):
    path = _sweep(tmp_path, model_dir, chat_file, chat_tokenizer, entry, data, overrides)
    with pytest.raises(ConfigError) as err:
        plan(load_sweep(path), source=str(path))
    named = [p for p in err.value.problems if p.field == field]
    assert named and words in named[0].message, [str(p) for p in err.value.problems]
