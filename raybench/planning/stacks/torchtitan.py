"""The torchtitan stack checked before launch: torchtitan's own trainer in torchtitan's own environment
(docs/stacks/torchtitan.md).

A trial runs `stack.python -m torch.distributed.run ... -m raybench.runtime.stacks.torchtitan_train CONFIG_FILE
FUNCTION --section.key=value ...` (`argv`): torchtitan 0.3.0's job config is a Python function returning its
Trainer.Config (as its model registries define them), which its command line then overrides key by key. raybench
passes stack.overrides, then the train fields that map exactly (`mapped_values`), so a mapped key is refused in the
overrides. Here the file is Python that defines stack.recipe, every override is a key of torchtitan 0.3.0's job
config with a value of its type (torchtitan_schema.KEYS, written from torchtitan by scripts/torchtitan_schema.py);
the interpreter (stack.python) is checked for every kind that runs in its own environment (planning.stacks.problems).

The standard library only: torchtitan is not imported (it lives in stack.python's environment, not raybench's).
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from pathlib import Path
from typing import Any

from raybench.planning.stacks.torchtitan_schema import KEYS, TORCHTITAN_VERSION
from raybench.spec.errors import Problem
from raybench.spec.load import PLACEHOLDER
from raybench.spec.stacks import kind
from raybench.spec.sweep_spec import DataSpec, TrialConfig
from raybench.spec.strategies import FSDP2

TORCHTITAN = kind("torchtitan")
# The torchtitan keys raybench sets on every trial's command line (refused in stack.overrides): the field that sets
# each, from the registry's table.
SET_KEYS = TORCHTITAN.set_keys()
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}
# The model-parallel degrees the data-parallel ranks are the rest of (training.global_batch_size counts those).
MODEL_PARALLEL_KEYS = ("parallelism.tensor_parallel_degree", "parallelism.pipeline_parallel_degree",
                       "parallelism.context_parallel_degree")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def mapped(config: TrialConfig) -> dict[str, tuple[str, ...]]:
    """The train fields every torchtitan trial takes, with the torchtitan keys each becomes (the registry's table)."""
    return TORCHTITAN.mapped


def adapter_params(config: TrialConfig, shape) -> int:
    """LoRA parameters the trial adds to the model: none (train.finetune is full only)."""
    return 0


def problems(config: TrialConfig) -> list[Problem]:
    stack = config.stack
    found = [Problem(f"stack.{name}", getattr(stack, name), "stack torchtitan runs stack.recipe of stack.config; "
                     f"{name} is for other stacks: remove it") for name in ("entry", "command") if getattr(stack, name)]
    if stack.pythonpath:
        found.append(Problem("stack.pythonpath", stack.pythonpath, "stack torchtitan puts stack.config's directory "
                             "on the path itself: remove it"))
    found += _config_file_problems(stack.config, stack.recipe)
    found += _train_problems(config)
    found += _data_problems(config)
    found += _override_problems(stack.overrides)
    return found


def config_functions(path: str) -> list[str]:
    """The names the file defines or imports at its top level (a config function among them), without running it."""
    tree = ast.parse(Path(path).read_text(), filename=path)
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names += [alias.asname or alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.Assign):
            names += [target.id for target in node.targets if isinstance(target, ast.Name)]
    return names


def _config_file_problems(path: str | None, function: str | None) -> list[Problem]:
    example = "e.g. sweeps/stacks/torchtitan_tiny.py, whose llama3_tiny_cpu derives torchtitan's llama3_debugmodel"
    if path is None:
        return [Problem("stack.config", None, "stack torchtitan needs its job config: a Python file of config "
                        "functions returning a Trainer.Config, as torchtitan's config_registry.py files are; "
                        f"{example}")]
    if not Path(path).is_file():
        return [Problem("stack.config", path, "file not found; a Python file of torchtitan config functions, "
                        f"{example}")]
    if Path(path).suffix != ".py":
        return [Problem("stack.config", path, f"torchtitan {TORCHTITAN_VERSION}'s job configs are Python functions "
                        f"(no TOML files): name a .py file of config functions, {example}")]
    try:
        names = config_functions(path)
    except (SyntaxError, UnicodeDecodeError) as err:
        return [Problem("stack.config", path, f"cannot be read as Python: {type(err).__name__}: {err}")]
    functions = [n for n in names if not n.startswith("_")]
    if function is None:
        return [Problem("stack.recipe", None, "stack torchtitan needs the config function of stack.config to run "
                        f"(torchtitan's --config): one of {', '.join(functions) or 'none defined'}")]
    if function not in names:
        close = difflib.get_close_matches(function, functions, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return [Problem("stack.recipe", function, f"{path} defines no {function}; {hint}its names: "
                        f"{', '.join(functions) or 'none'}")]
    return []


def _train_problems(config: TrialConfig) -> list[Problem]:
    """Mapped fields whose value has no torchtitan equivalent."""
    train = config.train
    found = []
    if train.parallelism is not FSDP2:
        found.append(Problem("train.strategy", train.strategy, "torchtitan's trainer shards with FSDP2: set "
                             "train.strategy: fsdp2 (the row's strategy column)"))
    if not train.tuning.trains_base:
        found.append(Problem("train.finetune", train.finetune, "torchtitan's trainer trains every weight (its LoRA "
                             "is a model converter of the config function): set train.finetune: full"))
    if train.precision not in PRECISIONS:
        found.append(Problem("train.precision", train.precision, "torchtitan trains in float32 or bfloat16 "
                             "(training.mixed_precision_param): use fp32 or bf16"))
    if train.max_grad_norm is None:
        found.append(Problem("train.max_grad_norm", None, "torchtitan always clips gradients (training.max_norm): "
                             "set a norm, e.g. 1.0"))
    # training.global_batch_size counts the data-parallel ranks: the workers over these degrees.
    found += [Problem(f"stack.overrides.{key}", value, "a parallel degree: a positive integer dividing "
                      "resources.workers (1: off)")
              for key, value in _model_parallel(config).items()
              if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    return found


def _data_problems(config: TrialConfig) -> list[Problem]:
    """raybench's data section is not read: the dataset is the job config's dataloader."""
    defaults = DataSpec()
    return [Problem(f"data.{name}", getattr(config.data, name), "stack torchtitan reads its dataset from the job "
                    "config (dataloader.*, e.g. dataloader.dataset_path in stack.overrides); remove it")
            for name in DataSpec.model_fields if getattr(config.data, name) != getattr(defaults, name)]


def _override_problems(overrides: dict[str, Any]) -> list[Problem]:
    found = []
    for key, value in overrides.items():
        field = f"stack.overrides.{key}"
        if not _KEY.match(key):
            found.append(Problem(field, value, "a torchtitan job config key in dotted form, e.g. "
                                 "training.local_batch_size (its command line's --training.local_batch_size)"))
        elif key in SET_KEYS:
            found.append(Problem(field, value, f"raybench sets {key} from {SET_KEYS[key]}: set that instead "
                                 "(docs/stacks/torchtitan.md)"))
        elif key not in KEYS:
            close = difflib.get_close_matches(key, list(KEYS), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            found.append(Problem(field, value, f"not a key of torchtitan {TORCHTITAN_VERSION}'s job config; {hint}"
                                 "anything else is set in the config function (stack.config)"))
        elif isinstance(value, str) and value.startswith(PLACEHOLDER):
            found.append(Problem(field, value, "a placeholder: set it to the path of your local copy"))
        else:
            found += _type_problems(field, key, value)
    return found


def _type_problems(field: str, key: str, value: Any) -> list[Problem]:
    types = [t for spelled in KEYS[key] for t in spelled.split(" | ")]
    if any(_takes(t, value) for t in types):
        return []
    if not any(_settable(t) for t in types):
        return [Problem(field, value, f"{key} is a {' | '.join(KEYS[key])}, which torchtitan's command line does not "
                        "take: set it in the config function (stack.config)")]
    return [Problem(field, value, f"{key} takes {' or '.join(_spoken(t) for t in types if _settable(t))}, not "
                    f"{type(value).__name__} {value!r}")]


def _literals(spelled: str) -> list:
    return json.loads("[" + spelled[len("literal["):-1] + "]")


def _takes(spelled: str, value: Any) -> bool:
    """Whether the override's YAML value is one of torchtitan's type (as the schema spells it)."""
    if spelled == "none":
        return value is None
    if spelled == "bool":
        return isinstance(value, bool)
    if spelled == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if spelled == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if spelled == "str":
        return isinstance(value, str)
    if spelled.startswith("literal["):
        return value in _literals(spelled) and not isinstance(value, bool)
    if spelled.startswith("list[") and spelled[5:-1] in ("str", "int", "float"):
        return isinstance(value, list) and all(_takes(spelled[5:-1], item) for item in value)
    return False


def _settable(spelled: str) -> bool:
    return (spelled in ("none", "bool", "int", "float", "str") or spelled.startswith("literal[")
            or spelled in ("list[str]", "list[int]", "list[float]"))


def _spoken(spelled: str) -> str:
    if spelled.startswith("literal["):
        return "one of " + ", ".join(str(v) for v in _literals(spelled))
    return {"none": "null", "list[str]": "a list of strings"}.get(spelled, spelled)


def _model_parallel(config: TrialConfig) -> dict[str, Any]:
    return {key: config.stack.overrides.get(key, 1) for key in MODEL_PARALLEL_KEYS}


def mapped_values(config: TrialConfig) -> dict[str, Any]:
    """raybench's fields as torchtitan keys, for this trial (`problems` found nothing wrong)."""
    train = config.train
    model_parallel = 1
    for degree in _model_parallel(config).values():
        model_parallel *= degree if isinstance(degree, int) and degree > 0 else 1  # else refused by `problems`
    data_parallel = max(1, config.resources.workers // model_parallel)
    return {
        "training.steps": train.steps,
        "training.local_batch_size": train.micro_batch,
        # torchtitan derives its gradient accumulation as global / (local x data-parallel ranks).
        "training.global_batch_size": train.micro_batch * train.grad_accum * data_parallel,
        "training.seq_len": train.seq_len,
        "debug.seed": train.seed,
        "training.max_norm": train.max_grad_norm,
        "training.mixed_precision_param": PRECISIONS.get(train.precision, train.precision),
        "compile.enable": train.compile,
    }


def cli_args(key: str, value: Any) -> list[str]:
    """One key as torchtitan's (tyro) command line takes it: a bool as a flag (--a.b / --a.no-b), a list of strings
    comma-joined, a list of numbers as separate values, null as None, anything else --key=value (so that a value
    starting with '-' is not read as a flag)."""
    if isinstance(value, bool):
        section, _, name = key.rpartition(".")
        return [f"--{key}" if value else f"--{section + '.' if section else ''}no-{name}"]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [f"--{key}={','.join(value)}"]
    if isinstance(value, list):
        return [f"--{key}", *(json.dumps(v) for v in value)]
    return [f"--{key}={'None' if value is None else value}"]


def argv(config: TrialConfig, python: str) -> list[str]:
    """The trial's command: torchrun over this machine's ranks (python: stack.python, torchtitan's environment), the
    launcher (the registry's runtime module), torchtitan's own CLI arguments."""
    stack = config.stack
    pairs = {**stack.overrides, **mapped_values(config)}
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(config.resources.workers), "-m", TORCHTITAN.runtime, stack.config, stack.recipe,
            *(arg for key, value in pairs.items() for arg in cli_args(key, value))]
