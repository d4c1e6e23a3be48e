"""The lightning stack's section checked before launch: each bad sweep exits 2 naming its field, with nothing
launched or written; a good one plans. The entry's module is tests/stacks_user/lightning_user.py (nothing runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.spec.errors import ConfigError
from raybench.spec.load import load_sweep

USER_DIR = Path(__file__).resolve().parents[1] / "stacks_user"
GOOD_OVERRIDES = {"model_path": "/models/tiny", "batch_size": 2, "log_every_n_steps": 5, "strategy": "ddp"}


def _sweep(tmp_path: Path, overrides: dict | None = None, entry: str | None = "lightning_user:build",
           train: dict | None = None, gpus: int = 0, data: dict | None = None) -> Path:
    spec = {"name": "lightning-config", "model": {"preset": "tiny"},
            "train": {"steps": 4, "warmup_steps": 1, "precision": "fp32", **(train or {})},
            "data": data or {}, "resources": {"workers": 2, "cpus_per_worker": 1, "gpus_per_worker": gpus},
            "stack": {"kind": "lightning", "entry": entry, "pythonpath": [str(USER_DIR)],
                      "overrides": GOOD_OVERRIDES if overrides is None else overrides}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _with(**changes) -> dict:
    return {k: v for k, v in {**GOOD_OVERRIDES, **changes}.items() if v is not None}


# (case, sweep arguments, the field named, words of the message)
BAD = [
    ("unknown_trainer_key", {"overrides": _with(log_every_n_step=5)}, "stack.overrides.log_every_n_step",
     "did you mean 'log_every_n_steps'"),
    ("unknown_function_key", {"overrides": _with(batch_sise=2)}, "stack.overrides.batch_sise",
     "did you mean 'batch_size'"),
    ("trainer_wrong_type", {"overrides": _with(log_every_n_steps="often")}, "stack.overrides.log_every_n_steps",
     "expected"),
    ("function_wrong_type", {"overrides": _with(batch_size="two")}, "stack.overrides.batch_size", "expected int"),
    ("float_as_yaml_text", {"overrides": _with(lr="1e-3")}, "stack.overrides.lr", "write it with a decimal point"),
    ("mapped_trainer_key", {"overrides": _with(max_steps=10)}, "stack.overrides.max_steps", "train.steps"),
    ("fixed_trainer_key", {"overrides": _with(max_epochs=1)}, "stack.overrides.max_epochs", "train.steps"),
    ("missing_argument", {"overrides": _with(model_path=None)}, "stack.overrides.model_path", "no default"),
    ("missing_module", {"entry": "no_such_module:build"}, "stack.entry", "no module named 'no_such_module'"),
    ("missing_function", {"entry": "lightning_user:nope"}, "stack.entry", "no function 'nope'"),
    ("no_entry", {"entry": None}, "stack.entry", "module:function"),
    ("unsupported_strategy", {"overrides": _with(strategy="ddp_spawn")}, "stack.overrides.strategy",
     "raybench runs Lightning's ddp, fsdp, deepspeed_stage_2, deepspeed_stage_3"),
    ("deepspeed_on_cpu", {"overrides": _with(strategy="deepspeed_stage_3")}, "stack.overrides.strategy",
     "CUDA GPUs only"),
    ("fsdp_clipping", {"overrides": _with(strategy="fsdp"), "gpus": 1}, "train.max_grad_norm", "set "
     "train.max_grad_norm: null"),
    ("unmapped_train_field", {"train": {"micro_batch": 4}}, "train.micro_batch", "batch size"),
    ("data_field", {"data": {"num_workers": 2}}, "data.num_workers", "returns its own DataLoader"),
]


@pytest.mark.parametrize("case, arguments, field, words", BAD, ids=[case[0] for case in BAD])
def test_bad_section_names_its_field(case, arguments, field, words, tmp_path):
    path = _sweep(tmp_path, **arguments)
    with pytest.raises(ConfigError) as err:
        plan(load_sweep(path), source=str(path))
    named = [p for p in err.value.problems if p.field == field]
    assert named and words in named[0].message, [str(p) for p in err.value.problems]


EXIT_2 = ("unknown_trainer_key", "function_wrong_type", "missing_module", "unsupported_strategy")


@pytest.mark.parametrize("case, arguments, field, words", [c for c in BAD if c[0] in EXIT_2], ids=EXIT_2)
def test_bad_section_exits_2_and_writes_nothing(case, arguments, field, words, tmp_path, capsys):
    path = _sweep(tmp_path, **arguments)
    store = tmp_path / "store"
    assert cli.main(["run", str(path), "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert field in err and "nothing was launched or written" in err and "Traceback" not in err
    assert not store.exists()


def test_good_section_plans(tmp_path):
    trials = plan(load_sweep(_sweep(tmp_path)))
    assert len(trials) == 1 and trials[0].payload.config.stack.overrides == GOOD_OVERRIDES


def test_strategy_axis_on_gpu_plans(tmp_path):
    """ddp, fsdp (without clipping) and both DeepSpeed stages plan for GPU workers."""
    path = _sweep(tmp_path, gpus=1, train={"max_grad_norm": None})
    spec = yaml.safe_load(path.read_text())
    spec["axes"] = {"stack.overrides.strategy": ["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"]}
    path.write_text(yaml.safe_dump(spec))
    trials = plan(load_sweep(path))
    assert [t.payload.config.stack.overrides["strategy"] for t in trials] == ["ddp", "fsdp", "deepspeed_stage_2",
                                                                              "deepspeed_stage_3"]
