"""The hf stack checked before launch: a transformers Trainer or a TRL SFTTrainer (docs/stacks/hf.md).

The trial's arguments are one typed dataclass, TRL's SFTConfig (transformers' TrainingArguments where TRL is not
installed), assembled in this order: the keys of stack.config's file, then stack.overrides, then raybench's train
fields that map exactly (the registry's table, raybench.spec.stacks), then what raybench sets for every measured
trial (HARNESS: no checkpoints, no reporting, no evaluation). `trial_args` (raybench.spec.stacks.hf) builds that
mapping; runtime.stacks.hf constructs the dataclass from it. Here the file's keys and the overrides are checked
against the dataclass's fields and their types, and the whole is constructed once so that its own checks (an
unknown optimizer name, a bad scheduler) become Problems.

transformers and TRL are imported inside the functions: planning stays light for every other sweep.
"""

from __future__ import annotations

import difflib
import warnings
from pathlib import Path
from typing import Any

from raybench.planning.stacks import yaml_values
from raybench.spec.errors import Problem
from raybench.spec.stacks import kind
from raybench.spec.stacks.hf import (DATA_MAPPED, HARNESS, SET_ON_RANK, args_class, field_types, read_config_file,
                                     trial_args)
from raybench.spec.sweep_spec import TrialConfig

HF = kind("hf")


def mapped(config: TrialConfig) -> dict[str, tuple[str, ...]]:
    """The train fields every hf trial takes, with the dataclass keys each becomes (the registry's table)."""
    return HF.mapped


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


def _key_problems(values: dict[str, Any], where: str, hints: dict[str, Any], schema: str) -> list[Problem]:
    """Each key is a field of the dataclass, not one raybench sets, with a value of the field's type."""
    mapped_keys = HF.set_keys()
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
