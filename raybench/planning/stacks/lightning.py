"""The lightning stack's keys, checked before launch (docs/stacks/lightning.md).

stack.entry names the user's function; it returns a LightningModule and its training data. Each key of
stack.overrides is either a Lightning Trainer argument (a parameter of lightning.pytorch.Trainer) or a keyword
parameter of that function, which gets it; nothing else is accepted (a function with **kwargs takes every key that
is not a Trainer argument). raybench builds the Trainer: the keys it sets from the trial are refused in overrides,
naming the field that sets them. A function that declares `ctx` gets the trial's context from raybench, with the
data spec's tokenized data (data.source hf) as raybench's loop lays it out.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import os
import sys

from raybench.planning.stacks import yaml_values
from raybench.spec.errors import Problem
from raybench.spec.stacks import kind
from raybench.spec.stacks.lightning import CONTEXT_PARAMETER, takes_context
from raybench.spec.sweep_spec import DataSpec, TrialConfig

LIGHTNING = kind("lightning")
# With data.source hf, what the rows the function gets from ctx take besides (runtime.data.hf_rows): seq_len, the
# length of ctx.train_rows()'s rows (samples truncated to it, padded or packed).
MAPPED_WITH_DATA = {"seq_len": ()}


def mapped(config: TrialConfig) -> dict[str, tuple[str, ...]]:
    """The train fields this trial takes: the registry's table, and seq_len where the data spec's rows reach the
    function."""
    return {**LIGHTNING.mapped, **MAPPED_WITH_DATA} if config.data.source == "hf" else LIGHTNING.mapped


# The strategies raybench runs under Lightning, each Lightning's own (StrategyRegistry names).
STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
# Trainer arguments raybench sets from the trial: the field that sets each.
FROM_TRIAL = {
    **LIGHTNING.set_keys(),
    "gradient_clip_algorithm": "train.max_grad_norm (raybench clips by norm)",
    "accelerator": "resources.gpus_per_worker",
    "devices": "resources.workers",
    "num_nodes": "resources.workers",
}
# Trainer arguments raybench fixes so that the run is train.steps optimizer steps and nothing else: why each.
FIXED = {
    "max_epochs": "the run lasts train.steps optimizer steps",
    "min_epochs": "the run lasts train.steps optimizer steps",
    "min_steps": "the run lasts train.steps optimizer steps",
    "max_time": "the run lasts train.steps optimizer steps",
    "fast_dev_run": "the run lasts train.steps optimizer steps",
    "limit_train_batches": "the run lasts train.steps optimizer steps",
    "overfit_batches": "the run lasts train.steps optimizer steps",
    "limit_val_batches": "validation is off: it would run inside the timed steps",
    "val_check_interval": "validation is off: it would run inside the timed steps",
    "check_val_every_n_epoch": "validation is off: it would run inside the timed steps",
    "num_sanity_val_steps": "validation is off: it would run inside the timed steps",
    "logger": "raybench's row is the record (logger=False)",
    "enable_checkpointing": "checkpoints are off: they would run inside the timed steps",
    "enable_progress_bar": "the progress bar is off",
    "enable_model_summary": "the model summary is off",
    "callbacks": "raybench adds its probe's callback; YAML cannot give callback objects",
    "plugins": "raybench adds the cluster environment that joins the trial's process group",
}
# data fields of the DataLoader, which the user's function builds: refused off their defaults (set them there).
LOADER_FIELDS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")


def problems(config: TrialConfig) -> list[Problem]:
    """The entry imports and every override is a Trainer argument or a parameter of the entry's function, of the
    type it takes; the strategy is one raybench runs, on hardware it runs on."""
    from raybench.planning.stacks import entry_problems  # the package imports this module: import when needed

    found = entry_problems(config)
    if found:
        return found
    function = _entry_function(config)
    trainer = _parameters(_trainer_class().__init__)
    try:
        own = _parameters(function)
    except (TypeError, ValueError, NameError) as err:
        return [Problem("stack.entry", config.stack.entry, f"cannot read the function's parameters: {err}")]
    with_context = takes_context(own)
    own = {k: p for k, p in own.items() if k != CONTEXT_PARAMETER}
    found = [p for key, value in config.stack.overrides.items()
             for p in _key_problems(key, value, trainer, own, config)]
    return (found + _missing_arguments(own, config) + _strategy_problems(config)
            + _data_problems(config, with_context))


def _key_problems(key: str, value, trainer: dict, own: dict, config: TrialConfig) -> list[Problem]:
    field = f"stack.overrides.{key}"
    entry = config.stack.entry
    if key in FROM_TRIAL:
        return [Problem(field, value, f"raybench sets Lightning's {key} from {FROM_TRIAL[key]}; set that instead")]
    if key in FIXED:
        return [Problem(field, value, f"raybench fixes Lightning's {key}: {FIXED[key]}; remove it")]
    if key == CONTEXT_PARAMETER:
        return [Problem(field, value, f"raybench passes the trial's context as the function's '{key}' parameter; "
                        "remove this override (or rename the function's parameter)")]
    if key == "strategy":
        return []  # _strategy_problems
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in own.values())
    own_named = {k: p for k, p in own.items() if p.kind not in (inspect.Parameter.VAR_KEYWORD,
                                                                 inspect.Parameter.VAR_POSITIONAL)}
    if key in trainer and key in own_named:
        return [Problem(field, value, f"names both a Lightning Trainer argument and a parameter of {entry}; "
                        "rename the function's parameter")]
    if key in trainer:
        return _type_problems(field, value, trainer[key].annotation)
    if key in own_named:
        return _type_problems(field, value, own_named[key].annotation)
    if takes_any:
        return []
    known = sorted((set(trainer) - set(FROM_TRIAL) - set(FIXED) - {"self"}) | set(own_named))
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else f"parameters of {entry}: {', '.join(own_named) or 'none'}"
    return [Problem(field, value, f"unknown key: neither a Lightning Trainer argument nor a parameter of {entry}; "
                    f"{hint}")]


def _missing_arguments(own: dict, config: TrialConfig) -> list[Problem]:
    """The function's parameters without a default must come from the overrides."""
    kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return [Problem(f"stack.overrides.{name}", None, f"{config.stack.entry} takes '{name}' with no default; "
                    "set it in stack.overrides")
            for name, p in own.items()
            if p.kind not in kinds and p.default is inspect.Parameter.empty and name not in config.stack.overrides]


