"""Grid expansion, cross-field checks and content-hash trial ids. Starts nothing and imports no torch."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from raybench.data import tokenized
from raybench.planning import calibration, estimate, loss_choice, stacks
from raybench.planning.assessment import Assessment, assess
from raybench.spec.axes import axis_assignments, copy_trial, excluded, set_path
from raybench.spec.errors import ConfigError, Problem
from raybench.spec.finetunes import LORA
from raybench.spec.load import load_sweep
from raybench.spec.payload import TrialPayload
from raybench.spec.presets import ModelShape, model_shape
from raybench.spec.sac import checkpointed_blocks
from raybench.spec import options
from raybench.spec import stacks as stacks_spec
from raybench.spec.sweep_spec import SweepSpec, TrainSpec, TrialConfig, config_id
from raybench.spec.validate import data_layout_problems


@dataclass(frozen=True)
class PlannedTrial:
    """One point of the grid (one repeat of it): the payload its run gets, and whether it runs at all."""

    index: int
    payload: TrialPayload  # what a trial driver, its executor and its ranks get
    shape: ModelShape
    status: str = "planned"  # or "invalid", or "skipped" (estimated not to fit in device memory)
    reasons: tuple[str, ...] = field(default=())
    # The plan's judgement, typed, for tables and the rehearsal; the payload carries it as plain data.
    assessment: Assessment | None = None

    # The payload's identity and config, which tables, drivers and searches read on every trial.
    @property
    def trial_id(self) -> str:
        return self.payload.trial_id

    @property
    def config_id(self) -> str:
        return self.payload.config_id

    @property
    def repeat(self) -> int:
        return self.payload.repeat

    @property
    def config(self) -> TrialConfig:
        return self.payload.config

    @property
    def axis_values(self) -> dict[str, Any]:
        return self.payload.axis_values

    @property
    def ac_blocks(self) -> tuple[int, ...]:
        return self.payload.ac_blocks

    @property
    def world_size(self) -> int:
        return self.config.resources.workers



def matching(trials: list[PlannedTrial], key: str) -> list[PlannedTrial]:
    """The planned trials a command line names by `key`: a trial id, a config id (every repeat) or a plan index."""
    return [t for t in trials if key in (t.trial_id, t.config_id, str(t.index))]


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
    if config.data.prefetch_factor is not None and config.data.num_workers == 0:
        problems.append(("data.prefetch_factor", "prefetch_factor needs loader workers (data.num_workers > 0); "
                         "remove it or add workers"))
    if config.data.source == "hf":  # an axis may set one layout option without the other
        problems += [(p.field, p.message) for p in data_layout_problems(config.data)]
    return problems + parallelism_problems(config, shape) + technique_problems(config)


def parallelism_problems(config: TrialConfig, shape: ModelShape) -> list[tuple[str, str]]:
    """Rules for strategy, tp_size, ZeRO offload: what the mesh and the engines can express."""
    train, workers = config.train, config.resources.workers
    problems = []
    if train.parallelism.tp_group_is_world and train.tp_size != workers:
        problems.append(("train.tp_size", f"strategy tp puts all {workers} ranks in one TP group: set "
                         f"train.tp_size: {workers} (or use tp_fsdp2 for TP groups smaller than the world)"))
    elif train.tensor_parallel and train.fsdp2_sharded and (train.tp_size < 2 or workers % train.tp_size):
        problems.append(("train.tp_size", f"tp_fsdp2 needs a tp_size >= 2 that divides resources.workers "
                         f"({workers}); got {train.tp_size}"))
    elif train.parallelism.zero and train.tp_size != 1:
        problems.append(("train.tp_size", "tensor parallelism with deepspeed is not supported (ZeRO shards over "
                         "data-parallel ranks only); use strategy tp_fsdp2, or tp_size: 1"))
    elif not train.tensor_parallel and train.tp_size != 1:
        problems.append(("train.tp_size", f"tp_size applies to strategies tp and tp_fsdp2, not "
                         f"{train.strategy}; set train.tp_size: 1"))
    if train.tensor_parallel:
        for what, heads in (("attention heads", shape.num_attention_heads), ("KV heads", shape.num_key_value_heads)):
            if heads % train.tp_size:
                problems.append(("train.tp_size", f"tp_size {train.tp_size} must divide the model's {heads} "
                                 f"{what} (each rank holds whole heads)"))
    if train.offload != "none":
        if not train.parallelism.zero:
            problems.append(("train.offload", f"offload is a DeepSpeed ZeRO option; strategy is {train.strategy}"))
        if config.resources.gpus_per_worker == 0:
            problems.append(("train.offload", "offload moves ZeRO state from GPU to host memory and needs GPUs "
                             "(resources.gpus_per_worker: 1); set train.offload: none on CPU"))
        if train.offload == "optimizer_params" and train.zero_stage != 3:
            problems.append(("train.offload", "parameter offload needs train.zero_stage: 3 (stages 1-2 keep "
                             "full parameters on every GPU)"))
    return problems


def _fp8_problems(train: TrainSpec, gpus: int) -> list[tuple[str, str]]:
    """Where torchao's float8 training cannot run as raybench wires it (runtime/techniques/fp8.py)."""
    if train.fp8 == "off":
        return []
    problems = []
    if gpus == 0:
        problems.append(("train.fp8", "FP8 matmuls need CUDA GPUs with FP8 tensor cores (H100, H200, B200, GB200, "
                         "L40S; resources.gpus_per_worker: 1); set train.fp8: off on CPU"))
    if not train.parallelism.fp8:
        problems.append(("train.fp8", f"FP8 linears are wired for ddp and fsdp2, not {train.strategy} (torchao's "
                         "tensor-parallel float8 styles and DeepSpeed's engine are not); use fsdp2, or "
                         "train.fp8: off"))
    if train.tuning.quantized_base:
        problems.append(("train.fp8", "qlora's base is 4-bit already; FP8 applies to full and lora: use "
                         "finetune lora, or train.fp8: off"))
    if train.precision != "bf16":
        problems.append(("train.fp8", f"FP8 training runs everything else in bf16, not {train.precision}; set "
                         "train.precision: bf16"))
    return problems


