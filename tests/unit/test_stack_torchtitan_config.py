"""A `torchtitan` stack's section is checked before anything starts (no torchtitan needed: its job config's keys
and types are raybench/planning/stacks/torchtitan_schema.py): `raybench plan` exits 2 naming the field, the value
and the fix, and writes nothing; a good one gives the command torchtitan runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from raybench.planning.plan import plan
from raybench.planning.stacks import torchtitan
from raybench.spec.load import load_sweep
from tests.conftest import assert_plan_refuses, write_sweep

CONFIG = Path(__file__).resolve().parents[2] / "sweeps" / "stacks" / "torchtitan_tiny.py"
TRAIN = "{strategy: fsdp2, steps: 4, micro_batch: 2, grad_accum: 2, seq_len: 64, precision: fp32}"
OVERRIDES = "{hf_assets_path: /data/tokenizer, dataloader.dataset_path: /data/text}"


def _sweep(train: str = TRAIN, overrides: str = OVERRIDES, recipe: str = "llama3_tiny_cpu", extra: str = "",
           config: Path | str = CONFIG) -> str:
    return f"""
name: bad-torchtitan
model: {{preset: tiny}}
train: {train}
resources: {{workers: 2}}
stack:
  kind: torchtitan
  recipe: {recipe}
  config: {config}
  python: {sys.executable}
  overrides: {overrides}
{extra}"""


BAD = {
    "unknown key": (_sweep(overrides="{training.local_bach_size: 4}"), "stack.overrides.training.local_bach_size",
                    "not a key of torchtitan 0.3.0's job config; did you mean training.local_batch_size?"),
    "unknown key, did you mean": (_sweep(overrides="{dataloader.dataset_pth: /data/text}"),
                                  "stack.overrides.dataloader.dataset_pth", "did you mean dataloader.dataset_path?"),
    "mapped key": (_sweep(overrides="{training.local_batch_size: 4}"), "stack.overrides.training.local_batch_size",
                   "raybench sets training.local_batch_size from train.micro_batch"),
    "wrong type": (_sweep(overrides="{metrics.log_freq: often}"), "stack.overrides.metrics.log_freq",
                   "metrics.log_freq takes int, not str 'often'"),
    "bool for an int": (_sweep(overrides="{metrics.log_freq: true}"), "stack.overrides.metrics.log_freq",
                        "takes int, not bool"),
    "not a literal": (_sweep(overrides="{parallelism.spmd_backend: dtensor}"),
                      "stack.overrides.parallelism.spmd_backend", "one of partial_dtensor, full_dtensor, spmd_types"),
    "not on the command line": (_sweep(overrides="{optimizer.param_groups: []}"),
                                "stack.overrides.optimizer.param_groups", "set it in the config function"),
    "not a dotted key": (_sweep(overrides="{--training.steps: 4}"), "stack.overrides.--training.steps",
                         "in dotted form"),
    "placeholder override": (_sweep(overrides="{hf_assets_path: /EDIT-ME/tokenizer}"),
                             "stack.overrides.hf_assets_path", "a placeholder"),
    "unknown function": (_sweep(recipe="llama3_tiny_cp"), "stack.recipe", "did you mean llama3_tiny_cpu?"),
    "no function": (_sweep(recipe="null"), "stack.recipe", "one of"),
    "missing config": (_sweep(config="/nowhere/jobs.py"), "stack.config", "file not found"),
    "a TOML config": (_sweep(config=CONFIG.with_name("torchtune_tiny_lora.yaml")), "stack.config",
                      "job configs are Python functions"),
    "missing python": (_sweep().replace(f"python: {sys.executable}", "python: /nowhere/bin/python"),
                       "stack.python", "no executable file there"),
    "no python": (_sweep().replace(f"python: {sys.executable}", ""), "stack.python", "its own environment"),
    "ddp": (_sweep(train=TRAIN.replace("fsdp2", "ddp")), "train.strategy", "shards with FSDP2"),
    "lora": (_sweep(train=TRAIN.replace("}", ", finetune: lora}")), "train.finetune", "trains every weight"),
    "fp16": (_sweep(train=TRAIN.replace("fp32", "fp16")), "train.precision", "float32 or bfloat16"),
    "no clipping": (_sweep(train=TRAIN.replace("}", ", max_grad_norm: null}")), "train.max_grad_norm",
                    "always clips"),
    "learning rate": (_sweep(train=TRAIN.replace("}", ", lr: 0.001}")), "train.lr", "default_adamw(lr="),
    "activation checkpointing": (_sweep(train=TRAIN.replace("}", ", ac_ratio: '1'}")), "train.ac_ratio",
                                 "activation_checkpoint"),
    "model-parallel degree not positive": (
        _sweep(overrides=OVERRIDES.replace("}", ", parallelism.tensor_parallel_degree: 0}")),
        "stack.overrides.parallelism.tensor_parallel_degree", "a positive integer dividing resources.workers"),
    "raybench data": (_sweep(extra="data: {num_workers: 2}\n"), "data.num_workers", "reads its dataset from the job"),
    "command set": (_sweep(extra="").replace("  overrides:", "  command: [python]\n  overrides:"), "stack.command",
                    "for other stacks"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_torchtitan_config_exits_2_and_writes_nothing(name, tmp_path, capsys):
    text, field, message = BAD[name]
    sweep = write_sweep(tmp_path / "sweep.yaml", text)
    assert_plan_refuses(sweep, field, message, tmp_path / "store", lambda: capsys.readouterr().err)


def test_a_good_section_gives_torchtitans_own_command_line(tmp_path):
    overrides = ("{hf_assets_path: /data/tokenizer, dataloader.dataset_path: /data/text, checkpoint.enable: false, "
                 "compile.components: [model, loss], dataloader.prefetch_factor: null, metrics.log_freq: 5}")
    trial = plan(load_sweep(write_sweep(tmp_path / "sweep.yaml", _sweep(overrides=overrides))))[0]
    argv = torchtitan.argv(trial.config, trial.config.stack.python)
    assert argv[:10] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "raybench.runtime.stacks.torchtitan_train", str(CONFIG), "llama3_tiny_cpu"]
    rest = argv[10:]
    assert "--checkpoint.no-enable" in rest and "--compile.no-enable" in rest  # bools are tyro flags
    assert "--compile.components=model,loss" in rest and "--dataloader.prefetch_factor=None" in rest
    assert "--hf_assets_path=/data/tokenizer" in rest and "--metrics.log_freq=5" in rest
    pairs = dict(arg[2:].split("=", 1) for arg in rest if "=" in arg)
    assert pairs["training.steps"] == "4" and pairs["training.local_batch_size"] == "2"
    assert pairs["training.global_batch_size"] == "8"  # micro_batch 2 x grad_accum 2 x 2 data-parallel ranks
    assert pairs["training.seq_len"] == "64" and pairs["debug.seed"] == "0" and pairs["training.max_norm"] == "1.0"
    assert pairs["training.mixed_precision_param"] == "float32"


def test_global_batch_counts_only_the_data_parallel_ranks(tmp_path):
    text = _sweep(overrides=OVERRIDES.replace("}", ", parallelism.tensor_parallel_degree: 2}"))
    trial = plan(load_sweep(write_sweep(tmp_path / "sweep.yaml", text)))[0]
    assert torchtitan.mapped_values(trial.config)["training.global_batch_size"] == 2 * 2 * 1


def test_the_shipped_sweep_plans_once_its_paths_are_set(tmp_path):
    shipped = Path(__file__).resolve().parents[2] / "sweeps" / "stack-torchtitan-cpu.yaml"
    text = shipped.read_text().replace("../.venvs/torchtitan/bin/python", sys.executable)
    text = text.replace("stacks/torchtitan_tiny.py", str(CONFIG))
    trials = plan(load_sweep(write_sweep(tmp_path / "sweep.yaml", text)))
    assert [t.config.train.micro_batch for t in trials] == [2, 4]
    assert all(t.config.stack.kind == "torchtitan" for t in trials)


def test_the_config_files_names_are_read_without_running_it():
    assert "llama3_tiny_cpu" in torchtitan.config_functions(str(CONFIG))
