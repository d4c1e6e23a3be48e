"""What a stack kind's modules give their callers, typed, and checked where a kind's module is first used.

A kind names two modules (its `StackKind.planning` and `.runtime`): every user kind's planning module is a
`StackChecks` (the plan's checks and the fields it maps), a command-line kind's a `CommandLine` as well (its
executor runs `argv` and counts the adapters with `adapter_params`), and an in-process kind's runtime module an
`InProcessTrainer` (the rank builds the stack's run). `checked` refuses a module that lacks a function or takes
other parameters, naming the kind, the module and what is missing, before any of it runs: a new kind fails at its
first use (and in tests/unit/test_stack_registry.py), not mid-sweep.
"""

from __future__ import annotations

import inspect
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from raybench.spec.errors import Problem
    from raybench.spec.payload import TrialPayload
    from raybench.spec.presets import ModelShape
    from raybench.spec.stacks import StackKind
    from raybench.spec.sweep_spec import TrialConfig


class StackChecks(Protocol):
    """A user kind's planning module: its section's checks before launch, and the train fields it maps."""

    def problems(self, config: TrialConfig) -> list[Problem]: ...

    def mapped(self, config: TrialConfig) -> dict[str, tuple[str, ...]]: ...


class CommandLine(StackChecks, Protocol):
    """A command-line kind's planning module: also the trial's command, and its adapters' parameter count (None
    where the kind's config does not say; 0 for a full fine-tune)."""

    def argv(self, config: TrialConfig, python: str) -> list[str]: ...

    def adapter_params(self, config: TrialConfig, shape: ModelShape) -> int | None: ...


class InProcessTrainer(Protocol):
    """An in-process kind's runtime module: the stack's run on one rank, the probe hooked in."""

    def build(self, payload: TrialPayload, ctx: Any, probe: Any) -> Any: ...


def planning_protocol(kind: StackKind) -> type:
    return StackChecks if kind.in_process else CommandLine


def checked(module: ModuleType, protocol: type, kind: str) -> ModuleType:
    """The module, once it defines every function of `protocol` with the protocol's parameter names; TypeError
    naming the kind, the module and each function missing or taking other parameters otherwise."""
    wrong = []
    for name in _functions(protocol):
        wanted = list(inspect.signature(getattr(protocol, name)).parameters)[1:]  # without self
        found = getattr(module, name, None)
        if not callable(found):
            wrong.append(f"{name}({', '.join(wanted)}) is missing")
        elif list(inspect.signature(found).parameters) != wanted:
            wrong.append(f"{name} takes ({', '.join(inspect.signature(found).parameters)}), not ({', '.join(wanted)})")
    if wrong:
        raise TypeError(f"stack.kind {kind!r}: module {module.__name__} does not match {protocol.__name__}: "
                        f"{'; '.join(wrong)}")
    return module


def _functions(protocol: type) -> list[str]:
    """The protocol's functions, its bases' included."""
    return sorted({name for cls in protocol.__mro__ if cls not in (object, Protocol) and cls.__module__ == __name__
                   for name, member in vars(cls).items() if inspect.isfunction(member) and not name.startswith("_")})
