"""The sweep spec: typed, frozen sections with one description per field (docs/sweep-reference.md is generated
from them). A sweep YAML has fixed sections (model, data, train, resources) that together form one trial's
config, plus `axes`: a grid over any trial field by dotted path, and the settings that are part of no trial
(`sweep_settings`). Checks that look across fields are in `validate`, files and YAML in `load`; cross-field rules
that need the expanded grid live in planning.plan.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, model_serializer

from raybench.spec import stacks
from raybench.spec.axes import axis_assignments
from raybench.spec.presets import PRESETS
from raybench.spec.section import Section
from raybench.spec.finetunes import FINETUNES, LORA, Finetune
from raybench.spec.options import OPTIONS, without_id_defaults
from raybench.spec.strategies import STRATEGIES, Strategy
from raybench.spec.sweep_settings import CacheSpec, EstimateSpec, PoolSpec, ProjectionSpec, SearchSpec
from raybench.spec.values import ENV_PREFIXES, MALLOC_MMAP_THRESHOLD, Ratio, check_env, check_saved_ops

TRIAL_SECTIONS = ("model", "data", "train", "resources", "stack")


class ModelSpec(Section):
    preset: Literal[tuple(PRESETS)] | None = Field(None, description="Built-in architecture, random weights.")
    path: str | None = Field(None, description="Local Hugging Face model directory (safetensors weights).")
    allow_pickle: bool = Field(False, description="Allow pickle (.bin/.pt) weights; unsafe, off by default.")
    trust_remote_code: bool = Field(False, description="Run a model directory's own Python code.")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] = Field(
        "sdpa", description=(
            "transformers attention kernel (flash_attention_2: CUDA and the flash-attn package; flex_attention: "
            "torch's FlexAttention, CUDA, packed rows masked by a block mask built from their position ids, no "
            "dense mask)."))
    missing_weights: Literal["error", "random"] = Field("error", description=(
        "A base weight that model.path's checkpoint lacks: error (the trial fails, naming the missing tensors) "
        "or random (initialized like a preset's). LoRA adapters are never in a checkpoint and are always random. "
        "Result rows hold null for error."))

    @model_serializer(mode="wrap")
    def _dump_without_default_missing_weights(self, handler) -> dict:
        # Trial ids hash the dumped config (plan.config_id): missing_weights came after ids were issued, so its
        # default is left out and every earlier trial keeps its id (stored rows, resumes).
        data = handler(self)
        if self.missing_weights == "error":
            data.pop("missing_weights", None)
        return data


class DataSpec(Section):
    source: Literal["synthetic", "json", "hf"] = Field("synthetic", description=(
        "Random tokens; json: alpaca-style JSON/JSONL tokenized in each trial; hf: local files or a saved dataset "
        "read with the datasets library and tokenized once per sweep into the store (docs/user-guide.md)."))
    path: str | None = Field(None, description=(
        "json: a JSON/JSONL file of instruction/input/output records; hf: a .jsonl/.json/.parquet/.arrow file, a "
        "directory of them (a downloaded dataset repository) or a directory written by save_to_disk."))
    tokenizer: str | None = Field(None, description="Local tokenizer directory; defaults to model.path.")
    packing: bool = Field(True, description=(
        "Several examples per sequence instead of one padded example each. json: examples concatenated and cut; "
        "hf: whole examples side by side, each with its own position ids and attending only to itself."))
    format: Literal["text", "messages", "alpaca"] = Field("text", description=(
        "hf: what a record holds: text (one text column), messages (a list of {role, content} turns rendered by "
        "the tokenizer's own chat template) or alpaca (instruction/input/output in the Alpaca prompt)."))
    field: str | None = Field(None, description=(
        "hf: the column holding the text or the messages; null: 'text' or 'messages'."))
    loss_on: Literal["all", "assistant"] = Field("all", description=(
        "hf: tokens the loss counts: all, or assistant (the assistant turns of messages, the response of alpaca)."))
    split: str = Field("train", description="hf: the split to read (a saved dataset of one split has no splits).")
    max_samples: int | None = Field(None, ge=1, description="hf: the first N records of the split only; null: all.")
    overflow: Literal["truncate", "drop", "split"] = Field("truncate", description=(
        "hf: a sample longer than train.seq_len is truncated (its tail dropped), dropped (left out whole), or "
        "split into seq_len-long pieces (the last one shorter), each laid out as a sample of its own: its first "
        "token unlabelled, its position ids from 0. json: truncate or drop (packed json data runs samples on "
        "across rows, so truncate cuts none there). What it cuts is in the row (samples_cut, tokens_cut, "
        "label_tokens_cut). Result rows hold null for truncate."))
    pack_order: Literal["in_order", "best_fit"] = Field("in_order", description=(
        "hf, packing: in_order fills rows in the data's order, a new row when the next sample does not fit; "
        "best_fit sorts samples longest first and puts each in the open row with the least room that holds it, "
        "else a new row (best-fit decreasing, TRL's bfd): usually fewer rows, less padding. Result rows hold null "
        "for in_order."))
    pad_to: Literal["seq_len", "longest"] = Field("seq_len", description=(
        "hf: how wide each micro-batch is: seq_len, or longest (its longest row's real tokens rounded up to "
        "data.pad_multiple, at most seq_len; transformers' padding='longest'), padded and packed rows alike. "
        "Result rows hold null for seq_len."))
    pad_multiple: int = Field(1, ge=1, le=1_048_576, description=(
        "hf, pad_to longest: round each micro-batch's width up to a multiple of this (transformers' "
        "pad_to_multiple_of), e.g. 64 for tensor-core friendly shapes; 1: no rounding (null in result rows)."))
    num_workers: int = Field(0, ge=0, le=64, description="torch DataLoader worker processes per rank.")
    pin_memory: bool = Field(False, description="Pin host memory of batches (GPU only).")
    prefetch_factor: int | None = Field(
        None, ge=1, le=1024, description="Batches each loader worker prepares ahead; needs num_workers > 0."
    )
    persistent_workers: bool = Field(True, description="Keep loader workers alive across epochs (num_workers > 0).")

    @model_serializer(mode="wrap")
    def _dump_hf_fields_for_hf_only(self, handler) -> dict:
        # Trial ids hash the dumped config (plan.config_id): the hf fields came after ids were issued, so other
        # sources leave them out and every earlier trial keeps its id (load refuses them set off their defaults).
        data = handler(self)
        # The layout fields came later still: left out at their defaults, so hf trials keep their ids too (and
        # json trials, which take overflow).
        at_default = [name for name in LAYOUT_FIELDS if getattr(self, name) == DataSpec.model_fields[name].default]
        if self.source == "hf":
            dropped = at_default
        elif self.source == "json":
            dropped = [name for name in HF_ONLY_FIELDS if name not in JSON_LAYOUT_FIELDS or name in at_default]
        else:
            dropped = HF_ONLY_FIELDS
        for name in dropped:
            data.pop(name, None)
        return data


# How the loader lays hf samples out in rows and batches (runtime.data): per trial, not part of the cache key.
LAYOUT_FIELDS = ("overflow", "pack_order", "pad_to", "pad_multiple")
HF_ONLY_FIELDS = ("format", "field", "loss_on", "split", "max_samples", *LAYOUT_FIELDS)
# Of those, the ones json data takes too (overflow: truncate or drop; data.json_rows.lay_out_json).
JSON_LAYOUT_FIELDS = ("overflow",)


# Module names shared by the Llama and Qwen2 families, per LoraSpec.targets.
LORA_TARGET_MODULES = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "attention_mlp": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "all_linear": "all-linear",  # PEFT's keyword: every linear layer except the output head
}


class LoraSpec(Section):
    rank: int = Field(16, ge=1, le=4096, description="LoRA rank r.")
    alpha: float = Field(32, gt=0, description="LoRA alpha (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "Dropout on the LoRA input, drawn again in backward rather than stored (as PEFT draws it: a mask per "
        "adapter)."))
    targets: Literal["attention", "attention_mlp", "all_linear"] = Field(
        "attention_mlp", description="Which linear layers get adapters."
    )
    base_dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description=(
        "finetune lora: the dtype the frozen base weights are stored in (adapters, their gradients and optimizer "
        "state stay fp32). auto: the compute dtype (train.precision), as frameworks keep a frozen base; fp32 "
        "keeps an fp32 copy of the base under bf16/fp16 compute (not with deepspeed, which casts the whole model "
        "to the compute dtype). Result rows hold the resolved dtype; null unless finetune is lora."))


class TrainSpec(Section):
    strategy: Literal[tuple(STRATEGIES)] = Field("ddp", description=(
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
    finetune: Literal[tuple(FINETUNES)] = Field("full", description=(
        "Train every weight, LoRA adapters only, or LoRA on a 4-bit bitsandbytes base (qlora: CUDA only)."))
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings (used when finetune=lora/qlora).")
    ac_ratio: Ratio = Field("0", description="Fraction of decoder blocks activation-checkpointed, e.g. '1/2'.")
    ac_mode: Literal["block", "op"] = Field("block", description=(
        "How a checkpointed block saves memory: block recomputes it whole (ac_ratio 1 = full AC); op keeps "
        "matmul and attention outputs and recomputes the rest (torchtitan's op-level selective AC), or keeps what "
        "train.ac_saved_ops lists."))
    ac_saved_ops: Annotated[list[str] | None, BeforeValidator(check_saved_ops)] = Field(None, description=(
        "ac_mode op: the operator outputs each checkpointed block keeps, the rest recomputed, as `raybench best "
        "--predict` prints an op-level policy: a name keeps every call (mm, sdpa for attention), name#k the k-th "
        "call from 0 in the block's forward (mul#2); null: torchtitan's policy."))
    master_weights: Literal["fp32", "none"] = Field("fp32", description=(
        "fp32: weights, gradients and optimizer state in fp32, computed in bf16 (mixed precision); none: all in bf16 "
        "(pure bf16: half the memory, no fp32 copy for small updates); bf16, full fine-tune, not deepspeed."))
    offload_activations: bool = Field(False, description=(
        "Keep what each decoder block saves for backward in pinned host memory until backward needs it (CUDA "
        "only; blocks not checkpointed; not with compile or tensor parallelism): GPU memory for host-link copies "
        "on the compute stream."))
    compile: bool = Field(False, description=(
        "torch.compile each decoder block (not with DeepSpeed ZeRO-3, whose per-module hooks split it)."))
    compile_cache_dir: str | None = Field(None, description=(
        "TORCHINDUCTOR_CACHE_DIR for this trial's workers (a warm cache skips recompiling); null: inductor's default."))
    liger: bool = Field(False, description="Patch the model with Liger Triton kernels (CUDA and liger-kernel only).")
    loss: Literal["auto", "chunked", "full"] = Field("auto", description=(
        "raybench's own loop: chunked, the cross-entropy chunked over the tokens, the head's and the loss's "
        "gradients made a chunk at a time so the whole fp32 logits never exist (the same loss and gradients to "
        "fp32 rounding); full, transformers' loss over the whole logits (faster where memory does not bind); auto, "
        "full where a GPU trial fits its device memory with it (estimate.gpu or device_memory_gib, less the "
        "margin), else chunked, also on CPU and where no device memory is known (a row says which ran). Chunked "
        "runs as full under liger (its own fused loss), deepspeed, precision fp16, and tensor parallelism with a "
        "vocabulary-split head (docs/user-guide.md, the loss)."))
    fp8: Literal["off", "tensorwise", "rowwise"] = Field("off", description=(
        "FP8 matmuls in the decoder's linear layers (torchao float8 training; its recipe names): tensorwise (one "
        "scale per tensor; with fsdp2 the weights are all-gathered in FP8) or rowwise (one scale per row). CUDA "
        "GPUs with FP8 tensor cores (H100, H200, B200, GB200, L40S), strategies ddp and fsdp2, with LoRA the "
        "frozen base linears only. MFU stays on the bf16 peak; the row's fp8_linears, fp8_linear_kinds_json and "
        "fp8_flops_frac say which matmuls ran in FP8. Result rows hold null for off."))
    optimizer: Literal["adamw", "adamw_foreach", "adamw_fused", "adafactor", "sgd"] = Field("adamw", description=(
        "adamw picks fused on CUDA and foreach elsewhere; adamw_foreach/adamw_fused force one; adafactor "
        "(torch.optim.Adafactor); sgd with momentum 0.9."))
    lr: float = Field(1e-5, gt=0, le=1, description="Learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="Decoupled weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping norm; null disables clipping.")
    reshard_after_forward: bool = Field(True, description="FSDP2: free gathered weights after forward.")
    reduce_dtype: Literal["fp32", "bf16"] = Field("fp32", description=(
        "FSDP2 and TP+FSDP2 with precision bf16: the dtype gradients are reduce-scattered in. fp32 sums exactly; "
        "bf16 moves half the bytes and rounds the sum (torchtitan's mixed_precision_reduce; DeepSpeed's bf16 "
        "reduces so too)."))
    seed: int = Field(0, ge=0, description="Seed for weights and synthetic data.")
    env: Annotated[dict[str, str], BeforeValidator(check_env)] = Field(default_factory=dict, description=(
        "Environment variables of this trial's worker processes, set when they start (warm pool: a group of "
        "actors per distinct environment), e.g. {NCCL_SOCKET_NTHREADS: '4'}; names must start with one of "
        f"{', '.join(ENV_PREFIXES)}. Also {MALLOC_MMAP_THRESHOLD}, which CPU trials of raybench's own loop get as "
        "131072 unless set here, and a user's stack only when set here (bytes; '' for none: docs/metrics.md, "
        "Memory)."))
    profile_steps: int = Field(0, ge=0, le=20, description=(
        "Training steps each rank runs under torch.profiler after the timed ones (0: none): the row's profile_* "
        "columns say where a step's time goes (matmul, attention, elementwise, optimizer, communication, idle). "
        "Never inside the timed window; raybench's own loop only (docs/metrics.md, Step profile)."))

    @model_serializer(mode="wrap")
    def _dump_for_trial_ids(self, handler, info) -> dict:
        # Trial ids hash the dumped config (config_id): the options added after ids were issued are left out at
        # the values the earlier trials ran with (spec/options.py), so every earlier trial keeps its id.
        data = handler(self)
        without_id_defaults(data, {o.name: getattr(self, o.name) for o in OPTIONS},
                            bool((info.context or {}).get("trial_id")))
        _dump_lora_base_dtype(data.get("lora"), self.lora_base_dtype)
        return data

    @property
    def lora_base_dtype(self) -> str | None:
        """The dtype of a LoRA trial's frozen base weights: lora.base_dtype, auto resolved to the compute dtype
        (train.precision); None unless finetune is lora (a full fine-tune trains fp32 weights, QLoRA's base is
        4-bit)."""
        if self.tuning is not LORA:
            return None
        return self.precision if self.lora.base_dtype == "auto" else self.lora.base_dtype

    @property
    def tuning(self) -> Finetune:
        """What the trial trains (spec/finetunes.py): every weight, adapters, adapters over a 4-bit base."""
        return FINETUNES[self.finetune]

    @property
    def parallelism(self) -> Strategy:
        """The strategy's facts (spec/strategies.py): what it shards, what it is wired for, whether it is traced."""
        return STRATEGIES[self.strategy]

    @property
    def tensor_parallel(self) -> bool:
        """Whether the strategy splits the blocks' projections over a TP group (tp, tp_fsdp2)."""
        return self.parallelism.tensor_parallel

    @property
    def fsdp2_sharded(self) -> bool:
        """Whether FSDP2 shards the parameters (fsdp2, tp_fsdp2). Its mixed-precision policy casts them to the
        compute dtype before each forward; ddp and tp keep fp32 weights and run forward under torch.autocast."""
        return self.parallelism.fsdp2

    def tp_sequence_parallel(self, tied_embeddings: bool) -> bool:
        """Whether tensor parallelism runs torchtitan's whole layout rather than splitting the blocks'
        projections only: sequence parallelism between the projections (norms and the residual stream split over
        the sequence), and the input embedding and LM head split over the vocabulary, the loss computed on the
        split logits (torch's loss_parallel). Not when the embedding and head share one weight, nor under Liger,
        whose Triton norm and fused head-and-loss kernels take whole tensors."""
        return self.tensor_parallel and not tied_embeddings and not self.liger

    def full_loss_reason(self, tied_embeddings: bool) -> str | None:
        """Why this trial's loss runs over the whole logits (None: it runs chunked, techniques/chunked_loss.py)."""
        if self.loss == "full":
            return "train.loss full"
        if self.liger:
            return "liger's fused linear cross-entropy"
        if self.parallelism.zero:
            return "deepspeed: ZeRO-3 gathers the head's weight only when the head itself runs"
        if self.precision == "fp16":
            return "fp16: gradients made in forward would underflow before loss scaling"
        if self.tp_sequence_parallel(tied_embeddings):
            return "tensor parallelism splits the head over the vocabulary (loss_parallel: 1/tp of the logits)"
        return None


