"""A torchtune recipe timed by raybench's probe, for real: lora_finetune_distributed on a 2-layer Llama-2-architecture
model (Hugging Face safetensors, loaded by torchtune's FullModelHFCheckpointer), a SentencePiece tokenizer trained
here, alpaca-style JSON records, 2 gloo ranks on CPU, in torchtune's own environment.

Needs that environment: build it with `scripts/torchtune-venv.sh DIR` and set RAYBENCH_TORCHTUNE_PYTHON=DIR/bin/python
(skipped otherwise). The command is the one raybench plans for the shipped sweep (sweeps/stack-torchtune-cpu.yaml).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from raybench.planning.plan import plan
from raybench.planning.stacks import torchtune
from raybench.spec.load import parse_sweep
from tests.conftest import alpaca_records, make_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "sweeps" / "stack-torchtune-cpu.yaml"
PYTHON = os.environ.get("RAYBENCH_TORCHTUNE_PYTHON")
WORKERS, STEPS, MICRO_BATCH, GRAD_ACCUM, SEQ_LEN = 2, 4, 2, 2, 256

# Run in torchtune's environment: a SentencePiece model of the records' words and the alpaca prompt's.
TRAIN_TOKENIZER = """
import sentencepiece as spm, sys
spm.SentencePieceTrainer.train(input=sys.argv[1], model_prefix=sys.argv[2], vocab_size=128, model_type="bpe",
                               character_coverage=1.0, hard_vocab_limit=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
"""
# Run in torchtune's environment: every rank's micro-batches as the recipe builds them (torchtune's own config
# parsing, dataset, sampler, collate and dataloader, as lora_finetune_distributed._setup_data does), counted
# independently of the launcher: (labels.numel(), labels != ignore_index) per micro-batch.
RECOUNT = """
import json, sys
from functools import partial
from torchtune import config
from torchtune.config._parse import TuneRecipeArgumentParser
from torchtune.config._utils import _merge_yaml_and_cli_args
from torchtune.data import padded_collate_packed, padded_collate_sft
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

world, args = int(sys.argv[1]), sys.argv[2:]
cfg = _merge_yaml_and_cli_args(*TuneRecipeArgumentParser(description="").parse_known_args(args))
tokenizer = config.instantiate(cfg.tokenizer)
dataset = config.instantiate(cfg.dataset, tokenizer)
ignore = config.instantiate(cfg.loss).ignore_index
collate = (padded_collate_packed if cfg.dataset.get("packed", False)
           else partial(padded_collate_sft, padding_idx=tokenizer.pad_id, ignore_idx=ignore))
ranks = []
for rank in range(world):
    sampler = StatefulDistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=cfg.shuffle)
    sampler.set_epoch(0)
    loader = StatefulDataLoader(dataset, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate, drop_last=True)
    ranks.append([[b["labels"].numel(), int((b["labels"] != ignore).sum())] for b in loader])
