"""Typed, frozen sweep and trial configs.

A sweep YAML has fixed sections (model, data, train, resources) that together form one trial's config, plus
`axes`: a grid over any trial field by dotted path (``train.strategy: [ddp, fsdp2]``). `load_sweep` checks
everything it can without starting anything and raises one `ConfigError` listing every problem, each with its
field path, the bad value and the fix. Cross-field rules that need the expanded grid live in `plan.py`.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from raybench.axes import axis_assignments, copy_trial, set_path
from raybench.hardware import gpu_labels, gpu_memory_gib, known_gpu
from raybench.presets import PRESETS
from raybench.redact import SECRET_PATTERN
from raybench.schema import GPU_ONLY_METRICS, numeric_metric_names

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

# A trial may tune communication, threading and compiler knobs, but not redirect what runs (PATH, LD_PRELOAD,
# PYTHONPATH) or leak into the launcher: only these prefixes are accepted in train.env.
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "CUDA_", "OMP_", "MKL_", "KMP_", "UCX_",
                "FI_", "DS_")
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def _check_env(value: Any) -> Any:
    """train.env: names from ENV_PREFIXES, scalar values (numbers become strings, as a shell would pass them)."""
    if not isinstance(value, dict):
        raise ValueError("expected a mapping of environment variable names to values, e.g. {NCCL_BUFFSIZE: 4194304}")
    out = {}
    for name, val in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name) or not name.startswith(ENV_PREFIXES):
            raise ValueError(f"variable {name!r} is not allowed; use an upper-case name starting with one of "
                             f"{', '.join(ENV_PREFIXES)}")
        if SECRET_PATTERN.search(name):  # the sweep's config is stored with every row: no secrets in it
            raise ValueError(f"variable {name!r} looks like a secret; secrets must not be in a sweep file (it is "
                             "stored with every result row): export it in the environment that launches raybench")
        if isinstance(val, bool) or not isinstance(val, (str, int, float)):
            raise ValueError(f"{name}: value {val!r} must be a string or a number")
        out[name] = str(val)
    return out


def _numeric(annotation) -> bool:
    """int or float, possibly optional (`float | None`)."""
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    return annotation in (int, float) or any(a in (int, float) for a in args)


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads `workers: true` as 1: a YAML slip that must not pass as a number.
        if isinstance(value, bool) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, not the boolean {str(value).lower()}")
        return value


class ModelSpec(_Spec):
    preset: Literal[tuple(PRESETS)] | None = Field(None, description="Built-in architecture, random weights.")
    path: str | None = Field(None, description="Local Hugging Face model directory (safetensors weights).")
    allow_pickle: bool = Field(False, description="Allow pickle (.bin/.pt) weights; unsafe, off by default.")
    trust_remote_code: bool = Field(False, description="Run a model directory's own Python code.")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = Field(
        "sdpa", description="transformers attention kernel (flash_attention_2: CUDA and the flash-attn package)."
    )


class DataSpec(_Spec):
    source: Literal["synthetic", "json"] = Field("synthetic", description="Random tokens, or alpaca-style JSON/JSONL.")
    path: str | None = Field(None, description="JSON or JSONL file with instruction/input/output records.")
    tokenizer: str | None = Field(None, description="Local tokenizer directory; defaults to model.path.")
    packing: bool = Field(True, description="Concatenate examples into full sequences instead of padding each.")
    num_workers: int = Field(0, ge=0, le=64, description="torch DataLoader worker processes per rank.")
    pin_memory: bool = Field(False, description="Pin host memory of batches (GPU only).")
    prefetch_factor: int | None = Field(
        None, ge=1, le=1024, description="Batches each loader worker prepares ahead; needs num_workers > 0."
    )
    persistent_workers: bool = Field(True, description="Keep loader workers alive across epochs (num_workers > 0).")


# Module names shared by the Llama and Qwen2 families, per LoraSpec.targets.
LORA_TARGET_MODULES = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "attention_mlp": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "all_linear": "all-linear",  # PEFT's keyword: every linear layer except the output head
}


class LoraSpec(_Spec):
    rank: int = Field(16, ge=1, le=4096, description="LoRA rank r.")
    alpha: float = Field(32, gt=0, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    targets: Literal["attention", "attention_mlp", "all_linear"] = Field(
        "attention_mlp", description="Which linear layers get adapters."
    )


_SAVED_OP = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(#[0-9]+)?")


def _check_saved_ops(value: Any) -> Any:
    if isinstance(value, list):
        bad = [entry for entry in value if not (isinstance(entry, str) and _SAVED_OP.fullmatch(entry))]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an operator name or name#call (e.g. mm, sdpa, mul#2)")
    return value


class TrainSpec(_Spec):
    strategy: Literal["ddp", "fsdp2", "deepspeed", "tp", "tp_fsdp2"] = Field("ddp", description=(
        "How ranks share the model: ddp replicas; fsdp2 sharding; deepspeed ZeRO (train.zero_stage); tp tensor "
        "parallel over all ranks; tp_fsdp2 a 2D mesh, tp_size ranks per TP group and FSDP2 across groups."))
    tp_size: int = Field(1, ge=1, le=1024, description=(
        "Tensor-parallel group size: the world size for tp, >1 and dividing the world size for tp_fsdp2, else 1."))
    zero_stage: int = Field(2, ge=1, le=3, description=(
        "DeepSpeed ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters sharded (strategy=deepspeed)."))
    offload: Literal["none", "optimizer", "optimizer_params"] = Field("none", description=(
        "DeepSpeed ZeRO offload to host memory (GPU only): optimizer state, or with stage 3 parameters too."))
    steps: int = Field(20, ge=1, le=1_000_000, description="Optimizer steps per trial, warm-up included.")
    warmup_steps: int = Field(3, ge=0, description="Leading steps excluded from every timing.")
    seq_len: int = Field(512, ge=8, le=1_048_576, description="Tokens per sequence.")
    micro_batch: int = Field(1, ge=1, le=4096, description="Sequences per rank per forward pass.")
    grad_accum: int = Field(1, ge=1, le=4096, description="Micro-batches per optimizer step.")
    precision: Literal["fp32", "bf16", "fp16"] = Field("bf16", description=(
        "Compute dtype (bf16/fp16: autocast, FSDP2 policy or DeepSpeed's own; fp16 needs grad_scaler)."))
    grad_scaler: bool = Field(True, description=(
        "fp16 only: dynamic loss scaling (torch GradScaler with ddp, DeepSpeed's own scaler with deepspeed)."))
    finetune: Literal["full", "lora", "qlora"] = Field("full", description=(
        "Train every weight, LoRA adapters only, or LoRA on a 4-bit bitsandbytes base (qlora: CUDA only)."))
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings (used when finetune=lora/qlora).")
    ac_ratio: Ratio = Field("0", description="Fraction of decoder blocks activation-checkpointed, e.g. '1/2'.")
    ac_mode: Literal["block", "op"] = Field("block", description=(
        "How a checkpointed block saves memory: block recomputes it whole (ac_ratio 1 = full AC); op keeps "
        "matmul and attention outputs and recomputes the rest (torchtitan's op-level selective AC), or keeps what "
        "train.ac_saved_ops lists."))
    ac_saved_ops: Annotated[list[str] | None, BeforeValidator(_check_saved_ops)] = Field(None, description=(
        "ac_mode op: the operator outputs each checkpointed block keeps, the rest recomputed, as `raybench best "
        "--predict` prints an op-level policy: a name keeps every call (mm, sdpa for attention), name#k the k-th "
        "call from 0 in the block's forward (mul#2); null: torchtitan's policy."))
    compile: bool = Field(False, description=(
        "torch.compile each decoder block (not with DeepSpeed ZeRO-3, whose per-module hooks split it)."))
    compile_cache_dir: str | None = Field(None, description=(
        "TORCHINDUCTOR_CACHE_DIR for this trial's workers (a warm cache skips recompiling); null: inductor's default."))
    liger: bool = Field(False, description="Patch the model with Liger Triton kernels (CUDA and liger-kernel only).")
    optimizer: Literal["adamw", "adamw_foreach", "adamw_fused", "adafactor", "sgd"] = Field("adamw", description=(
        "adamw picks fused on CUDA and foreach elsewhere; adamw_foreach/adamw_fused force one; adafactor "
        "(torch.optim.Adafactor); sgd with momentum 0.9."))
    lr: float = Field(1e-5, gt=0, le=1, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="Decoupled weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; null disables clipping.")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered weights after forward.")
    seed: int = Field(0, ge=0, description="Seed for weights and synthetic data.")
    env: Annotated[dict[str, str], BeforeValidator(_check_env)] = Field(default_factory=dict, description=(
        "Environment variables of this trial's worker processes, set when they start (warm pool: a group of "
        "actors per distinct environment), e.g. {NCCL_SOCKET_NTHREADS: '4'}; names must start with one of "
        f"{', '.join(ENV_PREFIXES)}."))

    @model_serializer(mode="wrap")
    def _dump_without_unset_saved_ops(self, handler) -> dict:
        # Trial ids hash the dumped config (plan.config_id): ac_saved_ops came after ids were issued, so it is
        # left out while unset and every earlier trial keeps its id (stored rows, resumes).
        data = handler(self)
        if self.ac_saved_ops is None:
            data.pop("ac_saved_ops", None)
        return data

    @property
    def tensor_parallel(self) -> bool:
        """Whether the strategy splits the blocks' projections over a TP group (tp, tp_fsdp2)."""
        return self.strategy in ("tp", "tp_fsdp2")

    @property
    def fsdp2_sharded(self) -> bool:
        """Whether FSDP2 shards the parameters (fsdp2, tp_fsdp2). Its mixed-precision policy casts them to the
        compute dtype before each forward; ddp and tp keep fp32 weights and run forward under torch.autocast."""
        return self.strategy in ("fsdp2", "tp_fsdp2")

    def tp_sequence_parallel(self, tied_embeddings: bool) -> bool:
        """Whether tensor parallelism runs torchtitan's whole layout rather than splitting the blocks'
        projections only: sequence parallelism between the projections (norms and the residual stream split over
        the sequence), and the input embedding and LM head split over the vocabulary, the loss computed on the
        split logits (torch's loss_parallel). Not when the embedding and head share one weight, nor under Liger,
        whose Triton norm and fused head-and-loss kernels take whole tensors."""
        return self.tensor_parallel and not tied_embeddings and not self.liger


