"""Loading a sweep: YAML read safely, paths resolved against the sweep file, files checked, everything validated;
one ConfigError lists every problem found."""

from __future__ import annotations

import copy
import itertools
import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from raybench.spec import stacks
from raybench.spec.axes import axis_assignments, copy_trial, excluded, set_path
from raybench.spec.errors import ConfigError, Problem
from raybench.spec.sweep_spec import HF_ONLY_FIELDS, JSON_LAYOUT_FIELDS, DataSpec, ModelSpec, SweepSpec
from raybench.spec.validate import data_layout_problems, problems_from_validation, sweep_problems


def _check_paths(spec: SweepSpec) -> list[Problem]:
    """Every model and data section a trial gets (the base's, or as axes set them): one model, local paths that
    exist, safetensors weights unless pickle is explicitly allowed, data options that fit the source."""
    problems = []
    for model, data, kind in _model_and_data_sections(spec):
        problems += [p for p in _check_model_and_data(model, data, kind) if p not in problems]
    python = spec.stack.python
    if python is not None and python.startswith(PLACEHOLDER):  # a stack's own environment (docs/stacks/)
        problems.append(Problem("stack.python", python, "a placeholder: set it to the Python interpreter of the "
                                "stack's own environment"))
    return problems


def _check_model_and_data(model: ModelSpec, data: DataSpec, stack_kind: str) -> list[Problem]:
    problems = []
    if (model.preset is None) == (model.path is None):
        problems.append(Problem("model", model.model_dump(include={"preset", "path"}),
                                "set exactly one of model.preset or model.path (in the model section or by an "
                                "axis)"))
    if model.path is not None:
        # A command stack's command loads the model itself, in its own format; raybench reads only config.json
        # (the row's parameter count and FLOPs).
        problems += check_model_dir(model.path, model.allow_pickle, weights=stacks.kind(stack_kind).needs_weights)
    return problems + _check_data(data, model.path)


# What picks a trial's model and data files: an axis over one of these makes trials whose model and data sections
# are checked here as the sweep's own. (Layout options an axis varies are rules per trial: plan.trial_problems.)
PICKS_FILES = ("model.preset", "model.path", "model.allow_pickle", "data.source", "data.path", "data.tokenizer",
               "stack.kind")


def _model_and_data_sections(spec: SweepSpec) -> list[tuple[ModelSpec, DataSpec, str]]:
    """The distinct (model, data, stack kind) the sweep's trials get: the base's with each combination of the
    values of the axes that pick files (excluded points left out)."""
    axes = {key: values for key, values in spec.axes.items()
            if any(path in PICKS_FILES for value in values for path in _assigned(key, value))}
    # The sections' fields as set (a dump leaves out what the source does not use, and that is checked here).
    base, found = {"model": dict(spec.model), "data": dict(spec.data), "stack": {"kind": spec.stack.kind}}, {}
    for combination in itertools.product(*axes.values()):
        point = dict(zip(axes, combination))
        if excluded(point, spec.exclude):
            continue
        trial = copy_trial(base)
        for key, value in point.items():
            for path, leaf in _assigned(key, value).items():
                if path in PICKS_FILES:
                    set_path(trial, path, leaf)
        sections = (trial["model"], trial["data"], trial["stack"]["kind"])
        try:  # an axis value that is bad on its own is reported by its axis (validate._check_axes)
            found.setdefault(json.dumps(sections, sort_keys=True, default=str),
                             (ModelSpec.model_validate(sections[0]), DataSpec.model_validate(sections[1]), sections[2]))
        except ValidationError:
            continue
    return list(found.values())


def _assigned(key: str, value: Any) -> dict[str, Any]:
    """What an axis value sets; nothing for a bundle's value that is not a mapping (its axis reports it)."""
    return axis_assignments(key, value) if "." in key or isinstance(value, dict) else {}


# Shipped sweeps mark the paths a user must set with this prefix (a user's local copy of a public dataset).
PLACEHOLDER = "/EDIT-ME/"
EXAMPLE_DATA = "example-data"  # the folder the shipped CPU sweeps read (`raybench example-data DIR` makes it)
HF_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


def _check_data(data: DataSpec, model_path: str | None) -> list[Problem]:
    """The data's files exist and the options fit the source (the content is checked by data.tokenized)."""
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