def technique_problems(config: TrialConfig) -> list[tuple[str, str]]:
    """Rules for precision, QLoRA, Liger, attention kernel and AC mode."""
    train, gpus = config.train, config.resources.gpus_per_worker
    problems = []
    if train.precision == "fp16":
        if not train.grad_scaler:
            problems.append(("train.grad_scaler", "fp16 gradients underflow without loss scaling; set "
                             "train.grad_scaler: true, or use precision bf16"))
        if not train.parallelism.fp16_scaling:
            problems.append(("train.precision", f"fp16 loss scaling is wired for ddp (GradScaler) and deepspeed "
                             f"(its own scaler), not {train.strategy}; use bf16 with {train.strategy}"))
    if train.compile and train.parallelism.zero and train.zero_stage == 3:
        problems.append(("train.compile", "DeepSpeed ZeRO-3 gathers and frees parameters in hooks on every "
                         "submodule, which split each compiled block apart and recompile for every module past "
                         "torch.compile's limit; compile with fsdp2 (the same sharding) or zero_stage 1/2, or set "
                         "train.compile: false"))
    if train.optimizer == "adafactor" and train.parallelism.dtensor_params:
        problems.append(("train.optimizer", f"torch's Adafactor updates its factored statistics in place, which "
                         f"DTensor parameters ({train.strategy}) reject; use adafactor with ddp or deepspeed, or "
                         "adamw/sgd"))
    if train.tuning.quantized_base:
        if gpus == 0:
            problems.append(("train.finetune", "qlora needs CUDA (bitsandbytes 4-bit kernels; "
                             "resources.gpus_per_worker: 1); on CPU use finetune: lora"))
        if not train.parallelism.quantized_base:
            problems.append(("train.finetune", f"qlora runs with strategy ddp: 4-bit weights are not sharded by "
                             f"{train.strategy} here"))
    problems += _lora_base_problems(train)
    if train.liger and gpus == 0:
        problems.append(("train.liger", "Liger kernels need CUDA (Triton; resources.gpus_per_worker: 1); "
                         "set train.liger: false on CPU"))
    problems += _fp8_problems(train, gpus)
    problems += options.option_problems(train, gpus)
    if train.reduce_dtype == "bf16" and (not train.fsdp2_sharded or train.precision != "bf16"):
        problems.append(("train.reduce_dtype", f"bf16 gradient reduction is FSDP2's mixed precision: it needs "
                         f"strategy fsdp2 or tp_fsdp2 with precision bf16 (here {train.strategy}, "
                         f"{train.precision}); set train.reduce_dtype: fp32"))
    if config.model.attn_implementation == "flash_attention_2" and gpus == 0:
        problems.append(("model.attn_implementation", "flash_attention_2 needs CUDA; use sdpa on CPU"))
    if config.model.attn_implementation == "flex_attention" and gpus == 0:
        # torch 2.13 runs FlexAttention's forward on a CPU but raises in its backward.
        problems.append(("model.attn_implementation", "flex_attention needs CUDA (torch's FlexAttention has no "
                         "backward on CPU; resources.gpus_per_worker: 1); use sdpa on CPU"))
    if train.ac_saved_ops is not None and train.ac_mode != "op":
        problems.append(("train.ac_saved_ops", "lists what op-level AC keeps; set train.ac_mode: op"))
    unknown = _unknown_operators(train.ac_saved_ops or [])
    if unknown:
        problems.append(("train.ac_saved_ops", f"{unknown[0]!r} is not an aten operator, so nothing would be kept "
                         "for it; use the names `raybench best --predict` prints (mm, sdpa, mul#2, ...)"))
    if (train.compile and train.tensor_parallel and train.ac_saved_ops is not None
            and not {"sdpa", "sdpa#0"} & set(train.ac_saved_ops)):  # a block's one attention call
        problems.append(("train.ac_saved_ops", f"{train.strategy} with compile cannot recompute attention in a "
                         "checkpointed block (torch 2.13's compiler fails on its random state next to the "
                         "DeviceMesh); add 'sdpa' to the list, or set train.compile: false"))
    if train.ac_mode == "op" and Fraction(train.ac_ratio) == 0:
        problems.append(("train.ac_mode", "op-level AC applies to the blocks ac_ratio selects and ac_ratio is 0; "
                         "set train.ac_ratio (1 = every block)"))
    return problems