class ResourcesSpec(_Spec):
    workers: int = Field(1, ge=1, le=65536, description="Ranks per trial (one per GPU on GPU clusters).")
    cpus_per_worker: float = Field(1, gt=0, le=1024, description="CPUs reserved per rank.")
    gpus_per_worker: int = Field(0, ge=0, le=1, description="GPUs per rank: 1 on GPU clusters, 0 for CPU runs.")
    timeout_s: float = Field(3600, ge=1, le=7 * 86400, description=(
        "Wall-clock limit per trial, start-up included; a trial past it (a stuck collective, a deadlock) is "
        "killed, its resources freed and its row marked timeout. Also the torch.distributed collective timeout."))
    memory_limit_gib: float | None = Field(None, gt=0, le=65536, description=(
        "Host-memory cap per worker process (private memory, RLIMIT_DATA); an allocation past it fails and "
        "the trial is recorded as oom. null: no cap."))


class TrialConfig(_Spec):
    """Everything that determines one trial's measurement; its hash is the trial id."""

    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)


class PoolSpec(_Spec):
    recycle_after_trials: int = Field(200, ge=1, le=1_000_000, description=(
        "Replace a pool group's actors after this many trials (bounds slow memory creep)."))
    weights_cache_gib: float = Field(4.0, ge=0, le=4096, description=(
        "Host memory each pool actor may keep for the weights of the models it last loaded, so the next trial "
        "on the same model skips loading them (0: off)."))


