"""Loading a sweep: YAML read safely, paths resolved against the sweep file, files checked, everything validated;
one ConfigError lists every problem found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from raybench.spec.errors import ConfigError, Problem
from raybench.spec.sweep_spec import SweepSpec
from raybench.spec.validate import problems_from_validation, sweep_problems


def _check_paths(spec: SweepSpec) -> list[Problem]:
    """Local model/data paths exist and model weights are safetensors unless pickle is explicitly allowed."""
    problems = []
    model, data = spec.model, spec.data
    if (model.preset is None) == (model.path is None):
        problems.append(Problem("model", model.model_dump(include={"preset", "path"}),
                                "set exactly one of model.preset or model.path"))
    if model.path is not None:
        problems += check_model_dir(model.path, model.allow_pickle)
    if data.source == "json":
        if data.path is None:
            problems.append(Problem("data.path", None, "data.source=json needs a JSON/JSONL file path"))
        elif not Path(data.path).is_file():
            problems.append(Problem("data.path", data.path, "file not found"))
        tokenizer = data.tokenizer or model.path
        if tokenizer is None:
            problems.append(Problem("data.tokenizer", None, "text data needs a local tokenizer directory "
                                    "(data.tokenizer, or a model.path that contains one)"))
        elif not Path(tokenizer).is_dir():
            problems.append(Problem("data.tokenizer", tokenizer, "directory not found"))
    elif data.path is not None or data.tokenizer is not None:
        problems.append(Problem("data.path", data.path, "only used with data.source=json; remove it"))
    return problems


def check_model_dir(path: str, allow_pickle: bool) -> list[Problem]:
    root = Path(path)
    if not root.is_dir():
        return [Problem("model.path", path, "directory not found")]
    if not (root / "config.json").is_file():
        return [Problem("model.path", path, "no config.json; point at a Hugging Face model directory")]
    if any(root.glob("*.safetensors")):
        return []
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickles and not allow_pickle:
        return [Problem("model.path", path, f"only pickle weights ({', '.join(pickles)}); convert them to "
                        "safetensors, or set model.allow_pickle: true if you trust the file")]
    if not pickles:
        return [Problem("model.path", path, "no *.safetensors weights found")]
    return []


def _resolve_paths(raw: dict, base_dir: Path) -> None:
    """Make model/data paths absolute, relative to the sweep file, so workers anywhere find them."""
    for section, key in (("model", "path"), ("data", "path"), ("data", "tokenizer"), ("caches", "compile_dir")):
        node = raw.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = str((base_dir / Path(node[key]).expanduser()).resolve())


def parse_sweep(raw: Any, source: str = "<sweep>", base_dir: Path | None = None) -> SweepSpec:
    """Validate plain data as a sweep; raise ConfigError with every problem found."""
    if not isinstance(raw, dict):
        raise ConfigError(source, [Problem("<top>", type(raw).__name__, "a sweep is a YAML mapping of keys")])
    _resolve_paths(raw, base_dir or Path.cwd())
    try:
        spec = SweepSpec.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(source, problems_from_validation(err, SweepSpec)) from None
    problems = sweep_problems(spec) + _check_paths(spec)
    if problems:
        raise ConfigError(source, problems)
    return spec


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and validate a sweep YAML file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(str(path), [Problem("<file>", str(path), f"cannot read: {err.strerror}")]) from None
    except UnicodeDecodeError as err:
        raise ConfigError(str(path), [Problem("<file>", str(path), f"not UTF-8 text ({err.reason} at byte "
                                              f"{err.start}); a sweep is a YAML text file")]) from None
    except yaml.YAMLError as err:
        raise ConfigError(str(path), [Problem("<yaml>", None, f"not valid YAML: {err}")]) from None
    except (ValueError, OverflowError, RecursionError) as err:
        # PyYAML's own constructors raise these for well-formed but impossible scalars (a date 2001-13-45)
        # and for absurd nesting; they are bad input like any other.
        raise ConfigError(str(path), [Problem("<yaml>", None, f"not valid YAML: {type(err).__name__}: {err}; "
                                              "quote the value if it is meant as text")]) from None
    return parse_sweep(raw, str(path), path.parent)
