"""A trial's stack section checked before launch (`plan`): the entry imports, the stack's own keys are its
schema's, and raybench's own train fields are set only where they map exactly onto the stack (docs/stacks/).

Each kind's descriptor (raybench.spec.stacks) gives its mapping table and own keys (the stack's own key for a
raybench field it does not take, named in the refusal) and names its planning module (hf, lightning, torchtune,
torchtitan, command), which gives `mapped(config)`, the train fields this trial takes, and `problems(config)`, its
schema's check of the overrides.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType

from raybench.spec import stacks
from raybench.spec.stacks import protocol
from raybench.spec.errors import Problem
from raybench.spec.load import PLACEHOLDER
from raybench.spec.sweep_spec import TrainSpec, TrialConfig

# raybench's fields that mean the same under every stack: the timed window, the trial's worker environment.
ALWAYS_MAPPED = ("warmup_steps", "env")
# Fields that only describe raybench's own loop, or follow from one that is refused (lora settings with finetune).
_NESTED = {"lora"}


def planning_module(kind: str) -> ModuleType:
    """The kind's planning module (its descriptor names it), checked against its protocol (spec.stacks.protocol:
    `problems`, `mapped`, and a command line's `argv` and `adapter_params`)."""
    stack = stacks.kind(kind)
    return protocol.checked(importlib.import_module(stack.planning), protocol.planning_protocol(stack), kind)


def problems(config: TrialConfig) -> list[Problem]:
    """Everything wrong with a trial's stack section; [] for raybench's own loop."""
    stack = stacks.kind(config.stack.kind)
    if stack.planning is None:
        return _own_fields_problems(config)
    module = planning_module(stack.name)
    found = _unmapped_fields(config.train, stack.name, module.mapped(config), stack.own_keys)
    if stack.own_python:
        found += interpreter_problems(stack.name, config.stack.python)
    return found + module.problems(config)


def _own_fields_problems(config: TrialConfig) -> list[Problem]:
    """raybench's own loop takes no stack settings."""
    stack = config.stack
    set_fields = [name for name in ("entry", "config", "recipe", "command", "python")
                  if getattr(stack, name) is not None]
    set_fields += [name for name in ("overrides", "pythonpath") if getattr(stack, name)]
    kinds = ", ".join(stacks.user_kinds())
    return [Problem(f"stack.{name}", getattr(stack, name), f"only a user's stack takes this; set stack.kind ({kinds}) "
                    "or remove it") for name in set_fields]


def _unmapped_fields(train: TrainSpec, kind: str, mapped: dict[str, tuple[str, ...]],
                     own_keys: dict[str, str]) -> list[Problem]:
    """raybench train fields set off their defaults that the stack does not take: refused, naming its own key."""
    defaults = TrainSpec()
    found = []
    for name in TrainSpec.model_fields:
        if name in mapped or name in ALWAYS_MAPPED or name in _NESTED:
            continue
        value = getattr(train, name)
        if value == getattr(defaults, name):
            continue
        own = own_keys.get(name)
        fix = (f"set the stack's own key instead ({own})" if own else
               "the stack has no exact equivalent; configure it in the stack itself")
        takes = (f"fields it takes: {', '.join(sorted(mapped))}" if mapped else
                 "it takes none of raybench's train fields")
        found.append(Problem(f"train.{name}", value, f"stack {kind} does not take raybench's train.{name}; {fix} "
                             f"({takes}; docs/stacks/{kind}.md)"))
    if train.tuning.trains_base and train.lora != defaults.lora:
        found.append(Problem("train.lora", train.lora.model_dump(), f"stack {kind} does not take raybench's "
                             "LoRA settings; configure adapters in the stack itself"))
    return found


def entry_problems(config: TrialConfig, field: str = "stack.entry") -> list[Problem]:
    """stack.entry names an importable 'module:function' (stack.pythonpath first on the path)."""
    entry = config.stack.entry
    if entry is None:
        return [Problem(field, None, f"stack {config.stack.kind} needs a 'module:function' that builds the trial's "
                        f"trainer; docs/stacks/{config.stack.kind}.md")]
    module_name, _, function = entry.partition(":")
    if not module_name or not function:
        return [Problem(field, entry, "expected 'module:function', e.g. my_project.train:build_trainer")]
    added = [os.path.abspath(p) for p in config.stack.pythonpath if os.path.abspath(p) not in sys.path]
    sys.path[:0] = added
    try:
        if importlib.util.find_spec(module_name) is None:
            return [Problem(field, entry, f"no module named '{module_name}'; add its directory to stack.pythonpath "
                            "or install it")]
        module = importlib.import_module(module_name)
    except ImportError as err:
        return [Problem(field, entry, f"importing '{module_name}' failed: {err}; fix the import or install what "
                        "it needs")]
    finally:
        for path in added:
            sys.path.remove(path)
    if not callable(getattr(module, function, None)):
        return [Problem(field, entry, f"module '{module_name}' has no function '{function}'")]
    return []


def interpreter_problems(kind: str, python: str | None) -> list[Problem]:
    """stack.python of a stack that runs in its own environment (torchtune, torchtitan): given, not the sweep
    file's placeholder, and an executable file."""
    fix = (f"name the interpreter of {kind}'s own environment, e.g. /path/to/{kind}-venv/bin/python "
           f"(scripts/{kind}-venv.sh builds one)")
    if python is None:
        return [Problem("stack.python", None, f"stack {kind} runs in its own environment; {fix}")]
    if python.startswith(PLACEHOLDER):
        return [Problem("stack.python", python, f"a placeholder: {fix}")]
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return [Problem("stack.python", python, f"no executable file there; {fix}")]
    return []
