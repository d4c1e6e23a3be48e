"""A parsed sweep's checks that look across fields: axes name real fields and hold valid values, the search names
stored metrics, the estimate names a known GPU. Pydantic's own errors become Problems here too."""

from __future__ import annotations

import difflib
import json
import re
import typing
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from raybench.spec.axes import axis_assignments, copy_trial, set_path, split_path
from raybench.spec.errors import Problem
from raybench.spec.hardware import gpu_labels, gpu_memory_gib, known_gpu
from raybench.spec.schema import GPU_ONLY_METRICS, numeric_metric_names
from raybench.spec.sweep_settings import EstimateSpec
from raybench.spec.sweep_spec import TRIAL_SECTIONS, DataSpec, SweepSpec, TrialConfig


def _known_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the model reached by following loc (for 'did you mean' hints)."""
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            break
        model = ann
    return list(model.model_fields)


def _loc_part(part: Any) -> str:
    # A key that prints as nothing (an empty or blank YAML key) is shown quoted, so the field is never blank.
    text = str(part)
    return text if text.strip() else repr(text)


def problems_from_validation(err: ValidationError, model: type[BaseModel], prefix: str = "") -> list[Problem]:
    """Turn pydantic errors into Problems with dotted paths, the bad value and a fix."""
    problems = []
    for e in err.errors(include_url=False):
        loc = tuple(e["loc"])
        path = prefix + ".".join(_loc_part(p) for p in loc)
        if e["type"] == "extra_forbidden":
            known = _known_keys(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(known)}"
            problems.append(Problem(path, e["input"], f"unknown key; {hint}"))
        elif e["type"] == "missing":
            problems.append(Problem(path, None, "required; add this key"))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            expected = _expected(model, loc) if e["type"] in _TYPE_AND_RANGE_ERRORS else None
            problems.append(Problem(path, e.get("input"), f"{msg}; {expected}" if expected else msg))
    return problems


# pydantic's error types of a value of the wrong type or outside its range: their message names neither the
# field's type with its bounds nor a value that works, so the problem adds both (_expected).
_TYPE_AND_RANGE_ERRORS = {"int_parsing", "int_type", "int_from_float", "float_parsing", "float_type", "bool_parsing",
                          "bool_type", "string_type", "greater_than", "greater_than_equal", "less_than",
                          "less_than_equal", "list_type", "dict_type"}
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
               dict: "a mapping"}


def _expected(model: type[BaseModel], loc: tuple) -> str | None:
    """'expected an integer >= 1, e.g. 1 (the default)' for the field at loc, or None where loc is not a field."""
    field = None
    for part in loc:
        if field is not None:  # a part below a field that is not a section (a list item, a union's branch)
            return None
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model, field = ann, None
    if field is None:
        return None
    base = typing.get_origin(field.annotation) or field.annotation
    kind = _TYPE_NAMES.get(base)
    if kind is None:
        return None
    bounds = [f"{symbol} {getattr(m, attr)}" for m in field.metadata
              for attr, symbol in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if hasattr(m, attr)]
    example = "" if field.default in (None, PydanticUndefined) else f", e.g. {field.default!r} (the default)"
    return f"expected {kind}{' ' + ' and '.join(bounds) if bounds else ''}{example}"


def _section_path_ok(key: str) -> str | None:
    """Why an axis key is not a trial field path, or None if it is."""
    parts = split_path(key)
    if parts[0] not in TRIAL_SECTIONS or len(parts) < 2:
        return f"axis keys are dotted trial fields such as 'train.strategy'; sections: {', '.join(TRIAL_SECTIONS)}"
    model: type[BaseModel] = TrialConfig
    for i, part in enumerate(parts):
        if part not in model.model_fields:
            close = difflib.get_close_matches(part, list(model.model_fields), n=1)
            hint = f"did you mean '{'.'.join(parts[:i] + [close[0]])}'?" if close else ""
            return f"no such trial field '{'.'.join(parts[: i + 1])}' {hint}".rstrip()
        ann = model.model_fields[part].annotation
        if typing.get_origin(ann) is dict and i == len(parts) - 2:
            return None  # a key of a free mapping (stack.overrides.KEY): the stack's own schema checks it
        if i < len(parts) - 1:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                return f"'{'.'.join(parts[: i + 1])}' has no sub-fields"
            model = ann
    return None


def _check_axes(spec: SweepSpec) -> list[Problem]:
    """Each axis names a real field and each of its values is valid on its own."""
    problems = []
    base = spec.base_trial()
    for key, values in spec.axes.items():
        where = f"axes.{key}"
        why = _section_path_ok(key) if "." in key else _bundle_problem(key, values)
        if why is not None:
            problems.append(Problem(where, values, why))
            continue
        if not values:
            problems.append(Problem(where, values, "an axis needs at least one value"))
            continue
        read: dict[str, int] = {}  # each value's trial, as its id hashes it -> the value's index
        for i, value in enumerate(values):
            trial = copy_trial(base)
            assigned = axis_assignments(key, value)
            for path, leaf in assigned.items():
                set_path(trial, path, leaf)
            try:
                config = TrialConfig.model_validate(trial)
            except ValidationError as err:
                for p in problems_from_validation(err, TrialConfig):
                    for path in assigned:
                        if p.field == path or p.field.startswith(path + "."):
                            sub = p.field[len(key):] if "." in key else f".{p.field}"
                            problems.append(Problem(f"{where}[{i}]{sub}", value, p.message))
                continue
            # Two spellings of one setting (0.5 and '1/2', 1 and 1.0) would be two points with one trial id.
            first = read.setdefault(json.dumps(config.model_dump(mode="json"), sort_keys=True, default=str), i)
            if first != i:
                problems.append(Problem(f"{where}[{i}]", value, f"the same setting as {where}[{first}] "
                                        f"({values[first]!r}) once read; list each value once (use repeats: for more)"))
    for i, rule in enumerate(spec.exclude):
        for key, value in rule.items():
            if key not in spec.axes:
                problems.append(Problem(f"exclude[{i}].{key}", value, "exclude keys must be axis keys"))
            elif value not in spec.axes[key]:  # a rule that matches no point drops nothing, without a word
                problems.append(Problem(f"exclude[{i}].{key}", value, f"not one of the axis's values "
                                        f"{spec.axes[key]!r}; write it as the axis does (a quoted '2' is not 2)"))
    return problems


def _bundle_problem(key: str, values: Any) -> str | None:
    """Why an undotted axis key is not a valid bundle axis (a named list of field mappings), or None."""
    usage = ("an axis key without a dot is a bundle: a name whose values each set several fields together, "
             "e.g. setup: [{train.strategy: tp, train.tp_size: 2}, {train.strategy: ddp}]")
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_-]*$", key) or key in TRIAL_SECTIONS:
        return usage
    for value in values if isinstance(values, list) else []:
        if not isinstance(value, dict) or not value:
            return f"{usage}; got {value!r}"
        for field in value:
            if not isinstance(field, str) or "." not in field or (why := _section_path_ok(field)) is not None:
                return f"bundle field {field!r}: " + (why if isinstance(field, str) and "." in field else usage)
    return None


def metric_problem(field: str, metric: Any) -> Problem | None:
    """A Problem if `metric` is not a numeric stored metric column, naming the closest one."""
    known = numeric_metric_names()
    if isinstance(metric, str) and metric in known:
        return None
    close = difflib.get_close_matches(str(metric), known, n=1)
    hint = f"did you mean '{close[0]}'?" if close else "e.g. tok_per_s_per_device, step_time_p50_s, peak_rss_gib"
    return Problem(field, metric, f"not a numeric result column; {hint} (all: docs/metrics.md)")


def _check_search(spec: SweepSpec) -> list[Problem]:
    """The search section names real metrics, one mode per metric, and options its algo uses."""
    search = spec.search
    metrics = [search.metric] if isinstance(search.metric, str) else search.metric
    problems = [p for m in metrics if (p := metric_problem("search.metric", m))]
    if not metrics:
        problems.append(Problem("search.metric", search.metric, "name at least one metric"))
    if len(set(metrics)) != len(metrics):
        problems.append(Problem("search.metric", search.metric, "a metric is listed twice; list each once"))
    gpus_vary = any("gpus_per_worker" in repr((key, values)) for key, values in spec.axes.items())
    if spec.resources.gpus_per_worker == 0 and not gpus_vary:
        problems += [Problem("search.metric", m, "is null on CPU trials (resources.gpus_per_worker: 0), so no "
                             "trial could be ranked; on CPU use peak_rss_gib for memory, tok_per_s_per_device "
                             "for speed") for m in metrics if m in GPU_ONLY_METRICS]
    if isinstance(search.mode, list) and len(search.mode) != len(metrics):
        problems.append(Problem("search.mode", search.mode, f"give one mode per metric ({len(metrics)}), a single "
                                "mode for all, or null to infer each from its name"))
    if search.algo == "grid":
        for name in ("num_samples", "early_stop"):
            if getattr(search, name) is not None:
                problems.append(Problem(f"search.{name}", getattr(search, name), "only used by search.algo random "
                                        "or optuna (grid runs every point); remove it or choose a searcher"))
    elif not spec.axes:
        problems.append(Problem("search.algo", search.algo, "a searcher picks points of the `axes` grid and this "
                                "sweep has no axes; add axes, or use search.algo: grid"))
    return problems


def _check_estimate(est: EstimateSpec) -> list[Problem]:
    """A known GPU name, one kind of margin, and a margin smaller than the memory it is taken from."""
    problems = []
    if est.gpu is not None and not known_gpu(est.gpu):
        problems.append(Problem("estimate.gpu", est.gpu, f"unknown GPU; use one of {', '.join(gpu_labels())}, or leave "
                                "it null and set estimate.device_memory_gib"))
    elif est.gpu is not None and est.prune and est.device_memory_gib is None and gpu_memory_gib(est.gpu) is None:
        problems.append(Problem("estimate.device_memory_gib", None, f"the memory of '{est.gpu}' is not in the "
                                "table; set estimate.device_memory_gib (GiB per GPU), or estimate.prune: false"))
    if est.margin_gib is not None and est.margin_fraction is not None:
        problems.append(Problem("estimate.margin_gib", est.margin_gib, "set one of estimate.margin_gib or "
                                "estimate.margin_fraction, not both"))
    memory = est.device_memory_gib if est.device_memory_gib is not None else gpu_memory_gib(est.gpu)
    if est.margin_gib is not None and memory is not None and est.margin_gib >= memory:
        problems.append(Problem("estimate.margin_gib", est.margin_gib, f"the margin must be below the device "
                                f"memory ({memory:.1f} GiB); lower it"))
    return problems


def data_layout_problems(data: DataSpec) -> list[Problem]:
    """Layout options that only act together with another: pad_multiple rounds pad_to longest's widths, best_fit
    orders packed rows. Checked on the sweep's data (load) and on each trial's, where axes vary them (plan)."""
    problems = []
    if data.pad_multiple != 1 and data.pad_to != "longest":
        problems.append(Problem("data.pad_multiple", data.pad_multiple, "rounds the width of pad_to longest "
                                "batches; with pad_to seq_len every batch is seq_len wide: set data.pad_to: "
                                "longest, or remove data.pad_multiple"))
    if data.pack_order == "best_fit" and not data.packing:
        problems.append(Problem("data.pack_order", data.pack_order, "orders samples into packed rows; with packing "
                                "false each sample has a row of its own: set data.packing: true, or remove "
                                "data.pack_order"))
    return problems


def sweep_problems(spec: SweepSpec) -> list[Problem]:
    """Every problem of a sweep that parsed: axes, search and estimate (paths are the loader's)."""
    return _check_axes(spec) + _check_search(spec) + _check_estimate(spec.estimate) + _check_pool_stacks(spec)


def _check_pool_stacks(spec: SweepSpec) -> list[Problem]:
    """A warm pool's actors run raybench's own loop only (the registry's warm_pool): a user's stack needs fresh
    processes per trial."""
    if spec.executor != "pool":
        return []
    others = spec.fresh_process_kinds()
    if not others:
        return []
    return [Problem("executor", "pool", f"the warm pool runs raybench's own loop only, not stack.kind "
                    f"{', '.join(others)}; use executor: train (or torchrun)")]
