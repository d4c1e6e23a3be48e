"""The base of every sweep spec section: frozen, unknown keys refused, and no boolean read as a number."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _numeric(annotation) -> bool:
    """int or float, possibly optional (`float | None`)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    return annotation in (int, float) or any(a in (int, float) for a in args)


class Section(BaseModel):
    """A section of the sweep spec (and of a trial's config): frozen, extra keys forbidden."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads `workers: true` as 1: a YAML slip that must not pass as a number.
        if isinstance(value, bool) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not the boolean {str(value).lower()}")
        return value