def _lora_base_problems(train: TrainSpec) -> list[tuple[str, str]]:
    """An explicit train.lora.base_dtype the run could not keep (auto always can)."""
    base, precision = train.lora.base_dtype, train.precision
    if base == "auto":
        return []
    field = "train.lora.base_dtype"
    if train.tuning.quantized_base:
        return [(field, f"base_dtype {base}: qlora's base is 4-bit NF4, with no dtype to choose; remove "
                 "train.lora.base_dtype (or set auto), or use finetune: lora")]
    if train.tuning is not LORA:
        return []
    if base != "fp32" and precision == "fp32":
        return [(field, f"base_dtype {base} under precision fp32 would compute with rounded weights in fp32; "
                 "set train.lora.base_dtype: auto (fp32 here), or train.precision to " + base)]
    if base != "fp32" and base != precision:
        return [(field, f"base_dtype {base} differs from the compute dtype {precision}: every matmul would cast "
                 f"the whole base again; set train.lora.base_dtype: auto ({precision}) or fp32")]
    if base == "fp32" and train.parallelism.zero and precision != "fp32":
        return [(field, f"base_dtype fp32 under deepspeed with precision {precision}: DeepSpeed casts the whole "
                 f"model to {precision} (keeping fp32 master copies of the adapters only), so an fp32 base cannot "
                 f"be kept; set train.lora.base_dtype: auto ({precision}), or use strategy ddp/fsdp2 for an fp32 "
                 "base")]
    return []


