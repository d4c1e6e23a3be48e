"""The `command` stack: any command line, run out of process, its ranks timed by the probe (docs/stacks/command.md).

`stack.command` is an argv whose items hold {placeholders} filled from the trial, str.format style: raybench's
train fields that map exactly ({steps}, {micro_batch}, {seq_len}, {grad_accum}, {lr}, {seed}, {precision}),
what the trial runs on ({python}, {workers}, {model_path}, {data_path}), and every key of `stack.overrides`. A
train field is taken only where the command uses its placeholder: one set off its default that the command never
names would change nothing the command does, so it is refused like any field a stack does not take.
"""

from __future__ import annotations

import json
import os
import string
import sys

from raybench.spec.errors import Problem
from raybench.spec.stacks import kind
from raybench.spec.sweep_spec import TrainSpec, TrialConfig

COMMAND = kind("command")
# raybench's train fields a command can take, each as the placeholder of the same name (the registry's table).
TRAIN_PLACEHOLDERS = tuple(COMMAND.mapped)
# What the trial runs on, always available.
FIXED_PLACEHOLDERS = ("python", "workers", "model_path", "data_path")


def mapped(config: TrialConfig) -> dict[str, tuple[str, ...]]:
    """The train fields this trial's command takes: those whose placeholder it uses."""
    used = used_placeholders(config.stack.command or [])
    return {name: keys for name, keys in COMMAND.mapped.items() if name in used}


def adapter_params(config: TrialConfig, shape) -> None:
    """LoRA parameters the command adds to the model: not known (None). A command's config does not say what its
    script trains; the script reports it to the probe (`StepProbe.count_params`), or its row's trainable
    parameters, FLOPs and MFU stay null."""
    return None


def used_placeholders(command: list[str]) -> set[str]:
    """Every placeholder name the argv uses (unparsable items contribute none; `problems` reports them)."""
    used = set()
    for item in command:
        try:
            used.update(name for _, name, _, _ in string.Formatter().parse(item) if name)
        except ValueError:
            continue
    return used


def problems(config: TrialConfig) -> list[Problem]:
    stack = config.stack
    found = [Problem(f"stack.{name}", getattr(stack, name), f"stack command runs stack.command; {name} is for "
                     "the hf and lightning stacks: remove it")
             for name in ("entry", "config") if getattr(stack, name) is not None]
    if stack.pythonpath:
        found.append(Problem("stack.pythonpath", stack.pythonpath, "stack command does not import anything: "
                             "remove it (raybench's own source is on the command's PYTHONPATH for the probe)"))
    if stack.python is not None and not (os.path.isfile(stack.python) and os.access(stack.python, os.X_OK)):
        found.append(Problem("stack.python", stack.python, "no executable file there; name the Python "
                             "interpreter of the stack's environment, e.g. /path/to/venv/bin/python"))
    found += _override_key_problems(stack.overrides)
    command = stack.command
    if not command or not all(isinstance(item, str) and item for item in command):
        return found + [Problem("stack.command", command, "stack command needs the argv to run, a list of "
                                "non-empty strings, e.g. ['{python}', '-m', 'torch.distributed.run', "
                                "'--standalone', '--nproc-per-node', '{workers}', 'train.py', '--steps', '{steps}']")]
    found += _placeholder_problems(config)
    used = used_placeholders(command)
    found += [Problem(f"stack.overrides.{key}", value, f"is not used in stack.command; add {{{key}}} where the "
                      "command takes it, or remove the override")
              for key, value in stack.overrides.items() if key not in used]
    return found


def _override_key_problems(overrides: dict) -> list[Problem]:
    found = []
    for key, value in overrides.items():
        if not key.isidentifier():
            found.append(Problem(f"stack.overrides.{key}", value, "an override is used as a {placeholder} in "
                                 "stack.command: name it with letters, digits and _ only"))
        elif key in TRAIN_PLACEHOLDERS or key in FIXED_PLACEHOLDERS:
            fix = f"set train.{key} and use {{{key}}}" if key in TRAIN_PLACEHOLDERS else f"use {{{key}}} as it is"
            found.append(Problem(f"stack.overrides.{key}", value, f"{{{key}}} is raybench's own placeholder; {fix}"))
    return found


def _placeholder_problems(config: TrialConfig) -> list[Problem]:
    """Each item parses, names only known placeholders, plainly, whose value the trial has."""
    known = sorted({*TRAIN_PLACEHOLDERS, *FIXED_PLACEHOLDERS, *config.stack.overrides})
    values = placeholder_values(config, python=config.stack.python or sys.executable)
    found = []
    for i, item in enumerate(config.stack.command):
        where = f"stack.command[{i}]"
        try:
            parsed = list(string.Formatter().parse(item))
        except ValueError as err:
            found.append(Problem(where, item, f"cannot be read as a template ({err}); write a literal brace as "
                                 "{{ or }}"))
            continue
        for _, name, spec, conversion in parsed:
            if name is None:
                continue
            if name not in known:
                found.append(Problem(where, item, f"unknown placeholder {{{name}}}; known: "
                                     f"{', '.join('{' + k + '}' for k in known)} (an override KEY is {{KEY}})"))
            elif spec or conversion:
                found.append(Problem(where, item, f"write {{{name}}} plainly: its value is inserted as text, "
                                     "with no format spec or conversion"))
            elif values[name] is None:
                section = name.replace("_", ".")
                found.append(Problem(where, item, f"{{{name}}} is used but {section} is null; set {section}"))
    return found


def placeholder_values(config: TrialConfig, python: str) -> dict[str, str | None]:
    """Every placeholder's text for this trial (None: the trial has no value for it)."""
    train: TrainSpec = config.train
    values = {name: _text(getattr(train, name)) for name in TRAIN_PLACEHOLDERS}
    values.update(python=python, workers=str(config.resources.workers), model_path=config.model.path,
                  data_path=config.data.path)
    values.update({key: _text(value) for key, value in config.stack.overrides.items()})
    return values


def _text(value) -> str:
    """A value as command-line text: strings as they are, anything else as JSON (1e-05, true, [1, 2])."""
    return value if isinstance(value, str) else json.dumps(value)


def argv(config: TrialConfig, python: str) -> list[str]:
    """The trial's command with every placeholder filled (`problems` found nothing wrong with it)."""
    values = placeholder_values(config, python)
    return [item.format(**values) for item in config.stack.command]
