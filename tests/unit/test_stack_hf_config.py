"""The hf stack's section checked before launch against TRL's SFTConfig: each bad sweep exits 2 naming its field,
with nothing launched or written; good ones plan. The entry's module is tests/stacks_user/hf_user.py (nothing
runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from raybench.cli import main as cli
from raybench.planning.plan import plan
from raybench.spec.errors import ConfigError
from raybench.spec.load import load_sweep

USER_DIR = Path(__file__).resolve().parents[1] / "stacks_user"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf-text") / "text.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"the quick brown fox {i}"}) for i in range(8)))
    return path


def _sweep(tmp_path: Path, model_dir: Path, overrides: dict | None = None, entry: str | None = "hf_user:build_trainer",
           train: dict | None = None, data: dict | None = None, config: dict | None = None) -> Path:
    stack = {"kind": "hf", "pythonpath": [str(USER_DIR)], "overrides": overrides or {}}
    if entry is not None:
        stack["entry"] = entry
    if config is not None:
        stack["config"] = "sft.yaml"  # relative to the sweep file
        (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    spec = {"name": "hf-config", "model": {"path": str(model_dir)}, "data": data or {"source": "synthetic"},
            "train": {"steps": 4, "warmup_steps": 1, "seq_len": 32, "precision": "fp32", **(train or {})},
            "resources": {"workers": 2, "cpus_per_worker": 1}, "stack": stack}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


# (case, sweep arguments, the field named, words of the message)
BAD = [
    ("unknown_key", {"overrides": {"lr_scheduler_typ": "cosine"}}, "stack.overrides.lr_scheduler_typ",
     "did you mean 'lr_scheduler_type'"),
    ("wrong_type", {"overrides": {"packing": "yes"}}, "stack.overrides.packing", "expected bool, got str"),
    ("missing_module", {"entry": "no_such_module:build"}, "stack.entry", "no module named 'no_such_module'"),
    ("mapped_key", {"overrides": {"max_steps": 10}}, "stack.overrides.max_steps", "set train.steps instead"),
    ("unmapped_train_field", {"train": {"compile": True}}, "train.compile", "torch_compile"),
    ("yaml_number_as_text", {"overrides": {"adam_epsilon": "1e-8"}}, "stack.overrides.adam_epsilon",
     "write it with a decimal point"),
    ("bad_value", {"overrides": {"optim": "adamw_bogus"}}, "stack.overrides.optim", "not a valid OptimizerNames"),
    ("harness_key", {"overrides": {"save_strategy": "steps"}}, "stack.overrides.save_strategy", "raybench sets"),
    ("lora_in_raybench", {"train": {"finetune": "lora"}}, "train.finetune", "peft_config"),
    ("mapped_loader_key", {"overrides": {"dataloader_num_workers": 2}}, "stack.overrides.dataloader_num_workers",
     "set data.num_workers instead"),
    ("padding_free_alone", {"overrides": {"padding_free": True}}, "stack.overrides.padding_free", "packing"),
    ("missing_function", {"entry": "hf_user:nope"}, "stack.entry", "no function 'nope'"),
    ("checkpointing_key", {"overrides": {"gradient_checkpointing": True}}, "stack.overrides.gradient_checkpointing",
     "set train.ac_ratio instead"),
    ("partial_checkpointing", {"train": {"ac_ratio": "1/2"}}, "train.ac_ratio", "use 0 or 1"),
    ("no_entry_no_config", {"entry": None}, "stack.entry", "config file"),
    ("config_unknown_key", {"config": {"packin": True}}, "stack.config.packin", "did you mean 'packing'"),
    ("config_mapped_key", {"config": {"learning_rate": 0.1}}, "stack.config.learning_rate", "train.lr"),
    ("config_without_data", {"entry": None, "config": {"packing": False}}, "data.path", "data.source: hf"),
]


@pytest.mark.parametrize("case, arguments, field, words", BAD, ids=[case[0] for case in BAD])
def test_bad_section_names_its_field(case, arguments, field, words, tmp_path, model_dir):
    path = _sweep(tmp_path, model_dir, **arguments)
    with pytest.raises(ConfigError) as err:
        plan(load_sweep(path), source=str(path))
    named = [p for p in err.value.problems if p.field == field]
    assert named and words in named[0].message, [str(p) for p in err.value.problems]


@pytest.mark.parametrize("case, arguments, field, words", BAD[:5], ids=[case[0] for case in BAD[:5]])
def test_bad_section_exits_2_and_writes_nothing(case, arguments, field, words, tmp_path, model_dir, capsys):
    path = _sweep(tmp_path, model_dir, **arguments)
    store = tmp_path / "store"
    assert cli.main(["plan", str(path), "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert field in err and "nothing was launched or written" in err and "Traceback" not in err
    assert not store.exists()


def test_entry_and_config_file_sweeps_plan(tmp_path, model_dir, text_file):
    entry = _sweep(tmp_path, model_dir, overrides={"pad_to_multiple_of": 32, "lr_scheduler_type": "constant"},
                   train={"micro_batch": 2, "grad_accum": 2, "lr": 1e-3})
    assert len(plan(load_sweep(entry))) == 1
    data = {"source": "hf", "path": str(text_file), "format": "text"}
    config = _sweep(tmp_path, model_dir, entry=None, data=data, config={"packing": True, "adam_epsilon": 1e-8})
    spec = load_sweep(config)
    assert spec.stack.config == str(tmp_path / "sft.yaml")  # resolved next to the sweep file
    assert len(plan(spec)) == 1


@pytest.mark.parametrize("ratio, checkpointed", [("0", False), ("1", True)])
def test_ac_ratio_decides_checkpointing_against_sftconfigs_own_default(tmp_path, model_dir, ratio, checkpointed):
    """SFTConfig checkpoints by default; a trial's row says ac_ratio 0, so its arguments must not checkpoint."""
    from raybench.spec.stacks import hf

    (trial,) = plan(load_sweep(_sweep(tmp_path, model_dir, train={"ac_ratio": ratio})))
    cls = hf.args_class()
    args = hf.trial_args(trial.config, set(hf.field_types(cls)))
    assert args["activation_checkpointing"] is checkpointed and args["gradient_checkpointing"] is checkpointed
    built = cls(output_dir=str(tmp_path / "out"), use_cpu=True, **args)
    assert built.activation_checkpointing is checkpointed and built.gradient_checkpointing is checkpointed
    # transformers before 5.23 has gradient_checkpointing alone (and SFTConfig makes it True by default): it is set.
    older = hf.trial_args(trial.config, set(hf.field_types(cls)) - {"activation_checkpointing"})
    assert older["gradient_checkpointing"] is checkpointed and "activation_checkpointing" not in older