def _unknown_operators(saved_ops: list[str]) -> list[str]:
    """Entries of train.ac_saved_ops that name no aten operator ("sdpa" stands for every attention kernel)."""
    if not saved_ops:
        return []
    import torch  # only for sweeps that list operators: planning stays torch-free otherwise

    names = {entry.split("#")[0] for entry in saved_ops} - {"sdpa"}
    return sorted(name for name in names if not hasattr(torch.ops.aten, name))


def _data_problems(config: TrialConfig, checked: dict[str, list[Problem]]) -> list[Problem]:
    """What is wrong with the content of a trial's hf data, checked once per distinct data spec and tokenizer.
    Bad data is bad input whatever --keep-invalid says: no point of the sweep could run on it."""
    key, tokenizer = tokenized.spec_key(config.data, config.model.path)
    if key in checked:
        return []
    checked[key] = tokenized.problems(config.data, tokenizer)
    return checked[key]


def _vocabulary_problems(config: TrialConfig, shape: ModelShape, checked: set[tuple]) -> list[Problem]:
    """The data's tokenizer against the model's embeddings, once per tokenizer and model."""
    _, tokenizer_dir = tokenized.spec_key(config.data, config.model.path)
    model = f"model.preset {config.model.preset}" if config.model.preset else f"model.path {config.model.path}"
    if tokenizer_dir is None or (tokenizer_dir, model) in checked:
        return []
    checked.add((tokenizer_dir, model))
    found = tokenized.vocabulary_problem(tokenizer_dir, shape.vocab_size, model)
    return [found] if found else []


def _stack_problems(config: TrialConfig, checked: dict[str, list[Problem]]) -> list[Problem]:
    """What is wrong with a trial's stack section (its entry, its own keys, raybench fields it does not take),
    checked once per distinct stack and train section. Like bad data, bad input whatever --keep-invalid says."""
    key = json.dumps([config.stack.model_dump(mode="json"), config.train.model_dump(mode="json")], sort_keys=True)
    if key in checked:
        return []
    checked[key] = stacks.problems(config)
    return checked[key]


def _point(values: dict) -> str:
    """A grid point in words: its axis values, or the base config for a sweep without axes."""
    return ", ".join(f"{k}={v!r}" for k, v in values.items()) or "base config"


def _grid(spec: SweepSpec):
    """Axis-value dicts in declaration order (first axis varies slowest), excluded points removed."""
    keys = list(spec.axes)
    for combo in itertools.product(*(spec.axes[k] for k in keys)):
        values = dict(zip(keys, combo))
        if not excluded(values, spec.exclude):
            yield values


