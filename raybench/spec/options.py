"""Training options added after trial ids were first issued: the one place that says how each keeps the ids and
the stored rows of the trials before it, and which technique runs it.

A trial id hashes the trial's dumped config (`sweep_spec.config_id`). An option added later is left out of that
dump while it holds a value the earlier trials ran with (`id_default`), so those trials keep their ids (stored
rows, resumes). A row stored before the option existed does not hold it: it ran `before`, which is what
`results.store.measured_trial_config` reads into it, and where `before` is not a value ids leave out, the row
answers for the id of what it ran, not for the id it carries (`results.store.measured_trial_id`).

To add an option: its field in `TrainSpec` (spec/sweep_spec.py: type, default, description), an `Option` here,
its technique module in runtime/techniques/ (`wanted`, `apply`; named by `technique` and placed by `after` in
build's order), its plan rules (`rules`), and how the rehearsal treats it where it differs from a plain step
(rehearse/rehearsal.py): docs/architecture.md, "To add an option".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class Option:
    name: str  # the train field
    id_default: tuple  # values trial ids leave out (the earlier trials ran with them)
    before: Any  # what a row stored before the option existed ran
    ids_only: bool = False  # left out of trial ids only (a stored row's config says the value); else of every dump
    # The runtime technique that runs the option (raybench.runtime.techniques.<technique>), inserted into build's
    # order of techniques right after `after` (the techniques build names itself, such as fp8, leave both None).
    technique: str | None = None
    after: str | None = None
    # The plan's rules: (train, gpus per rank) -> [(field, why and the fix)] where the option cannot run.
    rules: Callable[[Any, int], list[tuple[str, str]]] | None = None

    @property
    def rekeys_old_rows(self) -> bool:
        """Whether a row stored before the option carries the id of trials that run something else: it ran
        `before`, which ids do not leave out."""
        return self.before not in self.id_default


def _offload_rules(train, gpus: int) -> list[tuple[str, str]]:
    """Where activation offloading cannot run, or would move nothing."""
    if not train.offload_activations:
        return []
    field, problems = "train.offload_activations", []
    if gpus == 0:
        problems.append((field, "activation offloading moves saved tensors from GPU to host memory: on CPU they are "
                         "there already; set train.offload_activations: false, or resources.gpus_per_worker: 1"))
    if train.compile:
        problems.append((field, "torch.compile traces a block's forward hooks into its graph, where offloading's "
                         "saved-tensor hooks must run eagerly; set train.compile: false, or offload_activations: "
                         "false"))
    if train.tensor_parallel:
        problems.append((field, f"offloading copies plain tensors; {train.strategy} saves DTensors: use ddp, fsdp2 "
                         "or deepspeed, or train.offload_activations: false"))
    if Fraction(train.ac_ratio) == 1 and train.ac_mode == "block":
        problems.append((field, "every block is checkpointed whole (ac_ratio 1): its checkpoint keeps its input "
                         "itself, so nothing would be offloaded; lower train.ac_ratio, or set "
                         "train.offload_activations: false"))
    return problems


def _master_weights_rules(train, gpus: int) -> list[tuple[str, str]]:
    """Where the weights cannot be kept in bf16 alone."""
    if train.master_weights != "none":
        return []
    field, problems = "train.master_weights", []
    if train.precision != "bf16":
        problems.append((field, f"none keeps the weights in bf16, and precision is {train.precision}: set "
                         "train.precision: bf16, or master_weights: fp32"))
    if not train.tuning.trains_base:
        problems.append((field, f"{train.finetune} trains adapters over a frozen base (its dtype is "
                         "train.lora.base_dtype): set train.master_weights: fp32"))
    if train.parallelism.zero:
        problems.append((field, "DeepSpeed's bf16 keeps an fp32 master copy itself: use fsdp2, ddp or tp, or "
                         "train.master_weights: fp32"))
    return problems


OPTIONS: tuple[Option, ...] = (
    Option("ac_saved_ops", id_default=(None,), before=None),
    Option("fp8", id_default=("off",), before="off"),
    Option("profile_steps", id_default=(0,), before=0),
    Option("reduce_dtype", id_default=("fp32",), before="fp32"),
    # chunked (and auto, which the plan resolves) gives the loss of the rows before it to fp32 rounding, so ids
    # leave it out; but those rows ran transformers' loss over the whole logits, with its memory and time.
    Option("loss", id_default=("chunked", "auto"), before="full", ids_only=True),
    Option("offload_activations", id_default=(False,), before=False, technique="activation_offload",
           after="compile", rules=_offload_rules),
    Option("master_weights", id_default=("fp32",), before="fp32", technique="bf16_weights", after="lora",
           rules=_master_weights_rules),
)


def option_problems(train, gpus: int) -> list[tuple[str, str]]:
    """Every option's rules over one trial's train section (the plan's refusals, each naming its field)."""
    return [problem for option in OPTIONS if option.rules for problem in option.rules(train, gpus)]


def placed_techniques(order: list[str]) -> list[str]:
    """Build's order of technique names (`order`) with each option's own technique placed after its `after`."""
    placed = list(order)
    for option in OPTIONS:
        if option.technique and option.after:
            placed.insert(placed.index(option.after) + 1, option.technique)
    return placed


def without_id_defaults(dumped: dict, values: dict, for_trial_id: bool) -> dict:
    """A TrainSpec's dump (`dumped`) with the options at a value trial ids leave out removed (`values`: the
    fields' values; `for_trial_id`: the dump is hashed for an id)."""
    for option in OPTIONS:
        if values[option.name] in option.id_default and (for_trial_id or not option.ids_only):
            dumped.pop(option.name, None)
    return dumped


def with_older_values(train: dict) -> dict:
    """A stored row's train section with the options it lacks set to what it ran (`before`)."""
    for option in OPTIONS:
        train.setdefault(option.name, option.before)
    return train


def ran_other_than_its_id(config_json: str) -> bool:
    """Whether a stored row's config lacks an option whose `before` its id does not stand for (read without
    parsing: a key named so appears as `"name":`)."""
    return any(f'"{o.name}":' not in config_json for o in OPTIONS if o.rekeys_old_rows)