def test_the_data_spec_plans_for_the_entry_and_the_config_path(tmp_path, model_dir, alpaca_file):
    """The data spec's fields are raybench's tokenization, which both take (ctx.tokenized_dataset, ctx.train_rows):
    none is refused, and the config path takes any data raybench reads (alpaca records too)."""
    data = {"source": "hf", "path": str(alpaca_file), "format": "alpaca", "loss_on": "assistant", "max_samples": 8,
            "split": "train", "packing": False}
    for arguments in ({}, {"entry": None, "config": {"packing": True}}):
        assert len(plan(load_sweep(_sweep(tmp_path, model_dir, data=data, **arguments)))) == 1


@pytest.mark.parametrize("data, expected", [
    ({}, {"dataloader_num_workers": 0, "dataloader_pin_memory": False, "dataloader_prefetch_factor": None,
          "dataloader_persistent_workers": False}),
    ({"num_workers": 2, "prefetch_factor": 4},
     {"dataloader_num_workers": 2, "dataloader_pin_memory": False, "dataloader_prefetch_factor": 4,
      "dataloader_persistent_workers": True}),
])
def test_raybench_loader_fields_are_the_trainers_dataloader_keys(tmp_path, model_dir, data, expected):
    """The same torch DataLoader arguments under both names: an axis over data.num_workers sweeps the Trainer's
    loader too. Persistent workers need workers (torch refuses them without), as in raybench's own loader."""
    from raybench.spec.stacks import hf

    (trial,) = plan(load_sweep(_sweep(tmp_path, model_dir, data={"source": "synthetic", **data})))
    cls = hf.args_class()
    args = hf.trial_args(trial.config, set(hf.field_types(cls)))
    assert {key: args[key] for key in expected} == expected
    built = cls(output_dir=str(tmp_path / "out"), use_cpu=True, **args)
    assert built.dataloader_num_workers == expected["dataloader_num_workers"]
