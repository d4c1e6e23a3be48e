"""Loading a sweep: YAML read safely, paths resolved against the sweep file, files checked, everything validated;
one ConfigError lists every problem found."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from raybench.spec.errors import ConfigError, Problem
from raybench.spec.sweep_spec import HF_ONLY_FIELDS, JSON_LAYOUT_FIELDS, DataSpec, SweepSpec
from raybench.spec.validate import data_layout_problems, problems_from_validation, sweep_problems


def _check_paths(spec: SweepSpec) -> list[Problem]:
    """Local model/data paths exist and model weights are safetensors unless pickle is explicitly allowed."""
    problems = []
    model, data = spec.model, spec.data
    if (model.preset is None) == (model.path is None):
        problems.append(Problem("model", model.model_dump(include={"preset", "path"}),
                                "set exactly one of model.preset or model.path"))
    if model.path is not None:
        # A command stack's command loads the model itself, in its own format; raybench reads only config.json
        # (the row's parameter count and FLOPs).
        problems += check_model_dir(model.path, model.allow_pickle, weights=spec.stack.kind != "command")
    python = spec.stack.python
    if python is not None and python.startswith(PLACEHOLDER):  # a stack's own environment (docs/stacks/)
        problems.append(Problem("stack.python", python, "a placeholder: set it to the Python interpreter of the "
                                "stack's own environment"))
    return problems + _check_data(data, model.path)


# Shipped sweeps mark the paths a user must set with this prefix (a user's local copy of a public dataset).
PLACEHOLDER = "/EDIT-ME/"
EXAMPLE_DATA = "example-data"  # the folder the shipped CPU sweeps read (`raybench example-data DIR` makes it)
HF_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


def _check_data(data: DataSpec, model_path: str | None) -> list[Problem]:
    """The data's files exist and the options fit the source (the content is checked by planning.tokenized)."""
    if data.source == "synthetic":
        if data.path is not None or data.tokenizer is not None:
            return [Problem("data.path", data.path, "only used with data.source json or hf; remove it")]
        problems = []
    else:
        problems = _check_data_files(data, model_path)
    if data.source != "hf":
        defaults = DataSpec.model_fields
        taken = JSON_LAYOUT_FIELDS if data.source == "json" else ()
        problems += [Problem(f"data.{name}", getattr(data, name), "only used with data.source=hf; remove it")
                     for name in HF_ONLY_FIELDS if getattr(data, name) != defaults[name].default and name not in taken]
        if data.source == "json" and data.overflow == "split":
            problems.append(Problem("data.overflow", data.overflow, "json data takes truncate or drop; for split "
                                    "use data.source hf (format alpaca reads the same records)"))
    else:
        problems += data_layout_problems(data)
        if data.loss_on == "assistant" and data.format == "text":
            problems.append(Problem("data.loss_on", data.loss_on, "plain text has no assistant turns; use format "
                                    "messages or alpaca, or loss_on: all"))
    return problems


def _holds_nothing(path: Path) -> bool:
    """A JSON/JSONL file of nothing but whitespace (read until its first other byte: a real file stops at once)."""
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 16), b""):
            if chunk.strip():
                return False
    return True


