"""Grid expansion, cross-field checks and content-hash trial ids. Starts nothing and imports no torch."""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from raybench.config import ConfigError, Problem, SweepSpec, TrialConfig, _copy_sections, set_path
from raybench.presets import PRESETS, ModelShape, shape_from_model_dir
from raybench.techniques.activation_checkpointing import checkpointed_blocks


@dataclass(frozen=True)
class PlannedTrial:
    """One point of the grid (one repeat of it), ready to run or marked invalid with reasons."""

    index: int
    trial_id: str
    config_id: str
    repeat: int
    config: TrialConfig
    axis_values: dict[str, Any]
    shape: ModelShape
    ac_blocks: tuple[int, ...]
    status: str = "planned"  # or "invalid"
    reasons: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return self.config.resources.workers

    def as_payload(self) -> dict:
        """Plain data handed to a trial driver or worker (JSON-safe)."""
        return {
            "trial_id": self.trial_id,
            "config_id": self.config_id,
            "repeat": self.repeat,
            "config": self.config.model_dump(mode="json"),
            "axis_values": self.axis_values,
            "ac_blocks": list(self.ac_blocks),
            "num_layers": self.shape.num_hidden_layers,
        }


def config_id(config: TrialConfig) -> str:
    """Stable content hash of a resolved trial config: same config, same id, on every run and machine."""
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def model_shape(config: TrialConfig) -> ModelShape:
    if config.model.preset is not None:
        return PRESETS[config.model.preset]
    return shape_from_model_dir(Path(config.model.path))


def trial_problems(config: TrialConfig, shape: ModelShape) -> list[tuple[str, str]]:
    """Cross-field rules: (field, reason) for each way this combination cannot run."""
    train, res = config.train, config.resources
    problems = []
    if train.warmup_steps >= train.steps:
        problems.append(("train.warmup_steps", f"warmup_steps ({train.warmup_steps}) must be below steps "
                         f"({train.steps}) so that some steps are timed"))
    if train.seq_len > shape.max_position_embeddings:
        problems.append(("train.seq_len", f"seq_len {train.seq_len} exceeds the model's "
                         f"max_position_embeddings {shape.max_position_embeddings}"))
    if config.data.pin_memory and res.gpus_per_worker == 0:
        problems.append(("data.pin_memory", "pin_memory needs GPUs (resources.gpus_per_worker: 1)"))
    return problems


def _excluded(values: dict[str, Any], rules: list[dict[str, Any]]) -> bool:
    return any(all(values.get(k) == v for k, v in rule.items()) for rule in rules)


def _grid(spec: SweepSpec):
    """Axis-value dicts in declaration order (first axis varies slowest), excluded points removed."""
    keys = list(spec.axes)
    for combo in itertools.product(*(spec.axes[k] for k in keys)):
        values = dict(zip(keys, combo))
        if not _excluded(values, spec.exclude):
            yield values


def plan(spec: SweepSpec, keep_invalid: bool = False, source: str = "<sweep>") -> list[PlannedTrial]:
    """Expand the grid into trials. Invalid points raise one ConfigError, or stay as invalid rows if asked."""
    base = spec.base_trial()
    shapes: dict[tuple, ModelShape] = {}
    trials, problems = [], []
    for values in _grid(spec):
        raw = _copy_sections(base)
        for key, value in values.items():
            set_path(raw, key, value)
        config = TrialConfig.model_validate(raw)  # each axis value was validated alone in load_sweep
        key = (config.model.preset, config.model.path)
        shape = shapes.get(key) or shapes.setdefault(key, model_shape(config))
        reasons = trial_problems(config, shape)
        cid = config_id(config)
        blocks = tuple(checkpointed_blocks(Fraction(config.train.ac_ratio), shape.num_hidden_layers))
        if reasons and not keep_invalid:
            where = ", ".join(f"{k}={v!r}" for k, v in values.items()) or "base config"
            problems += [Problem(f, where, f"{why}; drop this point with `exclude:`, or pass --keep-invalid "
                                 "to record it as an invalid row") for f, why in reasons]
            continue
        for repeat in range(spec.repeats):
            trials.append(PlannedTrial(
                index=len(trials), trial_id=f"{cid}-r{repeat}", config_id=cid, repeat=repeat, config=config,
                axis_values=values, shape=shape, ac_blocks=blocks,
                status="invalid" if reasons else "planned", reasons=tuple(why for _, why in reasons),
            ))
    if problems:
        raise ConfigError(source, problems)
    return trials
