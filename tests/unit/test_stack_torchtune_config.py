"""A `torchtune` stack's section is checked before anything starts (no torchtune needed): `raybench plan` exits 2
naming the field, the value and the fix, and writes nothing; a good one gives the command torchtune runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from raybench.planning.plan import plan
from raybench.planning.stacks import torchtune
from raybench.spec.load import load_sweep
from tests.conftest import assert_plan_refuses, write_sweep

CONFIG = Path(__file__).resolve().parents[2] / "sweeps" / "stacks" / "torchtune_tiny_lora.yaml"
TRAIN = "{strategy: fsdp2, finetune: lora, steps: 4, micro_batch: 2, precision: fp32}"
OVERRIDES = ("{tokenizer.path: /data/tokenizer.model, dataset.data_files: /data/alpaca.json, "
             "checkpointer.checkpoint_dir: /data/tiny-llama}")


def _sweep(stack: str = "", train: str = TRAIN, overrides: str = OVERRIDES, recipe: str = "lora_finetune_distributed",
           extra: str = "") -> str:
    return f"""
name: bad-torchtune
model: {{preset: tiny}}
train: {train}
resources: {{workers: 2}}
stack:
  kind: torchtune
  recipe: {recipe}
  config: {CONFIG}
  python: {sys.executable}
  overrides: {overrides}
{stack}{extra}"""


BAD = {
    "unknown recipe": (_sweep(recipe="lora_finetune_distribted"), "stack.recipe",
                       "did you mean lora_finetune_distributed?"),
    "recipe not timed": (_sweep(recipe="lora_dpo_distributed"), "stack.recipe", "this one's loop is not theirs"),
    "finetune off the recipe": (_sweep(train=TRAIN.replace("lora", "full")), "train.finetune",
                                "recipe lora_finetune_distributed trains lora"),
    "unknown key": (_sweep(overrides="{optimizer.fsued: true}"), "stack.overrides.optimizer.fsued",
                    "did you mean optimizer.fused?"),
    "mapped key": (_sweep(overrides="{batch_size: 4}"), "stack.overrides.batch_size",
                   "raybench sets batch_size from train.micro_batch"),
    "lora key": (_sweep(overrides="{model.lora_rank: 4}"), "stack.overrides.model.lora_rank",
                 "from train.lora.rank"),
    "new key written as existing": (_sweep(overrides="{+seed_offset: 1, +shuffle: false}"), "stack.overrides.+shuffle",
                                    "write it without the +"),
    "placeholder override": (_sweep(overrides="{tokenizer.path: /EDIT-ME/tokenizer.model}"),
                             "stack.overrides.tokenizer.path", "a placeholder"),
    "placeholder in the file": (_sweep(overrides="{checkpointer.checkpoint_dir: /data/tiny-llama}"), "stack.config",
                                "tokenizer.path: /EDIT-ME/tokenizer.model is a placeholder"),
    "missing python": (_sweep().replace(f"python: {sys.executable}", "python: /nowhere/bin/python"),
                       "stack.python", "no executable file there"),
    "no python": (_sweep().replace(f"python: {sys.executable}", ""), "stack.python", "its own environment"),
    "missing config": (_sweep().replace(str(CONFIG), "/nowhere/config.yaml"), "stack.config", "file not found"),
    "ddp": (_sweep(train=TRAIN.replace("fsdp2", "ddp")), "train.strategy", "shard with FSDP2"),
    "partial activation checkpointing": (_sweep(train=TRAIN.replace("}", ", ac_ratio: '1/2'}")), "train.ac_ratio",
                                         "use '0' or '1'"),
    "unmapped train field": (_sweep(train=TRAIN.replace("}", ", optimizer: sgd}")), "train.optimizer",
                             "optimizer._component_"),
    "lora targets": (_sweep(train=TRAIN.replace("}", ", lora: {targets: attention}}")), "train.lora.targets",
                     "model.lora_attn_modules"),
    "peak memory log": (_sweep(overrides=OVERRIDES.replace("}", ", log_peak_memory_stats: true}")),
                        "stack.overrides.log_peak_memory_stats", "resets CUDA's peak-memory counters"),
    "raybench data": (_sweep(extra="data: {num_workers: 2}\n"), "data.num_workers",
                      "reads its dataset from the recipe"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_torchtune_config_exits_2_and_writes_nothing(name, tmp_path, capsys):
    text, field, message = BAD[name]
    sweep = write_sweep(tmp_path / "sweep.yaml", text)
    assert_plan_refuses(sweep, field, message, tmp_path / "store", lambda: capsys.readouterr().err)


def test_a_good_section_gives_torchtunes_own_command_line(tmp_path, model_dir):
    text = _sweep(overrides="{tokenizer.path: /data/tokenizer.model, dataset.data_files: /data/alpaca.json, "
                  "+custom_sharded_layers: [tok_embeddings, output]}")
    text = text.replace("{preset: tiny}", f"{{path: {model_dir}}}")
    trial = plan(load_sweep(write_sweep(tmp_path / "sweep.yaml", text)))[0]
    argv = torchtune.argv(trial.config, trial.config.stack.python)
    assert argv[:11] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                         "-m", "raybench.runtime.stacks.torchtune_recipe", "lora_finetune_distributed", "--config",
                         str(CONFIG)]
    pairs = dict(item.split("=", 1) for item in argv[11:])
    assert pairs["custom_sharded_layers"] == '["tok_embeddings", "output"]'  # +key: a key the file does not have
    assert pairs["max_steps_per_epoch"] == "4" and pairs["epochs"] == "1" and pairs["batch_size"] == "2"
    assert pairs["dtype"] == "fp32" and pairs["clip_grad_norm"] == "1.0" and pairs["compile"] == "false"
    assert pairs["model.lora_rank"] == "16" and pairs["model.lora_alpha"] == "32.0"
    assert "model.lora_attn_modules" not in pairs  # the adapted layers are the config's
    assert pairs["checkpointer.checkpoint_dir"] == str(model_dir)
    assert pairs["checkpointer.checkpoint_files"] == '["model.safetensors"]'


def test_adapter_params_are_the_configs_layers(tmp_path):
    """Seed 000's config adapts q, v, output projections and the MLP at rank 64 (not k: torchtune's choice)."""
    from raybench.spec.presets import model_shape

    seed = Path(__file__).resolve().parents[2] / "sweeps" / "seed000-torchtune.yaml"
    text = seed.read_text().replace("/EDIT-ME/torchtune-venv/bin/python", sys.executable).replace("/EDIT-ME/", "/")
    sweep = write_sweep(tmp_path / "seed.yaml", text.replace("stacks/", f"{seed.parent}/stacks/"))
    trial = plan(load_sweep(sweep))[0]
    shape = model_shape(trial.config)
    h, kv, inter = 2048, 512, 8192
    per_block = 64 * ((h + h) + (h + kv) + (h + h) + 3 * (h + inter))  # q, v, o, gate/up/down
    assert torchtune.adapter_params(trial.config, shape) == 16 * per_block


def test_an_axis_sweeps_a_dotted_torchtune_key(tmp_path, model_dir):
    """`stack.overrides.dataset.packed` sets torchtune's own `dataset.packed`, a key with a dot in it."""
    text = _sweep(overrides="{tokenizer.path: /data/tokenizer.model, dataset.data_files: /data/alpaca.json}",
                  extra="axes:\n  stack.overrides.dataset.packed: [true, false]\n")
    text = text.replace("{preset: tiny}", f"{{path: {model_dir}}}")
    trials = plan(load_sweep(write_sweep(tmp_path / "sweep.yaml", text)))
    assert [t.config.stack.overrides["dataset.packed"] for t in trials] == [True, False]
    assert "dataset.packed=false" in torchtune.argv(trials[1].config, sys.executable)