# Every chunk of the chunked loss reads the whole head weight in each of its three matmuls: with fewer tokens than
# this they would be bound by that read, not by their arithmetic (at Llama-3's vocabulary on a 256-wide model,
# Liger's sizing alone gives chunks of 4 tokens, and a CPU step 7 times slower than the full loss's).
MIN_LOSS_CHUNK_ROWS = 1024


def loss_chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk of train.loss chunked: a power of two with about as many logits as the hidden states they
    come from (Liger's sizing), so a chunk's fp32 logits cost about what the head's fp32 input does; at least
    MIN_LOSS_CHUNK_ROWS."""
    chunks = -(-vocab // hidden)
    return max(1 << max(0, -(-rows // chunks) - 1).bit_length(), MIN_LOSS_CHUNK_ROWS)


def _dump_lora_base_dtype(lora: dict | None, resolved: str | None) -> None:
    """A trial's dump holds the resolved base dtype, so that auto and the dtype it stands for are one trial
    (one id). Full fine-tune and QLoRA trials leave it out: they have no such base, and keep the ids they had
    before the field existed."""
    if lora is None:  # a dump that excludes the section
        return
    lora.pop("base_dtype", None)
    if resolved is not None:
        lora["base_dtype"] = resolved


class ResourcesSpec(Section):
    workers: int = Field(1, ge=1, le=65536, description="Ranks per trial (one per GPU on GPU clusters).")
    cpus_per_worker: float = Field(1, gt=0, le=1024, description="CPUs reserved per rank.")
    gpus_per_worker: int = Field(0, ge=0, le=1, description="GPUs per rank: 1 on GPU clusters, 0 for CPU runs.")
    timeout_s: float = Field(3600, ge=1, le=7 * 86400, description=(
        "Wall-clock limit per trial, start-up included; a trial past it (a stuck collective, a deadlock) is "
        "killed, its resources freed and its row marked timeout. Also the torch.distributed collective timeout."))
    memory_limit_gib: float | None = Field(None, gt=0, le=65536, description=(
        "Host-memory cap per worker process (private memory, RLIMIT_DATA); an allocation past it fails and "
        "the trial is recorded as oom. null: no cap."))


class StackSpec(Section):
    """Who trains: raybench's own loop, or the user's own training stack measured by the same probe
    (docs/stacks/). Fields of `train` map onto a stack only where the mapping is exact (docs/stacks/)."""

    # The kinds and what each trains are the registry's (raybench.spec.stacks), in its order.
    kind: Literal[tuple(stacks.KINDS)] = Field(stacks.RAYBENCH, description="; ".join(
        f"{k.name}: {k.summary}" for k in stacks.KINDS.values()) + ".")
    entry: str | None = Field(None, description=(
        "hf: 'module:function' called as function(overrides, ctx) that returns the trial's Trainer or SFTTrainer; "
        "lightning: 'module:function' called with the overrides that are its parameters, returning a "
        "LightningModule and its DataLoader or LightningDataModule (docs/stacks/)."))
    config: str | None = Field(None, description=(
        "hf: a YAML or JSON file of TrainingArguments/SFTConfig keys, the base the overrides apply to; torchtune: "
        "the recipe's config file (copy a built-in one with `tune cp`); torchtitan: a Python file of job config "
        "functions returning a Trainer.Config, as torchtitan's config_registry.py files are."))
    recipe: str | None = Field(None, description=(
        "torchtune: the recipe, e.g. lora_finetune_distributed; torchtitan: the config function of stack.config "
        "(torchtitan's --config), e.g. llama3_tiny_cpu."))
    command: list[str] | None = Field(None, description=(
        "command: the argv to run, each item with {placeholders} filled from the trial: {python}, {workers}, "
        "{steps}, {micro_batch}, {seq_len}, {grad_accum}, {lr}, {seed}, {precision}, {model_path}, {data_path}, "
        "{sweep_dir} (the sweep file's directory) and every override key (docs/stacks/command.md)."))
    overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "The stack's own config keys for this trial (an axis such as stack.overrides.learning_rate sweeps one); "
        "checked against the stack's own schema before launch. {sweep_dir} in a text value is the sweep file's "
        "directory ({sweep_dir}/example-data/alpaca.json)."))
    python: str | None = Field(None, description=(
        "command, torchtune, torchtitan: the Python interpreter of the stack's own environment ({python} in a "
        "command); null: the one running raybench."))
    pythonpath: list[str] = Field(default_factory=list, description=(
        "hf, lightning: directories put before sys.path so that `entry`'s module imports."))


class TrialConfig(Section):
    """Everything that determines one trial's measurement; its hash is the trial id."""

    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    stack: StackSpec = Field(default_factory=StackSpec)

    @model_serializer(mode="wrap")
    def _dump_without_default_stack(self, handler) -> dict:
        # Trial ids hash the dumped config (plan.config_id): stacks came after ids were issued, so raybench's own
        # loop leaves the section out and every earlier trial keeps its id.
        data = handler(self)
        if data.get("stack") == StackSpec().model_dump(mode="json"):
            data.pop("stack")
        return data


def config_id(config: TrialConfig) -> str:
    """Stable content hash of a resolved trial config: same config, same id, on every run and machine."""
    dumped = config.model_dump(mode="json", context={"trial_id": True})  # fields added since, at their defaults, left out
    canonical = json.dumps(dumped, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class SweepSpec(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", description="Sweep name (store partition).")
    description: str = Field("", description="Free text shown in reports.")
    model: ModelSpec = Field(default_factory=ModelSpec)  # a preset or a path, here or set by an axis
    data: DataSpec = Field(default_factory=DataSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    stack: StackSpec = Field(default_factory=StackSpec, description=(
        "Who trains: raybench's own loop or the user's own stack (docs/stacks/)."))
    axes: dict[str, list[Any]] = Field(default_factory=dict, description=(
        "Grid: dotted trial field -> values; or a bundle name -> list of {dotted field: value} mappings, each "
        "setting several fields together (one grid point per mapping)."))
    exclude: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Grid points to drop (partial match): each rule maps axis keys to one of that axis's values, e.g. "
        "[{train.strategy: ddp, train.micro_batch: 8}]."))
    executor: Literal["auto", "train", "pool", "torchrun"] = Field("auto", description=(
        "How a trial's ranks are started: 'auto' (the default: 'pool' when every trial runs raybench's own "
        "loop, else 'train'), 'train' (new Ray Train workers per trial, any cluster), 'pool' (warm Ray actors "
        "reused across trials and sweeps: milliseconds per trial instead of seconds; warm rows equal fresh ones) "
        "or 'torchrun' (a torchrun per trial on the node of its Ray Tune driver; single-node)."))
    pool: PoolSpec = Field(default_factory=PoolSpec, description="Warm pool settings (executor: pool).")
    caches: CacheSpec = Field(default_factory=CacheSpec, description="Node-local weights and compile caches.")
    store: str = Field("./raybench-results", description="Result store directory (relative to the cwd).")
    repeats: int = Field(1, ge=1, le=100, description="Measurements per configuration.")
    search: SearchSpec = Field(default_factory=SearchSpec, description="Grid, random or Optuna search over the axes.")
    projection: ProjectionSpec = Field(default_factory=ProjectionSpec, description="Full-run cost projection.")
    estimate: EstimateSpec = Field(default_factory=EstimateSpec, description=(
        "Memory/step-time estimate and pruning of trials that would not fit."))

    def fresh_process_kinds(self) -> list[str]:
        """The stack kinds (the base's, any an axis sets) a warm pool cannot run (the registry's warm_pool), sorted."""
        kinds = {self.stack.kind}
        for key, values in self.axes.items():
            for value in values if isinstance(values, list) else []:
                assigned = axis_assignments(key, value) if "." in key or isinstance(value, dict) else {}
                kinds.add(assigned.get("stack.kind", self.stack.kind))
        return sorted(k for k in kinds if not (k in stacks.KINDS and stacks.kind(k).warm_pool))

    @property
    def runs_with(self) -> str:
        """The executor the trials run with: `executor`, or for auto the warm pool (no start-up per trial) unless
        a trial's stack needs fresh processes per trial, then Ray Train's."""
        if self.executor != "auto":
            return self.executor
        return "train" if self.fresh_process_kinds() else "pool"

    @property
    def executor_text(self) -> str:
        """runs_with as `raybench plan` says it: for auto, with why."""
        if self.executor != "auto":
            return self.executor
        if self.runs_with == "pool":
            return ("pool (auto: every trial runs raybench's own loop, on warm actors reused across trials; "
                    "executor: train starts fresh Ray Train workers per trial)")
        return "train (auto: a trial's stack needs fresh processes per trial)"

    def base_trial(self) -> dict:
        """The trial fields before any axis is applied, as plain data."""
        base = self.model_dump(mode="json", include=set(TRIAL_SECTIONS))
        # A trial's dump resolves lora.base_dtype (TrainSpec); the axes apply to what the sweep wrote, so that an
        # axis over precision or finetune resolves it again per grid point.
        base["train"]["lora"]["base_dtype"] = self.train.lora.base_dtype
        return base
