"""Render the sweep-file reference (docs/sweep-reference.md) from the config models themselves."""

from __future__ import annotations

import typing

from pydantic import BaseModel

from raybench.spec.sweep_spec import SweepSpec


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return "ratio (`0.5` or `\"1/2\"`)"
    args = typing.get_args(annotation)
    if args:
        inner = [a for a in args if a is not type(None)]
        suffix = " or null" if type(None) in args else ""
        if origin in (list, dict):
            return str(annotation).replace("typing.", "")
        return " \\| ".join(_type_name(a) for a in inner) + suffix
    return getattr(annotation, "__name__", str(annotation))


def _rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += _rows(ann, f"{prefix}{name}.")
            continue
        default = "required" if field.is_required() else f"`{field.get_default(call_default_factory=True)!r}`"
        symbols = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "pattern": "matches"}
        bounds = ", ".join(f"{sym} `{getattr(m, attr)}`" for m in field.metadata for attr, sym in symbols.items()
                           if getattr(m, attr, None) is not None)
        rows.append(f"| `{prefix}{name}` | {_type_name(ann)} | {default} | {bounds} | {field.description or ''} |")
    return rows


def render() -> str:
    lines = [
        "# Sweep file reference",
        "",
        "Generated from `raybench/spec/sweep_spec.py` and `sweep_settings.py` (`python -m raybench.spec.reference > "
        "docs/sweep-reference.md`).",
        "Unknown keys are errors. Any field under model, data, train or resources can be an axis:",
        "`axes: {train.micro_batch: [1, 2, 4]}`. Paths (model.path, data.path, data.tokenizer), in their section or on",
        "an axis, are relative to the sweep file; the model is a preset or a path, set in the model section or by an",
        "axis (`axes: {model.path: [models/a, models/b]}`).",
        "",
        "| field | type | default | bounds | meaning |",
        "| --- | --- | --- | --- | --- |",
        *_rows(SweepSpec),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
