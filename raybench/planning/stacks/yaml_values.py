"""Whether a value read from YAML fits a stack's declared type (a dataclass field, a function parameter), and the
Problem that says why not; shared by the stacks whose schemas are Python annotations (hf, lightning)."""

from __future__ import annotations

import collections.abc
import datetime
import enum
import inspect
import os
import pathlib
import re
import types
import typing

from raybench.spec.errors import Problem

_FLOAT_AS_TEXT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")


def type_problem(field: str, value, annotation) -> Problem | None:
    """A Problem when the value cannot be of the annotation's type, naming the type (and, for 1e-5 that YAML read
    as text, how to write it)."""
    if fits(annotation, value) is not False:
        return None
    hint = ""
    if isinstance(value, str) and fits(annotation, 1.5) and _FLOAT_AS_TEXT.fullmatch(value):
        hint = f"; YAML reads {value} as text: write it with a decimal point, e.g. 1.0e-5"
    return Problem(field, value, f"expected {readable(annotation)}, got {type(value).__name__}{hint}")


def fits(annotation, value) -> bool | None:
    """Whether a YAML value fits the annotation; None where the annotation says nothing checkable."""
    if annotation in (inspect.Parameter.empty, typing.Any):
        return None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        verdicts = [fits(arm, value) for arm in typing.get_args(annotation)]
        return True if True in verdicts else (None if None in verdicts else False)
    if origin is typing.Literal:
        return any(type(value) is type(arg) and value == arg for arg in typing.get_args(annotation))
    if origin is not None:
        annotation = origin  # list[int] -> list: items are left to the stack
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation in (pathlib.Path, os.PathLike):
        return isinstance(value, str)
    if annotation in (collections.abc.Iterable, collections.abc.Sequence, list, tuple):
        return isinstance(value, list)
    if annotation in (dict, collections.abc.Mapping):
        return isinstance(value, dict)
    if annotation is datetime.timedelta:
        return False  # YAML gives no timedelta
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return isinstance(value, (str, annotation))  # its member names are checked by constructing the schema
    if isinstance(annotation, type):
        return isinstance(value, annotation)  # a class YAML cannot build (Accelerator, Profiler) refuses its value
    return None


def readable(annotation) -> str:
    """An annotation without module paths: Union[str, Accelerator], not lightning.pytorch.accelerators...."""
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return re.sub(r"\b(?:[A-Za-z_][\w]*\.)+([A-Za-z_]\w*)", r"\1", text)
