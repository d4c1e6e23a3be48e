"""A toy stack kind's planning module (test_stack_registry.py registers the kind): what planning/stacks/KIND.py of
a new kind gives."""

from __future__ import annotations

from raybench.spec.errors import Problem
from raybench.spec.stacks import kind
from raybench.spec.sweep_spec import TrialConfig


def mapped(config: TrialConfig) -> dict[str, tuple[str, ...]]:
    """The train fields this trial takes: the registry's table."""
    return kind("toy").mapped


def problems(config: TrialConfig) -> list[Problem]:
    """The toy's own check: every override must be `speed`."""
    return [Problem(f"stack.overrides.{key}", value, "the toy stack takes speed only")
            for key, value in config.stack.overrides.items() if key != "speed"]
