"""Writes raybench/planning/stacks/torchtitan_schema.py: torchtitan's job config keys and their types, as its
command line takes them (`--section.key value`), for checking a torchtitan stack's overrides before launch without
torchtitan in raybench's environment (docs/stacks/torchtitan.md). Run in torchtitan's own environment:

    DIR/bin/python scripts/torchtitan_schema.py > raybench/planning/stacks/torchtitan_schema.py

The keys are those of every job config that torchtitan's model registries build (their config functions): the
Trainer.Config fields, each nested config under the class the registries actually use (torchtitan's command line
parses a nested section by its default's class, so a HuggingFaceTextDataLoader's `dataset` is a key). Functions that
need packages this environment lacks (torchao, transformers, torchvision) are skipped, and said so.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import json
import sys
import types
import typing


def type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return type_name(typing.get_args(tp)[0])
    if origin is typing.Literal:
        return "literal[" + ",".join(json.dumps(a) for a in typing.get_args(tp)) + "]"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        args = [type_name(a) for a in typing.get_args(tp) if a is not Ellipsis]
        return f"{origin.__name__}[{', '.join(args)}]" if args else origin.__name__
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def walk(config, prefix: str, keys: dict[str, set[str]]) -> None:
    hints = typing.get_type_hints(type(config), include_extras=True)
    for field in dataclasses.fields(config):
        annotation = hints.get(field.name, field.type)
        if "Suppress" in repr(annotation) or field.name.startswith("_"):  # not on the command line
            continue
        value = getattr(config, field.name, None)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            walk(value, f"{key}.", keys)
        else:
            keys.setdefault(key, set()).add(type_name(annotation))


def registry_configs():
    from torchtitan.models import _supported_models

    for model in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except Exception as err:  # a model whose packages are missing here
            print(f"skipped torchtitan.models.{model}: {err}", file=sys.stderr)
            continue
        for name, function in inspect.getmembers(registry, inspect.isfunction):
            if function.__module__ != registry.__name__ or inspect.signature(function).parameters:
                continue
            try:
                yield function()
            except Exception as err:
                print(f"skipped {model}.{name}: {err}", file=sys.stderr)


def main() -> None:
    keys: dict[str, set[str]] = {}
    for config in registry_configs():
        walk(config, "", keys)
    version = importlib.metadata.version("torchtitan")
    print(f'"""torchtitan {version}\'s job config keys -> their types (several: the classes the registries use '
          'differ), written by\nscripts/torchtitan_schema.py in torchtitan\'s environment; do not edit."""\n')
    print(f"TORCHTITAN_VERSION = {version!r}")
    print("KEYS: dict[str, tuple[str, ...]] = {")
    for key, names in sorted(keys.items()):
        print(f"    {key!r}: {tuple(sorted(names))!r},")
    print("}")


if __name__ == "__main__":
    main()