class CacheSpec(_Spec):
    """Where trials keep what later trials reuse (not part of trial ids: caches change no measurement)."""

    weights_local_copy: Literal["auto", "always", "never"] = Field("auto", description=(
        "Copy a model.path directory once per node to node-local disk (RAYBENCH_LOCAL_DIR, SLURM_TMPDIR, TMPDIR "
        "or /tmp) and load it from there: 'auto' when it is on a network filesystem (NFS, Lustre, GPFS, ...)."))
    compile_dir: str | None = Field(None, description=(
        "Inductor/Triton cache of compiled trials (train.compile) shared by every trial and node of the store; "
        "null: <store>/_cache/compile. train.compile_cache_dir, when set, wins."))


class ProjectionSpec(_Spec):
    """The full run the user plans, to project each trial's hours and GPU-hours (not part of trial ids)."""

    dataset_tokens: float | None = Field(None, gt=0, description=(
        "Real (non-padding) tokens in the training set (one epoch)."))
    epochs: float = Field(1.0, gt=0, description="Passes over dataset_tokens.")
    total_steps: int | None = Field(None, ge=1, description="Optimizer steps of the full run (instead of tokens).")


class EstimateSpec(_Spec):
    """Per-trial memory and step-time estimate, and pruning of trials that cannot fit (not part of trial ids)."""

    gpu: str | None = Field(None, description=(
        "GPU the sweep's GPU trials run on, e.g. 'H100 SXM', 'H100 PCIe', 'H200', 'A100 80GB': its dense peak "
        "gives the step-time guess and its memory the default device_memory_gib (docs/estimate.md)."))
    device_memory_gib: float | None = Field(None, gt=0, le=65536, description=(
        "Memory one rank may use: a GPU's memory, or host memory per worker on CPU trials; null: from gpu."))
    margin_fraction: float | None = Field(None, ge=0, lt=1, description=(
        "Share of device memory kept free of the estimate; null: 0.1 unless margin_gib is set."))
    margin_gib: float | None = Field(None, ge=0, le=65536, description="Memory kept free, in GiB (instead of "
                                     "margin_fraction).")
    busbw_gbps: float | None = Field(None, gt=0, le=100_000, description=(
        "Bus bandwidth (GB/s, as nccl-tests reports busbw) the trials' collectives reach on the cluster they will "
        "run on, for `raybench rehearse` step times; it overrides the store's all-reduce probe and the nominal "
        "links of estimate.gpu (docs/rehearse.md). null: the probe, else the links."))
    prune: bool = Field(True, description=(
        "Mark trials whose estimated peak (calibrated by stored measurements) plus margin exceeds the device "
        "memory as skipped, with the estimate in their row, instead of running them."))