def _strategy_problems(config: TrialConfig) -> list[Problem]:
    """A strategy raybench runs (Lightning's own classes, joining the trial's process group), where it runs."""
    strategy = config.stack.overrides.get("strategy", "ddp")
    field = "stack.overrides.strategy"
    if strategy not in STRATEGIES:
        close = difflib.get_close_matches(str(strategy), STRATEGIES, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return [Problem(field, strategy, f"{hint}raybench runs Lightning's {', '.join(STRATEGIES)} (others spawn "
                        "their own processes or were not validated against raybench's process group)")]
    found = []
    if strategy != "ddp" and config.resources.gpus_per_worker == 0:
        # Lightning's accelerator connector refuses fsdp off CUDA, and DeepSpeedStrategy.setup_environment refuses
        # the CPU accelerator: the trial would fail in every worker.
        found.append(Problem(field, strategy, f"Lightning runs {strategy} on CUDA GPUs only; set "
                             "resources.gpus_per_worker: 1, or use ddp on CPU"))
    if strategy == "fsdp" and config.train.max_grad_norm is not None:
        found.append(Problem("train.max_grad_norm", config.train.max_grad_norm, "Lightning's FSDP strategy cannot "
                             "clip gradients by norm (its FSDPPrecision refuses it); set train.max_grad_norm: null "
                             "for fsdp trials"))
    return found


def _data_problems(config: TrialConfig, with_context: bool) -> list[Problem]:
    """raybench's data reaches the function only as the data spec's tokenized data (data.source hf) through its
    `ctx`; the DataLoader is the function's own. Any other data field set off its default would change nothing."""
    defaults = DataSpec()
    off_default = [name for name in DataSpec.model_fields if getattr(config.data, name) != getattr(defaults, name)]
    if config.data.source == "hf" and not with_context:
        return [Problem("data.source", "hf", f"{config.stack.entry} takes no '{CONTEXT_PARAMETER}' parameter, so "
                        "raybench's tokenized data would not reach it; add a ctx parameter and build the DataLoader "
                        "from ctx.train_rows() and ctx.data_collator() (docs/stacks/lightning.md), or remove data.*")]
    if config.data.source == "hf":
        return [Problem(f"data.{name}", getattr(config.data, name), "the entry function builds the DataLoader; "
                        "set this there, as one of its parameters")
                for name in off_default if name in LOADER_FIELDS]
    return [Problem(f"data.{name}", getattr(config.data, name), "the lightning stack takes raybench's data as "
                    "data.source: hf only (the data spec's tokenized data, through the function's ctx); otherwise "
                    "the entry function returns its own DataLoader or LightningDataModule: set this there, as one "
                    "of its parameters")
            for name in off_default]


def _type_problems(field: str, value, annotation) -> list[Problem]:
    problem = yaml_values.type_problem(field, value, annotation)
    return [problem] if problem else []


def _parameters(function) -> dict[str, inspect.Parameter]:
    """The function's parameters with their annotations evaluated (modules with `from __future__ import
    annotations` hold them as strings), or as written where they do not evaluate."""
    try:
        params = inspect.signature(function, eval_str=True).parameters
    except NameError:
        params = inspect.signature(function).parameters
    return {k: p for k, p in params.items() if k != "self"}


def _trainer_class():
    from lightning.pytorch import Trainer  # heavy: only for sweeps with a lightning stack

    return Trainer


def _entry_function(config: TrialConfig):
    """The entry's function, imported with stack.pythonpath first on the path (entry_problems found it)."""
    module_name, _, name = config.stack.entry.partition(":")
    with _path(config.stack.pythonpath):
        return getattr(importlib.import_module(module_name), name)


@contextlib.contextmanager
def _path(directories: list[str]):
    added = [os.path.abspath(p) for p in directories if os.path.abspath(p) not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for path in added:
            sys.path.remove(path)
