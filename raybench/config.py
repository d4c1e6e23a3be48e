"""Typed, frozen sweep and trial configs.

A sweep YAML has fixed sections (model, data, train, resources) that together form one trial's config, plus
`axes`: a grid over any trial field by dotted path (``train.strategy: [ddp, fsdp2]``). `load_sweep` checks
everything it can without starting anything and raises one `ConfigError` listing every problem, each with its
field path, the bad value and the fix. Cross-field rules that need the expanded grid live in `plan.py`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from raybench.presets import PRESETS

TRIAL_SECTIONS = ("model", "data", "train", "resources")


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

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        super().__init__(self.report())

    def report(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} problem(s); nothing was launched or written"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


_FRACTION = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")
_DECIMAL = re.compile(r"^\s*\d+(\.\d+)?\s*$")


def parse_ratio(value: Any) -> Fraction:
    """Parse an AC ratio given as a number, "0.25" or "3/4" into an exact Fraction in [0, 1]. Never evaluates."""
    if isinstance(value, bool):
        raise ValueError("expected a number in [0, 1] or a fraction like '3/4', not a boolean")
    if isinstance(value, (int, float)):
        ratio = Fraction(str(value))
    elif isinstance(value, str) and (m := _FRACTION.match(value)):
        if int(m.group(2)) == 0:
            raise ValueError("fraction has a zero denominator; write a ratio in [0, 1] such as '3/4'")
        ratio = Fraction(int(m.group(1)), int(m.group(2)))
    elif isinstance(value, str) and _DECIMAL.match(value):
        ratio = Fraction(value.strip())
    else:
        raise ValueError("expected a number in [0, 1] or a fraction like '3/4' (expressions are not evaluated)")
    if not 0 <= ratio <= 1:
        raise ValueError(f"ratio {ratio} is outside [0, 1]; 0 checkpoints no block, 1 every block")
    return ratio


def _canonical_ratio(value: Any) -> str:
    # One spelling per ratio ("0.5" and "1/2" both become "1/2") so equal configs hash to the same trial id.
    return str(parse_ratio(value))


Ratio = Annotated[str, BeforeValidator(_canonical_ratio)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ModelSpec(_Spec):
    preset: Literal[tuple(PRESETS)] | None = Field(None, description="Built-in architecture, random weights.")
    path: str | None = Field(None, description="Local Hugging Face model directory (safetensors weights).")
    allow_pickle: bool = Field(False, description="Allow pickle (.bin/.pt) weights; unsafe, off by default.")
    trust_remote_code: bool = Field(False, description="Run a model directory's own Python code.")
    attn_implementation: Literal["eager", "sdpa"] = Field("sdpa", description="transformers attention kernel.")


class DataSpec(_Spec):
    source: Literal["synthetic", "json"] = Field("synthetic", description="Random tokens, or alpaca-style JSON/JSONL.")
    path: str | None = Field(None, description="JSON or JSONL file with instruction/input/output records.")
    tokenizer: str | None = Field(None, description="Local tokenizer directory; defaults to model.path.")
    packing: bool = Field(True, description="Concatenate examples into full sequences instead of padding each.")
    num_workers: int = Field(0, ge=0, le=64, description="torch DataLoader worker processes per rank.")
    pin_memory: bool = Field(False, description="Pin host memory of batches (GPU only).")


class LoraSpec(_Spec):
    rank: int = Field(16, ge=1, le=4096, description="LoRA rank r.")
    alpha: float = Field(32, gt=0, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    targets: Literal["attention", "attention_mlp", "all_linear"] = Field(
        "attention_mlp", description="Which linear layers get adapters."
    )


class TrainSpec(_Spec):
    strategy: Literal["ddp", "fsdp2"] = Field("ddp", description="How ranks share the model.")
    steps: int = Field(20, ge=1, le=1_000_000, description="Optimizer steps per trial, warm-up included.")
    warmup_steps: int = Field(3, ge=0, description="Leading steps excluded from every timing.")
    seq_len: int = Field(512, ge=8, le=1_048_576, description="Tokens per sequence.")
    micro_batch: int = Field(1, ge=1, le=4096, description="Sequences per rank per forward pass.")
    grad_accum: int = Field(1, ge=1, le=4096, description="Micro-batches per optimizer step.")
    precision: Literal["fp32", "bf16"] = Field("bf16", description="Compute dtype (bf16: autocast / FSDP2 policy).")
    finetune: Literal["full", "lora"] = Field("full", description="Train every weight, or LoRA adapters only.")
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings (used when finetune=lora).")
    ac_ratio: Ratio = Field("0", description="Fraction of decoder blocks activation-checkpointed, e.g. '1/2'.")
    compile: bool = Field(False, description="torch.compile each decoder block.")
    optimizer: Literal["adamw"] = Field("adamw", description="Optimizer.")
    lr: float = Field(1e-5, gt=0, le=1, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="Decoupled weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; null disables clipping.")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered weights after forward.")
    seed: int = Field(0, ge=0, description="Seed for weights and synthetic data.")


class ResourcesSpec(_Spec):
    workers: int = Field(1, ge=1, le=65536, description="Ranks per trial (one per GPU on GPU clusters).")
    cpus_per_worker: float = Field(1, gt=0, le=1024, description="CPUs reserved per rank.")
    gpus_per_worker: int = Field(0, ge=0, le=1, description="GPUs per rank: 1 on GPU clusters, 0 for CPU runs.")


class TrialConfig(_Spec):
    """Everything that determines one trial's measurement; its hash is the trial id."""

    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)