def _check_data_files(data: DataSpec, model_path: str | None) -> list[Problem]:
    problems = []
    path = Path(data.path) if data.path is not None else None
    if path is None:
        what = "a JSON/JSONL file" if data.source == "json" else "a data file, a dataset directory or a saved dataset"
        problems.append(Problem("data.path", None, f"data.source={data.source} needs {what}"))
    elif data.path.startswith(PLACEHOLDER):
        problems.append(Problem("data.path", data.path, "a placeholder: set it to the path of your local copy"))
    elif not path.exists() or (data.source == "json" and not path.is_file()):
        problems.append(Problem("data.path", data.path, _not_found(
            path, "file not found; point it at a JSON or JSON Lines file of records" if data.source == "json" else
            "no such file or directory; point it at a data file (.jsonl, .json, .parquet, .arrow) or a dataset "
            "directory")))
    elif path.is_file() and data.source == "hf" and not path.name.endswith(HF_FILE_SUFFIXES):
        problems.append(Problem("data.path", data.path, f"unknown data file type; use one of "
                                f"{', '.join(HF_FILE_SUFFIXES)}, or a directory"))
    elif path.is_file() and path.suffix in (".json", ".jsonl") and _holds_nothing(path):
        problems.append(Problem("data.path", data.path, f"holds no records: the file {path} is empty; point "
                                "data.path at a file of records"))
    tokenizer = data.tokenizer or model_path
    if tokenizer is None:
        problems.append(Problem("data.tokenizer", None, "text data needs a local tokenizer directory "
                                "(data.tokenizer, or a model.path that contains one)"))
    elif tokenizer.startswith(PLACEHOLDER):
        problems.append(Problem("data.tokenizer", tokenizer, "a placeholder: set it to your local tokenizer "
                                "(or model) directory"))
    elif not Path(tokenizer).is_dir():
        problems.append(Problem("data.tokenizer", tokenizer, _not_found(
            Path(tokenizer), "directory not found; point it at a local tokenizer directory (or a model directory "
            "holding one)")))
    return problems


def _not_found(path: Path, message: str) -> str:
    """A missing path's message; for one in a folder named example-data (the shipped sweeps' paths), the command
    that makes that folder's contents."""
    if path.parent.name == EXAMPLE_DATA:
        return f"{message}, or make the shipped example data first: raybench example-data {path.parent}"
    return message


def check_model_dir(path: str, allow_pickle: bool, weights: bool = True) -> list[Problem]:
    """A model directory's config.json and, where raybench loads them (`weights`), safetensors weights."""
    root = Path(path)
    if path.startswith(PLACEHOLDER):
        return [Problem("model.path", path, "a placeholder: set it to your local model directory")]
    if not root.is_dir():
        return [Problem("model.path", path, _not_found(root, "directory not found; point it at a local Hugging Face "
                                                       "model directory (config.json and safetensors weights)"))]
    if not (root / "config.json").is_file():
        return [Problem("model.path", path, "no config.json; point at a Hugging Face model directory")]
    if not weights or any(root.glob("*.safetensors")):
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
    _resolve_command_paths(raw.get("stack"), base_dir)


def _resolve_command_paths(stack, base_dir: Path) -> None:
    """A user's stack's paths relative to the sweep file: its files and directories, its interpreter (not
    resolved: a venv's python is a symlink that must stay one), and {sweep_dir} in a command and in the stack's
    own keys (stack.overrides' text values), since the stack runs in a scratch directory of its own."""
    if not isinstance(stack, dict):
        return
    # hf, lightning: the config file and the entry's import directories, relative to the sweep file.
    if isinstance(stack.get("config"), str):
        stack["config"] = str((base_dir / Path(stack["config"]).expanduser()).resolve())
    if isinstance(stack.get("pythonpath"), list):
        stack["pythonpath"] = [str((base_dir / Path(p).expanduser()).resolve()) if isinstance(p, str) else p
                               for p in stack["pythonpath"]]
    if isinstance(stack.get("python"), str):
        stack["python"] = os.path.abspath(base_dir / Path(stack["python"]).expanduser())
    if isinstance(stack.get("command"), list):
        here = str(base_dir.resolve()).replace("{", "{{").replace("}", "}}")  # the command is a template
        stack["command"] = [item.replace("{sweep_dir}", here) if isinstance(item, str) else item
                            for item in stack["command"]]
    if isinstance(stack.get("overrides"), dict):  # the stack's own keys: a path among them (torchtune's data)
        here = str(base_dir.resolve())
        stack["overrides"] = {key: value.replace("{sweep_dir}", here) if isinstance(value, str) else value
                              for key, value in stack["overrides"].items()}


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
