"""The hf stack checked before launch: a transformers Trainer or a TRL SFTTrainer (docs/stacks/hf.md).

The trial's arguments are one typed dataclass, TRL's SFTConfig (transformers' TrainingArguments where TRL is not
installed), assembled in this order: the keys of stack.config's file, then stack.overrides, then raybench's train
fields that map exactly (MAPPED), then what raybench sets for every measured trial (HARNESS: no checkpoints, no
reporting, no evaluation). `trial_args` builds that mapping; runtime.stacks.hf constructs the dataclass from it.
Here the file's keys and the overrides are checked against the dataclass's fields and their types, and the whole
is constructed once so that its own checks (an unknown optimizer name, a bad scheduler) become Problems.

transformers and TRL are imported inside the functions: planning stays light for every other sweep.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
import warnings
from pathlib import Path
from typing import Any

from raybench.planning.stacks import yaml_values
from raybench.spec.errors import Problem
from raybench.spec.sweep_spec import TrialConfig

# raybench's train field -> the dataclass key it becomes (exact: the same quantity, the same units).
MAPPED = {
    "steps": "max_steps",
    "micro_batch": "per_device_train_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "lr": "learning_rate",
    "seed": "seed",
    "weight_decay": "weight_decay",
    "max_grad_norm": "max_grad_norm",  # null (no clipping) -> 0.0, the Trainer's own "off"
    "precision": "bf16/fp16",  # fp32: both false; bf16: bf16; fp16: fp16 (accelerate's loss scaler)
    # SFTConfig only: TRL truncates (or packs) every sequence to max_length. With a plain Trainer the user's collator
    # decides the length, and the runtime refuses a batch longer than train.seq_len (docs/stacks/hf.md).
    "seq_len": "max_length",
    # Every decoder layer checkpointed or none: ac_ratio 0 or 1 only. Mapped, not left to the dataclass, because
    # SFTConfig checkpoints by default (TrainingArguments does not): the row's ac_ratio says what ran.
    "ac_ratio": "activation_checkpointing/gradient_checkpointing",
}

# raybench's train field -> the stack's own key to set instead (named when the field is refused).
OWN_KEYS = {
    "strategy": "fsdp and fsdp_config, or deepspeed (a DeepSpeed config)",
    "tp_size": "parallelism_config, in the entry function",
    "zero_stage": "deepspeed (a DeepSpeed config)",
    "offload": "deepspeed (a DeepSpeed config)",
    "grad_scaler": "fp16 uses accelerate's loss scaler; it has no off switch",
    "finetune": "peft_config, passed to SFTTrainer in the entry function",
    "ac_mode": "activation_checkpointing_kwargs",
    "ac_saved_ops": "activation_checkpointing_kwargs",
    "compile": "torch_compile",
    "liger": "use_liger_kernel",
    "optimizer": "optim (adamw_torch, adamw_torch_fused, adafactor, sgd, ...)",
    "reshard_after_forward": "fsdp_config",
    "reduce_dtype": "fsdp_config (accelerate's FSDP2 mixed_precision_policy)",
    "fp8": "torchao's convert_to_float8_training on the model in the entry function",
}

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
        "activation_checkpointing": train.ac_ratio == "1",
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


def problems(config: TrialConfig) -> list[Problem]:
    stack = config.stack
    found = [Problem(f"stack.{name}", getattr(stack, name), "only a command stack takes this; remove it")
             for name in ("command", "python") if getattr(stack, name) is not None]
    if stack.entry is None and stack.config is None:
        return found + [Problem("stack.entry", None, "stack hf needs an entry 'module:function' that returns a "
                                "Trainer, or a config file of SFTConfig keys (stack.config); docs/stacks/hf.md")]
    if stack.entry is not None:
        from raybench.planning.stacks import entry_problems

        found += entry_problems(config)
    if config.train.ac_ratio not in ("0", "1"):
        found.append(Problem("train.ac_ratio", config.train.ac_ratio, "the hf stack checkpoints every decoder layer "
                             "or none (activation_checkpointing): use 0 or 1"))
    found += _model_data_problems(config)
    from_file, file_problems = _config_file(stack.config)
    found += file_problems
    cls = args_class()
    hints = field_types(cls)
    found += _key_problems(from_file, "stack.config", hints, cls.__name__)
    found += _key_problems(stack.overrides, "stack.overrides", hints, cls.__name__)
    if found:
        return found
    return _construct_problems(config, cls, set(hints))


def _model_data_problems(config: TrialConfig) -> list[Problem]:
    """The model is a local directory; the config path (no entry) trains on the data spec's tokenized data
    (data.source hf)."""
    found = []
    if config.model.path is None:
        found.append(Problem("model.path", None, "stack hf loads a local model directory; set model.path "
                             "(model.preset is for raybench's own loop)"))
    if config.stack.entry is not None:
        return found
    data = config.data
    if data.source != "hf" or data.path is None:
        found.append(Problem("data.path", data.path, "stack hf without an entry trains on raybench's tokenized "
                             "data: set data.source: hf and data.path (or write an entry function that loads your "
                             "data)"))
    return found


def _config_file(path: str | None) -> tuple[dict[str, Any], list[Problem]]:
    if path is None:
        return {}, []
    if not Path(path).is_file():
        return {}, [Problem("stack.config", path, "file not found; a YAML or JSON file of SFTConfig keys")]
    try:
        return read_config_file(path), []
    except Exception as err:  # a YAML or JSON syntax error, a list instead of a mapping
        return {}, [Problem("stack.config", path, f"cannot be read: {type(err).__name__}: {err}")]


def field_types(cls: type) -> dict[str, Any]:
    """Each init field of the dataclass with its type."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a forward reference that does not resolve: the declared types as they are
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls) if f.init}