print(json.dumps(ranks))
"""


@pytest.fixture(scope="module")
def python() -> str:
    if not PYTHON or not os.access(PYTHON, os.X_OK):
        pytest.skip("needs torchtune's environment: run scripts/torchtune-venv.sh DIR, then set "
                    "RAYBENCH_TORCHTUNE_PYTHON=DIR/bin/python")
    return PYTHON


@pytest.fixture(scope="module")
def assets(python, tmp_path_factory) -> dict[str, Path]:
    """The tiny model directory (the shape of sweeps/stacks/torchtune_tiny_lora.yaml), its tokenizer, the data."""
    tmp = tmp_path_factory.mktemp("torchtune-assets")
    model = make_model_dir(tmp / "tiny-llama")  # 64 hidden, 2 layers, 4 heads, 2 KV heads, MLP 128, vocab 128
    records = alpaca_records(400)  # enough micro-batches of unpacked records for every rank's steps
    data = tmp / "alpaca.json"
    data.write_text(json.dumps(records))
    corpus = tmp / "corpus.txt"
    corpus.write_text("\n".join(" ".join(r.values()) for r in records) + "\nBelow is an instruction that "
                      "describes a task. Write a response that appropriately completes the request. "
                      "### Instruction: ### Input: ### Response:\n")
    subprocess.run([python, "-c", TRAIN_TOKENIZER, str(corpus), str(tmp / "tokenizer")], check=True,
                   capture_output=True)
    return {"model": model, "tokenizer": tmp / "tokenizer.model", "data": data}


def _trial(python: str, assets: dict[str, Path], packed: bool):
    """The shipped CPU sweep with its paths set, one trial: unpacked records pad, so the counts are not uniform."""
    raw = yaml.safe_load(SWEEP.read_text())
    raw["model"]["path"] = str(assets["model"])
    raw["train"].update(steps=STEPS, warmup_steps=1, micro_batch=MICRO_BATCH, grad_accum=GRAD_ACCUM, seq_len=SEQ_LEN)
    raw["stack"]["python"] = python
    raw["stack"]["overrides"].update({"tokenizer.path": str(assets["tokenizer"]),
                                      "dataset.data_files": str(assets["data"]), "dataset.packed": packed})
    raw.pop("axes")
    (trial,) = plan(parse_sweep(raw, str(SWEEP), SWEEP.parent))
    return trial.config


def _env(probe_dir: Path) -> dict[str, str]:
    return {**os.environ, "RAYBENCH_PROBE_DIR": str(probe_dir), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


@pytest.fixture(scope="module")
def run(python, assets, tmp_path_factory):
    """The planned command, run as the command executor runs it: in a scratch directory, the probe's records
    written to RAYBENCH_PROBE_DIR."""
    config = _trial(python, assets, packed=False)
    argv = torchtune.argv(config, python)
    tmp = tmp_path_factory.mktemp("torchtune-run")
    done = subprocess.run(argv, cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads((tmp / f"rank-{rank}.json").read_text()) for rank in range(WORKERS)]
    recount = subprocess.run([python, "-c", RECOUNT, str(WORKERS), *argv[argv.index("--config"):]], cwd=tmp,
                             capture_output=True, text=True, timeout=300, check=True)
    log = next((tmp / "torchtune-output" / "logs").glob("*.txt")).read_text()
    return {"records": records, "batches": json.loads(recount.stdout.splitlines()[-1]), "log": log}


def test_every_rank_records_one_step_per_optimizer_step(run):
    for rank, record in enumerate(run["records"]):
        assert record["rank"] == rank and record["device_type"] == "cpu"
        assert len(record["step_times_s"]) == len(record["tokens"]) == STEPS  # train.steps: max_steps_per_epoch
        assert all(t > 0 for t in record["step_times_s"])


def test_tokens_per_step_are_what_torchtunes_batches_held(run):
    for record, batches in zip(run["records"], run["batches"]):
        steps = [batches[i * GRAD_ACCUM:(i + 1) * GRAD_ACCUM] for i in range(STEPS)]  # micro-batches per step
        assert record["tokens"] == [sum(padded for padded, _ in step) for step in steps]
        assert record["nonpad_tokens"] == [sum(real for _, real in step) for step in steps]
    tokens = [t for record in run["records"] for t in record["tokens"]]
    nonpad = [t for record in run["records"] for t in record["nonpad_tokens"]]
    assert sum(nonpad) < sum(tokens)  # unpacked records of different lengths: padding was counted apart


def test_loss_is_torchtunes_logged_loss(run):
    """Each rank records its own token-weighted loss; weighted over the ranks it is the loss torchtune logs (its
    all-reduced running loss over its token count)."""
    logged = [float(x) for x in re.findall(r"loss:([0-9.]+)", run["log"])]
    assert len(logged) == STEPS
    for step, expected in enumerate(logged):
        weights = [r["nonpad_tokens"][step] for r in run["records"]]
        losses = [r["losses"][step] for r in run["records"]]
        assert all(math.isfinite(x) for x in losses)
        assert sum(w * x for w, x in zip(weights, losses)) / sum(weights) == pytest.approx(expected, rel=1e-5)


def test_the_sweep_through_raybench_gives_an_ok_row(python, assets, tmp_path):
    """The shipped CPU sweep through `raybench run` (Ray, the command executor), packed: every micro-batch is
    batch_size sequences of exactly tokenizer.max_seq_len tokens."""
    from raybench import read_results
    from raybench.cli import main as cli

    raw = yaml.safe_load(SWEEP.read_text())
    raw["model"]["path"] = str(assets["model"])
    raw["train"].update(steps=STEPS, warmup_steps=1, micro_batch=MICRO_BATCH, grad_accum=GRAD_ACCUM, seq_len=64)
    raw["stack"].update(python=python, config=str(SWEEP.parent / raw["stack"]["config"]))
    raw["stack"]["overrides"].update({"tokenizer.path": str(assets["tokenizer"]),
                                      "dataset.data_files": str(assets["data"])})
    raw.pop("axes")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(raw))
    assert cli.main(["run", str(sweep), "--store", str(tmp_path / "store")]) == 0
    (row,) = read_results(str(tmp_path / "store"), raw["name"]).itertuples()
    assert row.status == "ok" and row.stack_kind == "torchtune" and row.world_size == WORKERS
    assert row.tokens_per_step == WORKERS * GRAD_ACCUM * MICRO_BATCH * 64
    assert row.steps_timed == STEPS - 1 and row.tok_per_s > 0
    assert math.isfinite(row.loss_first) and math.isfinite(row.loss_final)
    assert "torchtune 0.6.1" in row.stack_version
