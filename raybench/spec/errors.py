"""The error every bad input raises: each problem with its field, the value given and the fix (exit code 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a sweep: where, what was given, and how to fix it."""

    field: str
    value: Any
    message: str

    def __str__(self) -> str:
        return f"{self.field} = {self.value!r}: {self.message}"


class ConfigError(Exception):
    """Every problem found in a sweep, reported together."""

    def __init__(self, source: str, problems: list[Problem], rest: Any = None):
        self.source = source
        self.problems = problems
        # The sweep without the parts these problems name (a SweepSpec), for the checks that need a parsed sweep
        # to go on (the plan's rules), so that one pass reports every problem; None where nothing parsed.
        self.rest = rest
        super().__init__(self.report())

    def report(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} problem(s); nothing was launched or written"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)