Mode = Literal["max", "min"]
# Metrics whose name says "smaller is better": times, memory, hours, losses. Everything else is maximized.
_MIN_SUFFIXES, _MIN_PREFIXES = ("_s", "_gib", "_hours"), ("loss_",)


def default_mode(metric: str) -> Mode:
    """max or min for a stored metric when the user does not say: times, memory and losses are minimized."""
    return "min" if metric.endswith(_MIN_SUFFIXES) or metric.startswith(_MIN_PREFIXES) else "max"


class SearchSpec(_Spec):
    """How the grid of `axes` is explored: every point, or points chosen one by one by a searcher."""

    algo: Literal["grid", "random", "optuna"] = Field("grid", description=(
        "grid runs every point; random draws points uniformly, never one twice; optuna chooses each next point "
        "with Optuna's TPE sampler, learning from every result, failed ones too."))
    metric: str | list[str] = Field("tok_per_s_per_device", description=(
        "Stored metric column to optimize, or a list of them for a multi-objective search (the result is a "
        "Pareto front), e.g. [tok_per_s_per_device, peak_reserved_gib]."))
    mode: Mode | list[Mode] | None = Field(None, description=(
        "max or min, one per metric; null: inferred from each name (*_s, *_gib, *_hours, loss_* are minimized)."))
    num_samples: int | None = Field(None, ge=1, le=1_000_000, description=(
        "Distinct grid points to evaluate (run, or answered from stored ok rows); null: the whole grid at most."))
    seed: int = Field(0, ge=0, description="Searcher seed: the same seed and store give the same points.")
    max_concurrent: int | None = Field(None, ge=1, le=100_000, description=(
        "Trials in flight at once (fewer lets the searcher learn from more results); null: as many as fit."))
    early_stop: int | None = Field(None, ge=1, le=1_000_000, description=(
        "Stop after this many evaluated points in a row without a better value (multi-objective: without a new "
        "point on the Pareto front); null: off."))

    def objectives(self) -> list[tuple[str, Mode]]:
        """(metric, mode) pairs, modes filled in from the metric names where not given."""
        metrics = [self.metric] if isinstance(self.metric, str) else list(self.metric)
        modes = self.mode if isinstance(self.mode, list) else [self.mode] * len(metrics)
        return [(m, mode or default_mode(m)) for m, mode in zip(metrics, modes)]