# Trial fields that hold a local path: made absolute against the sweep file, set in their section or by an axis.
TRIAL_PATHS = ("model.path", "data.path", "data.tokenizer")


def _resolve_paths(raw: dict, base_dir: Path) -> None:
    """Make model/data paths absolute, relative to the sweep file, so workers anywhere find them."""
    for dotted in (*TRIAL_PATHS, "caches.compile_dir"):
        section, key = dotted.split(".")
        node = raw.get(section)
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = _absolute(node[key], base_dir)
    _resolve_axis_paths(raw, base_dir)
    _resolve_command_paths(raw.get("stack"), base_dir)


def _absolute(path: str, base_dir: Path) -> str:
    return str((base_dir / Path(path).expanduser()).resolve())


def _resolve_axis_paths(raw: dict, base_dir: Path) -> None:
    """The paths an axis sets (`axes: {model.path: [...]}`, or a bundle's mappings) as the section's are, and so
    the exclude rules' that name them."""
    axes, rules = raw.get("axes"), raw.get("exclude")
    if isinstance(axes, dict):
        for key, values in axes.items():
            if isinstance(values, list):
                axes[key] = [_resolve_axis_value(key, value, base_dir) for value in values]
    for rule in rules if isinstance(rules, list) else []:
        if isinstance(rule, dict):
            for key, value in rule.items():
                rule[key] = _resolve_axis_value(key, value, base_dir)


def _resolve_axis_value(key, value, base_dir: Path):
    if key in TRIAL_PATHS and isinstance(value, str):
        return _absolute(value, base_dir)
    if isinstance(key, str) and "." not in key and isinstance(value, dict):  # a bundle: a mapping of fields
        return {f: _absolute(v, base_dir) if f in TRIAL_PATHS and isinstance(v, str) else v for f, v in value.items()}
    return value


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
    problems, spec = [], None
    for _ in range(MAX_REPAIRS):  # each round leaves out the keys pydantic refused, to find the others' problems
        try:
            spec = SweepSpec.model_validate(raw)
            break
        except ValidationError as err:
            problems += problems_from_validation(err, SweepSpec)
            raw = _without(raw, [tuple(e["loc"]) for e in err.errors()])
    if spec is None:
        raise ConfigError(source, problems)
    found = sweep_problems(spec) + _check_paths(spec)
    problems += found
    if problems:
        raise ConfigError(source, problems, rest=_without_axes(spec, found))
    return spec


MAX_REPAIRS = 3


def _without(raw: dict, locs: list[tuple]) -> dict:
    """A copy of `raw` without the key at each loc: the deepest mapping key along it (a list, or a union's branch
    pydantic names in the loc, is left out whole); the field then takes its default."""
    raw = copy.deepcopy(raw)
    for loc in locs:
        node, key = raw, None
        for part in loc:
            if not (isinstance(node, dict) and part in node):
                break
            parent, key, node = node, part, node[part]
        if key is not None:
            del parent[key]
    return raw


def _without_axes(spec: SweepSpec, problems: list[Problem]) -> SweepSpec:
    """The sweep without the axes, exclude rules and search a problem names: what the plan's rules can still
    check."""
    bad = {p.field.removeprefix("axes.").split("[")[0] for p in problems if p.field.startswith("axes.")}
    axes = {k: v for k, v in spec.axes.items() if k not in bad}
    return spec.model_copy(update={"axes": axes, "exclude": [] if any(p.field.startswith("exclude") for p in problems)
                                   else spec.exclude})


class RepeatedKey(Exception):
    def __init__(self, key: Any, first_line: int, again_line: int):
        super().__init__(key, first_line, again_line)
        self.key, self.first_line, self.again_line = key, first_line, again_line


class _SweepLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a mapping may not give a key twice: YAML keeps the last one and drops
    the first without a word (a second `axes:` would silently replace the first grid)."""

    def construct_mapping(self, node, deep=False):
        lines = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, (str, int, float, bool)) and key in lines:
                raise RepeatedKey(key, lines[key], line)
            lines[key] = line
        return super().construct_mapping(node, deep)


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and validate a sweep YAML file."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_SweepLoader)  # safe_load's loader, plus RepeatedKey
    except RepeatedKey as err:
        raise ConfigError(str(path), [Problem(str(err.key), f"lines {err.first_line} and {err.again_line}", (
            "given twice in one mapping; YAML would keep only the second and drop the first without a word: "
            "merge them into one"))]) from None
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
