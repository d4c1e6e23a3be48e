"""Users' own training stacks as trials of two real sweeps on one store (one on a local Ray, one under torchrun),
each on 2 gloo ranks of 1 CPU, measured by the probe and read back from Parquet:
- hf: TRL's SFTTrainer on a tiny Llama and a local JSONL file (tests/stacks_user/hf_user.py), Ray Train workers;
- hf on raybench's data: a plain transformers Trainer on the rows and collator raybench's loop builds from a chat data
  spec, and raybench's own loop on the same spec (a second sweep on the same store, under torchrun): the same
  tokens;
- lightning: the user's LightningModule under Lightning's DDP (tests/stacks_user/lightning_user.py), in the second
  sweep (torchrun: Lightning joins the ranks' process group the same way under either executor); DDP, as on CPU
  Lightning runs neither DeepSpeed nor FSDP (docs/stacks/lightning.md);
- command: the user's own script under torchrun (tests/stacks_user/probe_train.py) in a Ray task, three times: one
  that trains, one that crashes, one that hangs past resources.timeout_s.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from raybench import read_results
from raybench.cli import main as cli
from raybench.drivers.ray_cluster import ray_cluster
from tests.conftest import WORDS, make_model_dir

pytestmark = pytest.mark.integration
USER_DIR = Path(__file__).resolve().parents[1] / "stacks_user"
SCRIPT = USER_DIR / "probe_train.py"
WORKERS, MICRO_BATCH, GRAD_ACCUM, SEQ_LEN = 2, 2, 2, 32
PAD = 4  # lightning: padding positions at the end of each sequence
COMMAND_SEQ_LEN, HANG_TIMEOUT_S = 16, 8
VOCAB, HIDDEN = 64, 32  # the command script's model (tests/stacks_user/probe_train.py)
# The same-tokens cases: the chat data (tests/conftest.py, 16 conversations of 14 to 40 tokens) packs into 8 rows of
# 64 tokens, so 2 steps of 2 ranks x 1 x 2 rows, all timed, run exactly one epoch.
ROWS_MICRO_BATCH, ROWS_SEQ_LEN, ROWS_STEPS = 1, 64, 2


def _same_tokens(model: Path, chat: Path, tokenizer: Path) -> dict:
    """The fields both loops share: the data spec, the layout, one epoch."""
    return {"data.source": "hf", "data.path": str(chat), "data.tokenizer": str(tokenizer), "data.format": "messages",
            "data.loss_on": "assistant", "data.packing": True, "model.path": str(model),
            "train.seq_len": ROWS_SEQ_LEN, "train.micro_batch": ROWS_MICRO_BATCH, "train.grad_accum": GRAD_ACCUM,
            "train.steps": ROWS_STEPS, "train.warmup_steps": 0, "train.precision": "fp32", "train.lr": 1e-3}


def _sweep(model: Path, data: Path, chat: Path, tokenizer: Path) -> dict:
    hf = {"stack.kind": "hf", "stack.entry": "hf_user:build_trainer", "stack.pythonpath": [str(USER_DIR)],
          # Every batch padded to max_length: the tokens each step holds are known exactly.
          "stack.overrides": {"pad_to_multiple_of": SEQ_LEN},
          "data.source": "hf", "data.path": str(data), "data.format": "text",
          "train.seq_len": SEQ_LEN, "train.micro_batch": MICRO_BATCH, "train.grad_accum": GRAD_ACCUM,
          "train.precision": "fp32", "train.lr": 1e-3}
    command = ["{python}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{workers}",
               str(SCRIPT), "--steps", "{steps}", "--micro-batch", "{micro_batch}", "--seq-len", "{seq_len}",
               "--mode", "{mode}"]

    def command_case(mode: str, **more) -> dict:
        return {"stack.kind": "command", "stack.command": command, "stack.overrides": {"mode": mode},
                "train.micro_batch": MICRO_BATCH, "train.seq_len": COMMAND_SEQ_LEN, **more}

    return {"name": "stacks", "model": {"path": str(model)}, "train": {"steps": 4, "warmup_steps": 1},
            "resources": {"workers": WORKERS, "cpus_per_worker": 1, "timeout_s": 300},
            "axes": {"case": [hf, command_case("ok"), command_case("crash"),
                              command_case("hang", **{"resources.timeout_s": HANG_TIMEOUT_S})]}}


def _local_sweep(model: Path, chat: Path, tokenizer: Path) -> dict:
    """A plain transformers Trainer on raybench's rows, raybench's own loop on the same data spec, and the lightning
    case: trials of the Ray-free torchrun executor (a Ray Train trial's actors cost about twice its CPU; the stack
    code they run is the same)."""
    hf_rows = {"stack.kind": "hf", "stack.entry": "hf_user:build_plain_trainer", "stack.pythonpath": [str(USER_DIR)],
               **_same_tokens(model, chat, tokenizer)}
    lightning = {"stack.kind": "lightning", "stack.entry": "lightning_user:build", "stack.pythonpath": [str(USER_DIR)],
                 "stack.overrides": {"strategy": "ddp", "model_path": str(model), "batch_size": MICRO_BATCH,
                                     "seq_len": SEQ_LEN, "pad_tokens": PAD, "log_every_n_steps": 1},
                 "train.grad_accum": GRAD_ACCUM, "train.precision": "fp32", "train.seed": 3,
                 "train.steps": 4, "train.warmup_steps": 1}
    return {"name": "stacks-local", "model": {"path": str(model)}, "executor": "torchrun",
            "resources": {"workers": WORKERS, "cpus_per_worker": 1},
            "axes": {"case": [hf_rows, _same_tokens(model, chat, tokenizer), lightning]}}


@pytest.fixture(scope="module")
def rows(tmp_path_factory, chat_file, chat_tokenizer):
    tmp = tmp_path_factory.mktemp("stacks")
    model = make_model_dir(tmp / "model")
    data = tmp / "text.jsonl"
    # Texts of 10 to 39 words: the longer ones are cut at max_length, the shorter padded up to it.
    data.write_text("\n".join(json.dumps({"text": " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(10 + i))})
                              for i in range(30)))
    sweep = tmp / "stacks.yaml"
    sweep.write_text(yaml.safe_dump(_sweep(model, data, chat_file, chat_tokenizer)))
    # The plain Trainer on raybench's rows, raybench's own loop on the same spec, and lightning: a second sweep on the
    # same store.
    local = tmp / "local.yaml"
    local.write_text(yaml.safe_dump(_local_sweep(model, chat_file, chat_tokenizer)))
    with ray_cluster(None):
        assert cli.main(["run", str(sweep), "--store", str(tmp / "store")]) == 1  # two trials were not ok
    assert cli.main(["run", str(local), "--store", str(tmp / "store")]) == 0
    frames = [read_results(str(tmp / "store"), name) for name in ("stacks", "stacks-local")]  # from the Parquet files
    return {_case(row): row for frame in frames for row in frame.itertuples()}


def _case(row) -> str:
    overrides = json.loads(row.stack_overrides_json) if isinstance(row.stack_overrides_json, str) else {}
    mode, entry = overrides.get("mode"), row.stack_entry if isinstance(row.stack_entry, str) else ""
    return f"command-{mode}" if mode else f"{row.stack_kind}-rows" if "plain" in entry else row.stack_kind


def test_sft_trainer_rows_measured_by_the_probe(rows):
    row = rows["hf"]
    assert row.status == "ok", row.error_detail
    assert row.executor == "train" and row.world_size == WORKERS
    assert row.tokens_per_step == WORKERS * MICRO_BATCH * SEQ_LEN * GRAD_ACCUM
    assert 0 < row.nonpad_tokens_per_step < row.tokens_per_step  # the padding is counted apart
    assert row.tok_per_s_per_device > 0 and row.steps_timed == 3
    assert math.isfinite(row.loss_first) and math.isfinite(row.loss_final)
    assert "trl" in row.stack_version and "transformers" in row.stack_version
    assert row.flops_per_token > 0  # the model's shape and the batches' sequence length are known
    # raybench tokenized the data spec for this trial, but the entry trained on data.path's records of its own.
    assert pd.isna(row.data_cache_key) and pd.isna(row.dataset_name) and pd.isna(row.packing_efficiency)


def test_a_plain_trainer_and_raybenchs_loop_train_on_the_same_tokens(rows, chat_tokens):
    """One epoch each, every step timed: each row's non-padding tokens are every token of the data, counted here
    without raybench (the ranks' sample orders differ: the Trainer's sampler is not raybench's; the epochs' totals
    do not)."""
    stack, loop = rows["hf-rows"], rows["raybench"]
    assert stack.status == "ok", stack.error_detail
    assert loop.status == "ok", loop.error_detail
    assert (stack.stack_kind, loop.stack_kind) == ("hf", "raybench") and "trl" not in stack.stack_version
    lengths = [min(len(ids), ROWS_SEQ_LEN) for ids, _ in chat_tokens]
    for row in (stack, loop):
        assert row.steps_timed == ROWS_STEPS and row.world_size == WORKERS
        assert row.tokens_per_step == WORKERS * ROWS_MICRO_BATCH * GRAD_ACCUM * ROWS_SEQ_LEN
        assert row.nonpad_tokens_per_step * row.steps_timed == sum(lengths)
        assert row.packing_efficiency == pytest.approx(sum(lengths) / (ROWS_STEPS * row.tokens_per_step))
        assert math.isfinite(row.loss_first) and math.isfinite(row.loss_final)
        assert row.dataset_name == "chat.jsonl" and row.data_samples == len(lengths)
    # Tokenized once for both trials of their sweep (a later sweep's hit in the store: test_pool.py's chat data test).
    assert stack.data_cache_key == loop.data_cache_key
    assert (stack.data_cache, loop.data_cache) == ("build", "build")


def test_lightning_trial(rows):
    row = rows["lightning"]
    assert row.status == "ok", row.message
    assert row.stack_entry == "lightning_user:build" and json.loads(row.stack_overrides_json)["pad_tokens"] == PAD
    assert "lightning 2." in row.stack_version and row.world_size == WORKERS
    # Every micro-batch of the optimizer step on every rank: the probe counted what the batches held.
    assert row.tokens_per_step == WORKERS * GRAD_ACCUM * MICRO_BATCH * SEQ_LEN
    assert row.nonpad_tokens_per_step == WORKERS * GRAD_ACCUM * MICRO_BATCH * (SEQ_LEN - PAD)
    assert row.steps_timed == 3 and row.tok_per_s_per_device > 0 and row.step_time_p50_s > 0
    assert math.isfinite(row.loss_first) and math.isfinite(row.loss_final)
    # The module holds a transformers decoder and nothing else: its shape gives FLOPs per token.
    assert row.params_total > 0 and row.flops_per_token > 0


def test_the_script_that_trains_gets_an_ok_row_measured_by_the_probe(rows):
    row = rows["command-ok"]
    assert row.status == "ok" and row.executor == "train"
    assert row.tokens_per_step == WORKERS * MICRO_BATCH * COMMAND_SEQ_LEN  # every rank's batch, as the script drew it
    assert row.tok_per_s > 0 and row.tok_per_s_per_device == pytest.approx(row.tok_per_s / WORKERS)
    assert row.steps_timed == 3 and row.world_size == WORKERS
    assert math.isfinite(row.loss_first) and math.isfinite(row.loss_final)
    assert row.time_to_first_step_s > row.step_time_p50_s > 0
    # The script reported its parameters (StepProbe.count_params): its own small model, not the model section's,
    # so no FLOPs are made up from the section's shape.
    assert row.params_total == row.params_trainable == 2 * VOCAB * HIDDEN + VOCAB and pd.isna(row.flops_per_token)
    assert row.stack_version.startswith("python -m torch.distributed.run (python ")
    assert "torch " in row.stack_version and pd.isna(row.phase_forward_p50_s)  # no phases in a user's loop


def test_a_crash_is_an_error_row_with_the_scripts_own_last_error_line(rows):
    row = rows["command-crash"]
    # The rank may also abort on its way out (gloo's threads still running at exit: SIGABRT after the exception);
    # the exception still leads the message, the signal after it (executors/failure.signal_death).
    assert row.status == "error" and row.message in (
        "ValueError: bad batch shape 7",
        *(f"ValueError: bad batch shape 7 (rank {rank} raised it, then was killed by signal SIGABRT on its way out: "
          "exit code -6)" for rank in (0, 1)))
    assert "ChildFailedError" in row.error_detail  # the launcher's summary is kept in the detail


def test_a_hang_is_a_timeout_row(rows):
    row = rows["command-hang"]
    assert row.status == "timeout" and f"resources.timeout_s={HANG_TIMEOUT_S} s" in row.message
    assert row.trial_wall_s < HANG_TIMEOUT_S + 30  # killed at the limit, not left to run


# Slow (about 50 s, a trial left to run into its budget): the default run checks the wording on raybench's loop
# (tests/unit/test_rank_progress.py, test_faults_torchrun.py); this checks that a user's in-process trainer marks too.
@pytest.mark.slow
def test_a_users_trainer_too_slow_for_its_budget_reads_slow_not_hung(tmp_path, chat_file, chat_tokenizer):
    """A transformers Trainer run by the hf stack under torchrun, far more steps than its budget holds: the
    timeout row says how far the rank got, through the probe's marks, and that it was still stepping."""
    model = make_model_dir(tmp_path / "model")
    case = {"stack.kind": "hf", "stack.entry": "hf_user:build_plain_trainer", "stack.pythonpath": [str(USER_DIR)],
            **_same_tokens(model, chat_file, chat_tokenizer), "train.steps": 100000}
    sweep = tmp_path / "slow.yaml"
    sweep.write_text(yaml.safe_dump({"name": "slow-stack", "model": {"path": str(model)}, "store": str(tmp_path / "s"),
                                     "resources": {"workers": 1, "cpus_per_worker": 1, "timeout_s": 40},
                                     "axes": {"case": [case]}}))
    assert cli.main(["trial", str(sweep), "0"]) == 1
    (row,) = read_results(str(tmp_path / "s"), "slow-stack").itertuples()
    assert row.status == "timeout" and "how far: rank 0 step " in row.message, row.message
    assert "/100000" in row.message and "slow, not hung" in row.message, row.message
