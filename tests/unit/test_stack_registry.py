"""The stack kinds' registry (raybench.spec.stacks): adding a kind is its entry and its two modules, and every
place that decides by kind reaches them; the sets the planning modules derive from a kind's table stay its own."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from types import SimpleNamespace

import pytest

from raybench.planning import stacks as planning_stacks
from raybench.planning.stacks import torchtitan, torchtune
from raybench.runtime import stacks as runtime_stacks
from raybench.runtime.stacks import measure
from raybench.spec import stacks
from raybench.spec.stacks import StackKind
from raybench.spec.stacks import hf as hf_args
from raybench.spec.stacks import protocol
from raybench.spec.sweep_spec import StackSpec, TrainSpec, TrialConfig

TOY = StackKind(name="toy", summary="a toy trainer", in_process=True, tokenized_data=False,
                mapped={"steps": ("toy_steps",)}, own_keys={"lr": "toy_rate"},
                planning="tests.unit.toy_stack_planning", runtime="tests.unit.toy_stack_runtime")


def _toy_trial(**train) -> TrialConfig:
    """A trial of the toy kind: the spec's Literal of kinds was built at import, so the kind is set past it."""
    config = TrialConfig(model={"preset": "tiny"}, train=train)
    return config.model_copy(update={"stack": StackSpec().model_copy(update={"kind": "toy",
                                                                              "overrides": {"sped": 2}})})


def test_a_registered_kind_reaches_the_plans_checks_and_the_in_process_dispatch(monkeypatch):
    monkeypatch.setitem(stacks.KINDS, "toy", TOY)
    config = _toy_trial(steps=7, lr=1e-3)
    found = planning_stacks.problems(config)
    # The registry's table and own keys (a field the toy does not take), then the toy's own check.
    assert [(p.field, p.value) for p in found] == [("train.lr", 1e-3), ("stack.overrides.sped", 2)]
    assert "set the stack's own key instead (toy_rate)" in found[0].message
    assert "fields it takes: steps; docs/stacks/toy.md" in found[0].message
    assert found[1].message == "the toy stack takes speed only"

    monkeypatch.setattr(measure, "measured_run", lambda payload, build: build(payload, "ctx", "probe"))
    built = runtime_stacks.run(SimpleNamespace(config=config))
    assert built == {"built_for": "toy", "ctx": "ctx", "probe": "probe"}
    assert "toy" in stacks.user_kinds()


def test_a_kinds_module_without_its_protocols_functions_is_refused_at_its_first_use(monkeypatch):
    """A command-line kind's planning module must also give argv and adapter_params; a runtime module whose build
    takes other parameters is refused before it runs. The message names the kind, the module and each function."""
    monkeypatch.setitem(stacks.KINDS, "toy", dataclasses.replace(TOY, in_process=False))
    with pytest.raises(TypeError, match=r"stack.kind 'toy': module tests.unit.toy_stack_planning does not match "
                                        r"CommandLine: adapter_params\(config, shape\) is missing; "
                                        r"argv\(config, python\) is missing"):
        planning_stacks.problems(_toy_trial())
    odd = SimpleNamespace(__name__="odd_runtime", build=lambda payload, context: None)
    with pytest.raises(TypeError, match=r"odd_runtime does not match InProcessTrainer: "
                                        r"build takes \(payload, context\), not \(payload, ctx, probe\)"):
        protocol.checked(odd, protocol.InProcessTrainer, "toy")


def test_a_command_line_kind_does_not_run_in_a_worker(monkeypatch):
    monkeypatch.setitem(stacks.KINDS, "toy", dataclasses.replace(TOY, in_process=False))
    with pytest.raises(ValueError, match="does not run inside a raybench worker .in-process stacks: hf, lightning"):
        runtime_stacks.run(SimpleNamespace(config=_toy_trial()))


@pytest.mark.parametrize("name", stacks.user_kinds())
def test_every_kinds_modules_exist_and_give_what_their_callers_use(name):
    kind = stacks.kind(name)
    module = planning_stacks.planning_module(name)  # checked against its protocol where it is imported
    assert module.__name__ == kind.planning
    assert protocol.planning_protocol(kind) is (protocol.StackChecks if kind.in_process else protocol.CommandLine)
    if kind.runtime is not None:  # imported on a rank (or in the stack's own environment): found, not imported here
        assert importlib.util.find_spec(kind.runtime) is not None
    # Both tables are keyed by raybench's train fields (command's own keys name the placeholders it may not use).
    assert {*kind.mapped, *kind.own_keys} <= set(TrainSpec.model_fields)


def test_the_keys_raybench_sets_are_the_tables_keys(model_dir):
    """Each planning module's values for a trial set exactly the keys its table refuses in the overrides."""
    config = TrialConfig(model={"path": str(model_dir)}, train={"strategy": "fsdp2", "finetune": "lora"},
                         stack={"kind": "torchtune", "recipe": "lora_finetune_distributed"})
    assert set(torchtune.mapped_values(config)) == {*torchtune.SET_KEYS, *torchtune.LORA_KEYS, *torchtune.MODEL_KEYS}
    config = TrialConfig(model={"preset": "tiny"}, train={"strategy": "fsdp2"}, stack={"kind": "torchtitan"})
    assert set(torchtitan.mapped_values(config)) == set(torchtitan.SET_KEYS)
    config = TrialConfig(model={"preset": "tiny"}, stack={"kind": "hf"})
    every_key = {key for keys in stacks.kind("hf").mapped.values() for key in keys} | {*hf_args.DATA_MAPPED.values()}
    values = hf_args.trial_args(config, every_key)
    assert set(values) - set(hf_args.HARNESS) - set(hf_args.QUIET) == every_key