def plan(spec: SweepSpec, keep_invalid: bool = False, source: str = "<sweep>",
         store_path: str | Path | None = None, evidence: calibration.Evidence | None = None) -> list[PlannedTrial]:
    """Expand the grid into trials. Invalid points raise one ConfigError, or stay as invalid rows if asked.

    Every valid trial gets a memory/step-time assessment, calibrated by the measured rows and judged by the
    rehearsals in `store_path` when given (or by the `evidence` a caller already read from its store); with
    spec.estimate.prune, trials that would not fit in device memory are marked skipped.
    """
    evidence = evidence or calibration.evidence(store_path)
    factors, rehearsed = evidence.factors, evidence.rehearsals
    base = spec.base_trial()
    shapes: dict[tuple, ModelShape] = {}
    trials, problems, refused = [], [], []
    data_checked: dict[str, list[Problem]] = {}
    stack_checked: dict[str, list[Problem]] = {}
    vocabulary_checked: set[tuple] = set()
    points: dict[str, dict] = {}  # each configuration's grid point, by its id
    for grid_values in _grid(spec):
        raw = copy_trial(base)
        # Bundle axes set several fields per value; trials show every field an axis set, by its dotted path.
        values = {path: leaf for key, value in grid_values.items()
                  for path, leaf in axis_assignments(key, value).items()}
        for key, value in values.items():
            set_path(raw, key, value)
        config = TrialConfig.model_validate(raw)  # each axis value was validated alone in load_sweep
        key = (config.model.preset, config.model.path)
        shape = shapes.get(key) or shapes.setdefault(key, model_shape(config))
        reasons = trial_problems(config, shape)
        if config.data.source == "hf":
            problems += _data_problems(config, data_checked)
        if config.data.source != "synthetic":
            problems += _vocabulary_problems(config, shape, vocabulary_checked)
        problems += _stack_problems(config, stack_checked)
        blocks = tuple(checkpointed_blocks(Fraction(config.train.ac_ratio), shape.num_hidden_layers))
        own_loop = stacks_spec.kind(config.stack.kind).own_loop
        if not reasons and own_loop:  # a user's stack computes its own loss
            config = loss_choice.chosen(config, shape, blocks, spec.estimate, evidence,
                                        lambda c: rehearsed.get(config_id(c)))
        cid = config_id(config)
        if cid in points:  # one trial id twice: the second would be skipped as stored, or run twice at once
            problems.append(Problem("axes", _point(values), f"the same trial ({cid}) as {_point(points[cid])}: two "
                                    "spellings of one setting (0.5 and '1/2'; train.loss auto and the loss it picks); "
                                    "keep one, or drop the point with `exclude:`"))
            continue
        points[cid] = values
        if reasons and not keep_invalid:
            refused += [(f, why, values) for f, why in reasons]
            continue
        status, why_not = ("invalid", tuple(why for _, why in reasons)) if reasons else ("planned", ())
        judged = None
        # An invalid combination has no meaningful estimate (its mesh may not even exist), and the estimate models
        # raybench's own loop, not a user's stack.
        if not reasons and own_loop:
            raw_est = estimate.estimate(config, shape, blocks, spec.estimate.gpu)
            judged, skip = assess(raw_est, spec.estimate, factors.get(calibration.key_of(config)), rehearsed.get(cid),
                                 config.resources.workers)
            if skip:
                status, why_not = "skipped", (skip,)
        carried = judged.to_data() if judged else None
        for repeat in range(spec.repeats):
            payload = TrialPayload(
                trial_id=f"{cid}-r{repeat}", config_id=cid, repeat=repeat, config=config, axis_values=values,
                ac_blocks=blocks, num_layers=shape.num_hidden_layers, projection=spec.projection, pool=spec.pool,
                caches=spec.caches, assessment=carried)
            trials.append(PlannedTrial(index=len(trials), payload=payload, shape=shape, status=status,
                                       reasons=why_not, assessment=judged))
    problems += _point_problems(refused, base, sum(1 for _ in _grid(spec)))
    if problems:
        raise ConfigError(source, problems)
    return trials


def _point_problems(refused: list[tuple[str, str, dict]], base: dict, points: int) -> list[Problem]:
    """The rules' refusals of grid points as problems: a refusal every point of the grid meets, word for word, is
    the base config's mistake, reported once with the base value and the fix there; the others name their point."""
    counts: dict[tuple[str, str], int] = {}
    for field_, why, _ in refused:
        counts[field_, why] = counts.get((field_, why), 0) + 1
    problems, said = [], set()
    for field_, why, values in refused:
        if counts[field_, why] == points > 1 or not values:
            if (field_, why) not in said:
                said.add((field_, why))
                problems.append(Problem(field_, _base_value(base, field_), f"{why}; at every grid point: fix it in "
                                        f"the sweep's {field_.split('.')[0]} section"))
            continue
        problems.append(Problem(field_, _point(values), f"{why}; drop this point with `exclude:`, or pass "
                                "--keep-invalid to record it as an invalid row"))
    return problems


def _base_value(base: dict, dotted: str) -> Any:
    node: Any = base
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def load_checked(path: str | Path) -> SweepSpec:
    """load_sweep, and where the file has problems, every one of them in one pass: the parse's, then the rules of
    the grid the rest of the file makes (the sweep without the parts already refused, `ConfigError.rest`)."""
    try:
        return load_sweep(path)
    except ConfigError as err:
        if err.rest is None:
            raise
        try:
            plan(err.rest, source=str(path))
        except ConfigError as more:
            raise ConfigError(err.source, err.problems + more.problems) from None
        except Exception:  # noqa: BLE001 - the rest is a repaired sweep: its own failure must not hide the problems
            pass
        raise