class SweepSpec(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", description="Sweep name (store partition).")
    description: str = Field("", description="Free text shown in reports.")
    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    axes: dict[str, list[Any]] = Field(default_factory=dict, description="Grid: dotted trial field -> values.")
    exclude: list[dict[str, Any]] = Field(default_factory=list, description="Grid points to drop (partial match).")
    executor: Literal["train"] = Field("train", description="How a trial's ranks are started.")
    store: str = Field("./raybench-results", description="Result store directory (relative to the cwd).")
    repeats: int = Field(1, ge=1, le=100, description="Measurements per configuration.")

    def base_trial(self) -> dict:
        """The trial fields before any axis is applied, as plain data."""
        return self.model_dump(mode="json", include=set(TRIAL_SECTIONS))


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the model reached by following loc (for 'did you mean' hints)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            break
        model = ann
    return list(model.model_fields)


def problems_from_validation(err: ValidationError, model: type[BaseModel], prefix: str = "") -> list[Problem]:
    """Turn pydantic errors into Problems with dotted paths, the bad value and a fix."""
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        path = prefix + ".".join(str(p) for p in loc)
        if e["type"] == "extra_forbidden":
            known = _known_keys(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(known)}"
            problems.append(Problem(path, e["input"], f"unknown key; {hint}"))
        elif e["type"] == "missing":
            problems.append(Problem(path, None, "required; add this key"))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            problems.append(Problem(path, e.get("input"), msg))
    return problems


def _section_path_ok(key: str) -> str | None:
    """Why an axis key is not a trial field path, or None if it is."""
    parts = key.split(".")
    if parts[0] not in TRIAL_SECTIONS or len(parts) < 2:
        return f"axis keys are dotted trial fields such as 'train.strategy'; sections: {', '.join(TRIAL_SECTIONS)}"
    model: type[BaseModel] = TrialConfig
    for i, part in enumerate(parts):
        if part not in model.model_fields:
            close = difflib.get_close_matches(part, list(model.model_fields), n=1)
            hint = f"did you mean '{'.'.join(parts[:i] + [close[0]])}'?" if close else ""
            return f"no such trial field '{'.'.join(parts[: i + 1])}' {hint}".rstrip()
        ann = model.model_fields[part].annotation
        if i < len(parts) - 1:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                return f"'{'.'.join(parts[: i + 1])}' has no sub-fields"
            model = ann
    return None


def set_path(trial: dict, dotted: str, value: Any) -> None:
    """Set trial['a']['b'] = value for dotted 'a.b', copying nothing (callers pass their own copy)."""
    *parents, leaf = dotted.split(".")
    node = trial
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _check_axes(spec: SweepSpec) -> list[Problem]:
    """Each axis names a real field and each of its values is valid on its own."""
    problems = []
    base = spec.base_trial()
    for key, values in spec.axes.items():
        where = f"axes.{key}"
        if (why := _section_path_ok(key)) is not None:
            problems.append(Problem(where, values, why))
            continue
        if not values:
            problems.append(Problem(where, values, "an axis needs at least one value"))
            continue
        if len({repr(v) for v in values}) != len(values):
            problems.append(Problem(where, values, "repeated values; list each value once (use repeats: for more)"))
        for i, value in enumerate(values):
            trial = _copy_sections(base)
            set_path(trial, key, value)
            try:
                TrialConfig.model_validate(trial)
            except ValidationError as err:
                for p in problems_from_validation(err, TrialConfig):
                    if p.field == key or p.field.startswith(key + "."):
                        problems.append(Problem(f"{where}[{i}]{p.field[len(key):]}", value, p.message))
    for i, rule in enumerate(spec.exclude):
        for key in rule:
            if key not in spec.axes:
                problems.append(Problem(f"exclude[{i}].{key}", rule[key], "exclude keys must be axis keys"))
    return problems


def _copy_sections(base: dict) -> dict:
    # Two levels deep is enough: axes only replace leaves, and lists/dicts given as axis values are never mutated.
    return {k: {kk: (dict(vv) if isinstance(vv, dict) else vv) for kk, vv in v.items()} for k, v in base.items()}


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
    for section, key in (("model", "path"), ("data", "path"), ("data", "tokenizer")):
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
    problems = _check_axes(spec) + _check_paths(spec)
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
    except yaml.YAMLError as err:
        raise ConfigError(str(path), [Problem("<yaml>", None, f"not valid YAML: {err}")]) from None
    return parse_sweep(raw, str(path), path.parent)
