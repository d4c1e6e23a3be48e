"""torchtitan's trainer timed by raybench's probe, for real: llama3_tiny_cpu of sweeps/stacks/torchtitan_tiny.py (the
model of raybench's `tiny` preset), a byte-level BPE tokenizer trained here, JSON lines of text, 2 gloo ranks on
CPU, in torchtitan's own environment.

Needs that environment: build it with `scripts/torchtitan-venv.sh DIR` and set RAYBENCH_TORCHTITAN_PYTHON=DIR/bin/python
(skipped otherwise). The commands are the ones raybench plans for the shipped sweep (sweeps/stack-torchtitan-cpu.yaml).
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
from raybench.planning.stacks import torchtitan
from raybench.spec.load import parse_sweep

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
SWEEP = REPO / "sweeps" / "stack-torchtitan-cpu.yaml"
PYTHON = os.environ.get("RAYBENCH_TORCHTITAN_PYTHON")
WORKERS, STEPS, MICRO_BATCH, GRAD_ACCUM, SEQ_LEN = 2, 4, 2, 2, 64

# Run in torchtitan's environment: a byte-level BPE tokenizer of the texts (HF tokenizer.json, bos and eos named in
# tokenizer_config.json, as torchtitan's HuggingFaceTokenizer loads them) and the texts as JSON lines, `records`
# texts in DIR/text, 3 in DIR/few (a dataset that runs out).
MAKE_ASSETS = """
import json, random, sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

out, records = Path(sys.argv[1]), int(sys.argv[2])
rng = random.Random(0)
words = "the a model trains on tokens and each step counts every batch of text with loss going down".split()
texts = [" ".join(rng.choice(words) for _ in range(rng.randint(20, 200))) for _ in range(records)]
for name, chosen in (("text", texts), ("few", texts[:3])):
    (out / name).mkdir(parents=True)
    (out / name / "train.json").write_text("".join(json.dumps({"text": t}) + "\\n" for t in chosen))
tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.decoder = decoders.ByteLevel()
tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"]))
(out / "tokenizer").mkdir()
tokenizer.save(str(out / "tokenizer" / "tokenizer.json"))
(out / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
"""


@pytest.fixture(scope="module")
def python() -> str:
    if not PYTHON or not os.access(PYTHON, os.X_OK):
        pytest.skip("needs torchtitan's environment: run scripts/torchtitan-venv.sh DIR, then set "
                    "RAYBENCH_TORCHTITAN_PYTHON=DIR/bin/python")
    return PYTHON


@pytest.fixture(scope="module")
def assets(python, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("torchtitan-assets")
    subprocess.run([python, "-c", MAKE_ASSETS, str(tmp), "400"], check=True, capture_output=True, timeout=300)
    return {"tokenizer": tmp / "tokenizer", "text": tmp / "text", "few": tmp / "few"}


def _raw(python: str, assets: dict[str, Path], **overrides) -> dict:
    """The shipped CPU sweep with its paths set and this test's sizes, one trial (no axes)."""
    raw = yaml.safe_load(SWEEP.read_text())
    raw["train"].update(steps=STEPS, warmup_steps=1, micro_batch=MICRO_BATCH, grad_accum=GRAD_ACCUM, seq_len=SEQ_LEN)
    raw["stack"].update(python=python, config=str(SWEEP.parent / raw["stack"]["config"]))
    raw["stack"]["overrides"].update({"hf_assets_path": str(assets["tokenizer"]),
                                      "dataloader.dataset_path": str(assets["text"]), **overrides})
    raw.pop("axes")
    return raw


def _argv(python: str, assets: dict[str, Path], **overrides) -> list[str]:
    (trial,) = plan(parse_sweep(_raw(python, assets, **overrides), str(SWEEP), SWEEP.parent))
    return torchtitan.argv(trial.config, python)


def _run(argv: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """The planned command, run as the command executor runs it: in a scratch directory, the probe's records written
    to RAYBENCH_PROBE_DIR, raybench's source on PYTHONPATH."""
    env = {**os.environ, "RAYBENCH_PROBE_DIR": str(tmp), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def run(python, assets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torchtitan-run")
    done = _run(_argv(python, assets), tmp)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads((tmp / f"rank-{rank}.json").read_text()) for rank in range(WORKERS)]
    output = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # torchtitan's log lines are coloured
    return {"records": records, "output": output}


def test_every_rank_records_one_step_per_optimizer_step(run):
    for rank, record in enumerate(run["records"]):
        assert record["rank"] == rank and record["device_type"] == "cpu"
        assert len(record["step_times_s"]) == len(record["tokens"]) == STEPS  # train.steps: training.steps
        assert all(t > 0 for t in record["step_times_s"])


def test_tokens_per_step_are_torchtitans_batches(run):
    """torchtitan packs text into rows of exactly training.seq_len tokens, every label a real one; each rank draws
    grad_accum micro-batches of local_batch_size rows per optimizer step."""
    for record in run["records"]:
        assert record["tokens"] == record["nonpad_tokens"] == [MICRO_BATCH * SEQ_LEN * GRAD_ACCUM] * STEPS


def test_model_is_the_tiny_preset(run):
    from raybench.planning.estimate import param_counts
    from raybench.spec.presets import PRESETS
    from raybench.spec.sweep_spec import TrainSpec

    logged = re.search(r"size: ([0-9,]+) total parameters", run["output"]).group(1)
    assert int(logged.replace(",", "")) == param_counts(PRESETS["tiny"], TrainSpec()).total


def test_loss_is_torchtitans_logged_loss(run):
    """Each rank records its own token-weighted loss; with the ranks' equal token counts their mean is the loss
    torchtitan logs (its all-reduced loss sum over the global token count), printed to 5 decimals."""
    logged = {int(step): float(loss) for step, loss in re.findall(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)", run["output"])}
    assert sorted(logged) == list(range(1, STEPS + 1))
    for step in range(STEPS):
        losses = [r["losses"][step] for r in run["records"]]
        assert all(math.isfinite(x) for x in losses)
        assert sum(losses) / WORKERS == pytest.approx(logged[step + 1], abs=1e-4)


def test_a_dataset_that_runs_out_fails_the_trial(python, assets, tmp_path):
    """torchtitan stops early with a warning when a finite dataset runs out; the launcher fails the trial instead."""
    done = _run(_argv(python, assets, **{"dataloader.dataset_path": str(assets["few"]),
                                         "dataloader.infinite": False}), tmp_path)
    assert done.returncode != 0
    assert "optimizer steps of training.steps=4 (train.steps): the dataset ran out" in done.stdout + done.stderr


def test_the_shipped_schema_is_torchtitans(python):
    """raybench checks overrides against torchtitan_schema.py: written from this torchtitan, it is unchanged."""
    done = subprocess.run([python, str(REPO / "scripts" / "torchtitan_schema.py")], capture_output=True, text=True,
                          timeout=300, check=True)
    shipped = (REPO / "raybench" / "planning" / "stacks" / "torchtitan_schema.py").read_text()
    assert done.stdout == shipped


def test_spmd_types_stops_cpu_ranks(python, assets, tmp_path):
    """Why the tiny config sets parallelism.spmd_backend partial_dtensor (sweeps/stacks/torchtitan_tiny.py): 0.3.0's
    default stops CPU ranks at the first fully_shard."""
    done = _run(_argv(python, assets, **{"parallelism.spmd_backend": "spmd_types"}), tmp_path)
    assert done.returncode != 0
    assert "When dp_mesh_dims is provided, all parameters must be DTensors" in done.stdout + done.stderr


def test_the_sweep_through_raybench_gives_ok_and_crash_rows(python, assets, tmp_path):
    """The shipped CPU sweep through `raybench run` (Ray, the command executor): an ok row with the exact tokens per
    step, and an error row whose message is torchtitan's own error (a tokenizer directory that is not there)."""
    from raybench import read_results
    from raybench.cli import main as cli
    from raybench.cli.main import EXIT_TRIALS_FAILED

    raw = _raw(python, assets)
    missing = str(tmp_path / "no-tokenizer")
    raw["axes"] = {"stack.overrides.hf_assets_path": [str(assets["tokenizer"]), missing]}
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(raw))
    assert cli.main(["run", str(sweep), "--store", str(tmp_path / "store")]) == EXIT_TRIALS_FAILED  # one not ok
    rows = read_results(str(tmp_path / "store"), raw["name"])
    by_tokenizer = {json.loads(r.stack_overrides_json)["hf_assets_path"]: r for r in rows.itertuples()}
    ok, crash = by_tokenizer[str(assets["tokenizer"])], by_tokenizer[missing]
    assert ok.status == "ok" and ok.stack_kind == "torchtitan" and ok.world_size == WORKERS
    assert ok.tokens_per_step == ok.nonpad_tokens_per_step == WORKERS * GRAD_ACCUM * MICRO_BATCH * SEQ_LEN
    assert ok.steps_timed == STEPS - 1 and ok.tok_per_s > 0
    assert math.isfinite(ok.loss_first) and math.isfinite(ok.loss_final)
    assert "torchtitan 0.3.0" in ok.stack_version
    assert crash.status == "error" and f"Tokenizer path '{missing}' does not exist" in crash.message