def _key_problems(values: dict[str, Any], where: str, hints: dict[str, Any], schema: str) -> list[Problem]:
    """Each key is a field of the dataclass, not one raybench sets, with a value of the field's type."""
    mapped_keys = {key: f"train.{name}" for name, key in MAPPED.items() for key in key.split("/")}
    mapped_keys.update({key: f"data.{name}" for name, key in DATA_MAPPED.items()})
    found = []
    for key, value in values.items():
        field = f"{where}.{key}"
        if key in mapped_keys:
            name = mapped_keys[key]
            found.append(Problem(field, value, f"raybench sets {key} from {name}; set {name} instead"))
        elif key in HARNESS or key in SET_ON_RANK:
            found.append(Problem(field, value, "raybench sets this for every measured trial (a temporary output "
                                 "directory, no checkpoints, no reporting, no evaluation, the trial's device); "
                                 "remove it"))
        elif key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            hint = f"did you mean '{close[0]}'?" if close else "see its documentation for the keys"
            found.append(Problem(field, value, f"not a {schema} key; {hint}"))
        elif problem := yaml_values.type_problem(field, value, hints[key]):
            found.append(problem)
    return found


def _construct_problems(config: TrialConfig, cls: type, fields: set[str]) -> list[Problem]:
    """Construct the dataclass as the rank will (on the CPU: its device checks belong to the worker), so that its
    own value checks run now; an error is pinned on the user's key that causes it alone, if one does."""
    args = {**trial_args(config, fields), "output_dir": "unused", "use_cpu": True}
    if args.get("padding_free") and not args.get("packing"):
        return [Problem("stack.overrides.padding_free", True, "TRL does not hold sequences to max_length "
                        "(train.seq_len) when padding_free runs without packing; set packing: true as well")]
    error = _construct_error(cls, args)
    if error is None:
        return []
    base = {key: value for key, value in args.items() if key not in config.stack.overrides}
    found = []
    for key, value in config.stack.overrides.items():
        alone = _construct_error(cls, {**base, key: value})
        if alone is not None:
            found.append(Problem(f"stack.overrides.{key}", value, alone))
    if not found:
        where = "stack.overrides" if config.stack.overrides else "stack.config"
        found.append(Problem(where, config.stack.overrides or config.stack.config, error))
    return found


def _construct_error(cls: type, args: dict[str, Any]) -> str | None:
    """The dataclass's own error for these arguments, or None; accelerate's device state is left as it was found
    (constructing reads the device)."""
    from accelerate.state import AcceleratorState, PartialState

    fresh = not PartialState._shared_state
    try:
        with warnings.catch_warnings():  # deprecation notes of keys the user did not set
            warnings.simplefilter("ignore")
            cls(**args)
    except Exception as err:  # its __post_init__ raises ValueError mostly, TypeError for a bad combination
        return f"{cls.__name__} refuses it: {err}"
    finally:
        if fresh:
            AcceleratorState._reset_state(reset_partial_state=True)
    return None