class SweepSpec(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", description="Sweep name (store partition).")
    description: str = Field("", description="Free text shown in reports.")
    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    axes: dict[str, list[Any]] = Field(default_factory=dict, description=(
        "Grid: dotted trial field -> values; or a bundle name -> list of {dotted field: value} mappings, each "
        "setting several fields together (one grid point per mapping)."))
    exclude: list[dict[str, Any]] = Field(default_factory=list, description="Grid points to drop (partial match).")
    executor: Literal["train", "pool", "torchrun"] = Field("train", description=(
        "How a trial's ranks are started: 'train' (new Ray Train workers per trial, any cluster), 'pool' (warm "
        "Ray actors reused across trials and sweeps: milliseconds per trial instead of seconds) or 'torchrun' "
        "(a torchrun per trial on the node of its Ray Tune driver; single-node)."))
    pool: PoolSpec = Field(default_factory=PoolSpec, description="Warm pool settings (executor: pool).")
    caches: CacheSpec = Field(default_factory=CacheSpec, description="Node-local weights and compile caches.")
    store: str = Field("./raybench-results", description="Result store directory (relative to the cwd).")
    repeats: int = Field(1, ge=1, le=100, description="Measurements per configuration.")
    search: SearchSpec = Field(default_factory=SearchSpec, description="Grid, random or Optuna search over the axes.")
    projection: ProjectionSpec = Field(default_factory=ProjectionSpec, description="Full-run cost projection.")
    estimate: EstimateSpec = Field(default_factory=EstimateSpec, description=(
        "Memory/step-time estimate and pruning of trials that would not fit."))

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
        if len({repr(v) for v in values}) != len(values):
            problems.append(Problem(where, values, "repeated values; list each value once (use repeats: for more)"))
        for i, value in enumerate(values):
            trial = copy_trial(base)
            assigned = axis_assignments(key, value)
            for path, leaf in assigned.items():
                set_path(trial, path, leaf)
            try:
                TrialConfig.model_validate(trial)
            except ValidationError as err:
                for p in problems_from_validation(err, TrialConfig):
                    for path in assigned:
                        if p.field == path or p.field.startswith(path + "."):
                            sub = p.field[len(key):] if "." in key else f".{p.field}"
                            problems.append(Problem(f"{where}[{i}]{sub}", value, p.message))
    for i, rule in enumerate(spec.exclude):
        for key in rule:
            if key not in spec.axes:
                problems.append(Problem(f"exclude[{i}].{key}", rule[key], "exclude keys must be axis keys"))
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
    problems = _check_axes(spec) + _check_paths(spec) + _check_search(spec) + _check_estimate(spec.estimate)
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
