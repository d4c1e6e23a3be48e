"""The hf stack's trial arguments, which its check before launch (planning.stacks.hf) and its rank
(runtime.stacks.hf) both build: one typed dataclass, TRL's SFTConfig (transformers' TrainingArguments where TRL is
not installed), assembled in this order: the keys of stack.config's file, then stack.overrides, then raybench's
train and loader fields that map exactly (`mapped_values`: the registry's table and DATA_MAPPED), then what
raybench sets for every measured trial (HARNESS: no checkpoints, no reporting, no evaluation).

transformers and TRL are imported inside the functions: the spec stays light for every other sweep.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raybench.spec.sweep_spec import TrialConfig

# What raybench sets for every measured trial; refused in the file and the overrides. output_dir is a temporary
# directory and use_cpu follows the trial's device, both set on the rank (runtime.stacks.hf).
HARNESS = {
    "report_to": "none",  # no tracker writes inside the timed steps
    "save_strategy": "no",  # no checkpoints inside the timed steps
    "eval_strategy": "no",  # no evaluation: a trial times training steps
    "push_to_hub": False,
    "disable_tqdm": True,
}
SET_ON_RANK = ("output_dir", "use_cpu", "local_rank")
# Defaults raybench gives the stack where the user gave none: no logging (each log gathers the loss across ranks).
QUIET = {"logging_strategy": "no"}

# raybench's loader fields -> the Trainer's keys for the DataLoader it builds (the same torch DataLoader arguments):
# mapped always, defaults included, so the row's data_* columns say how the Trainer loaded. The content and layout
# fields are raybench's tokenization and rows, which the entry takes through its context (ctx.tokenized_dataset,
# ctx.train_rows and ctx.data_collator).
DATA_MAPPED = {
    "num_workers": "dataloader_num_workers",
    "pin_memory": "dataloader_pin_memory",
    "prefetch_factor": "dataloader_prefetch_factor",
    "persistent_workers": "dataloader_persistent_workers",
}


def args_class() -> type:
    """The dataclass of the trial's arguments: TRL's SFTConfig, or TrainingArguments without TRL."""
    try:
        from trl import SFTConfig
    except ImportError:
        from transformers import TrainingArguments

        return TrainingArguments
    return SFTConfig


def field_types(cls: type) -> dict[str, Any]:
    """Each init field of the dataclass with its type."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a forward reference that does not resolve: the declared types as they are
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls) if f.init}


def mapped_values(config: TrialConfig, fields: set[str]) -> dict[str, Any]:
    """raybench's train and loader fields as the dataclass's keys (max_length only where the dataclass has it)."""
    train, data = config.train, config.data
    values = {
        "max_steps": train.steps,
        "per_device_train_batch_size": train.micro_batch,
        "gradient_accumulation_steps": train.grad_accum,
        "learning_rate": train.lr,
        "seed": train.seed,
        "weight_decay": train.weight_decay,
        "max_grad_norm": 0.0 if train.max_grad_norm is None else train.max_grad_norm,
        "bf16": train.precision == "bf16",
        "fp16": train.precision == "fp16",
        "max_length": train.seq_len,
        # Both names: transformers before 5.23 has only gradient_checkpointing, and SFTConfig's default for it is
        # True, so a trial that set only the new name checkpointed every layer at ac_ratio 0 (GPU round 2's TRL run).
        "activation_checkpointing": train.ac_ratio == "1",
        "gradient_checkpointing": train.ac_ratio == "1",
        "dataloader_num_workers": data.num_workers,
        "dataloader_pin_memory": data.pin_memory,
        "dataloader_prefetch_factor": data.prefetch_factor,
        # torch refuses persistent workers without workers; raybench's own loader drops the flag alike.
        "dataloader_persistent_workers": data.persistent_workers and data.num_workers > 0,
    }
    return {key: value for key, value in values.items() if key in fields}


def read_config_file(path: str) -> dict[str, Any]:
    """stack.config's keys: a YAML or JSON mapping."""
    import yaml

    text = Path(path).read_text()
    data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"expected a mapping of {args_class().__name__} keys, got {type(data).__name__}")
    return data


def trial_args(config: TrialConfig, fields: set[str]) -> dict[str, Any]:
    """The trial's keyword arguments of the dataclass, without SET_ON_RANK: file, overrides, mapped, harness."""
    stack = config.stack
    from_file = read_config_file(stack.config) if stack.config else {}
    return {**QUIET, **from_file, **stack.overrides, **mapped_values(config, fields), **HARNESS}
