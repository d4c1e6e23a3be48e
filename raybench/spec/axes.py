"""What an axis value means for a trial: the fields it sets, on plain data (before any validation).

An axis key with a dot sets that one field (`train.micro_batch: 4`); a key without a dot is a bundle whose
values each set several fields together. `exclude:` rules drop grid points by partial match.
"""

from __future__ import annotations

from typing import Any


def axis_assignments(key: str, value: Any) -> dict[str, Any]:
    """The trial fields one axis value sets: {key: value}, or for a bundle axis its mapping of fields."""
    return {key: value} if "." in key else dict(value)


# Trial fields that are free mappings: a key under one is the stack's own and may hold dots itself
# (`stack.overrides.dataset.packed` sets torchtune's `dataset.packed`).
FREE_MAPPINGS = ("stack.overrides",)


def split_path(dotted: str) -> list[str]:
    """The field names of a dotted axis key; a key under a free mapping stays whole."""
    for mapping in FREE_MAPPINGS:
        if dotted.startswith(mapping + ".") and len(dotted) > len(mapping) + 1:
            return [*mapping.split("."), dotted[len(mapping) + 1:]]
    return dotted.split(".")


def set_path(trial: dict, dotted: str, value: Any) -> None:
    """Set trial['a']['b'] = value for dotted 'a.b', copying nothing (callers pass their own copy)."""
    *parents, leaf = split_path(dotted)
    node = trial
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def copy_trial(base: dict) -> dict:
    """A copy of a trial's plain data that axis values may be set on."""
    # Two levels deep is enough: axes only replace leaves, and lists/dicts given as axis values are never mutated.
    return {k: {kk: (dict(vv) if isinstance(vv, dict) else vv) for kk, vv in v.items()} for k, v in base.items()}


def excluded(values: dict[str, Any], rules: list[dict[str, Any]]) -> bool:
    """Whether a grid point (axis key -> value) matches one of the sweep's `exclude:` rules."""
    return any(all(values.get(k) == v for k, v in rule.items()) for rule in rules)
