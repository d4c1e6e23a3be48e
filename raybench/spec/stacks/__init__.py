"""The stack kinds (`stack.kind`): one descriptor per kind, the one place that says how a kind runs and which of
raybench's train fields it takes. The spec (the kinds `stack.kind` allows), the plan (a stack section's checks),
the rank (an in-process stack's trainer) and the drivers (which executor starts a trial, which trials take the
tokenized data) all read it here.

A kind's own code lives in two modules named here by their dotted names and imported on use, so that reading the
registry loads neither: its planning module (`problems(config)`, `mapped(config)`; a command-line kind also
`argv(config, python)` and `adapter_params(config, shape)`, None where its config does not say) and its runtime
module (`build(payload, ctx, probe)` for an in-process kind; the `python -m` launcher for a command-line kind).
docs/stacks/README.md, "Adding a stack kind".

The mapping tables are plain data: raybench's train field -> the stack's own keys it sets (() where the stack takes
the field without a key of its own, such as torchtune's strategy: fsdp2 only). Every set a planning module derives
(the keys it refuses in the stack's own settings, the fields it takes) is computed from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# raybench's own loop: the default kind, and the only one that is not a user's stack.
RAYBENCH = "raybench"


@dataclass(frozen=True)
class StackKind:
    """One `stack.kind`: how it runs and what of raybench's trial it takes."""

    name: str
    summary: str  # what trains, as stack.kind's description says it
    # Runs inside raybench's worker process (raybench's loop, a user's trainer built by the runtime module); else a
    # command line starts the trial's ranks (drivers/executors/command.py runs the planning module's argv).
    in_process: bool
    # Takes the data spec's tokenized data (data.source hf): raybench's loop, or a stack through its context.
    tokenized_data: bool
    # Runs in its own environment: stack.python must name that environment's interpreter.
    own_python: bool = False
    # A warm pool's actors can run it: raybench's own loop only (a user's stack needs fresh processes per trial).
    warm_pool: bool = False
    # raybench's own loop: its loss is raybench's to choose (train.loss auto), the estimate and the rehearsal
    # model it, its rows come from its ranks, and its CPU ranks get raybench's allocator settings.
    own_loop: bool = False
    # The model directory must hold safetensors weights; a command line that loads the model itself, in its own
    # format, needs only config.json (the row's parameter count and FLOPs).
    needs_weights: bool = True
    # raybench's train field -> the stack's own keys it sets (exact: the same quantity, the same units).
    mapped: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # raybench's train field the stack does not take -> the stack's own setting to use instead (named when the
    # field is refused).
    own_keys: dict[str, str] = field(default_factory=dict)
    planning: str | None = None  # dotted module name: the section's checks, the mapping per trial, the command line
    runtime: str | None = None  # dotted module name: the trainer on a rank (`build`), or a command-line launcher

    def set_keys(self) -> dict[str, str]:
        """The stack's keys raybench sets from its train fields -> the field that sets each ("train.steps")."""
        return {key: f"train.{name}" for name, keys in self.mapped.items() for key in keys}


_HF = StackKind(
    name="hf", summary="a transformers Trainer or TRL SFTTrainer", in_process=True, tokenized_data=True,
    mapped={
        "steps": ("max_steps",),
        "micro_batch": ("per_device_train_batch_size",),
        "grad_accum": ("gradient_accumulation_steps",),
        "lr": ("learning_rate",),
        "seed": ("seed",),
        "weight_decay": ("weight_decay",),
        "max_grad_norm": ("max_grad_norm",),  # null (no clipping) -> 0.0, the Trainer's own "off"
        "precision": ("bf16", "fp16"),  # fp32: both false; bf16: bf16; fp16: fp16 (accelerate's loss scaler)
        # SFTConfig only: TRL truncates (or packs) every sequence to max_length. With a plain Trainer the user's
        # collator decides the length, and the runtime refuses a batch longer than train.seq_len (docs/stacks/hf.md).
        "seq_len": ("max_length",),
        # Every decoder layer checkpointed or none: ac_ratio 0 or 1 only. Mapped, not left to the dataclass, because
        # SFTConfig checkpoints by default (TrainingArguments does not): the row's ac_ratio says what ran.
        "ac_ratio": ("activation_checkpointing", "gradient_checkpointing"),
    },
    own_keys={
        "strategy": "fsdp and fsdp_config, or deepspeed (a DeepSpeed config)",
        "tp_size": "parallelism_config, in the entry function",
        "zero_stage": "deepspeed (a DeepSpeed config)",
        "offload": "deepspeed (a DeepSpeed config)",
        "grad_scaler": "fp16 uses accelerate's loss scaler; it has no off switch",
        "finetune": "peft_config, passed to SFTTrainer in the entry function",
        "ac_mode": "activation_checkpointing_kwargs",
        "ac_saved_ops": "activation_checkpointing_kwargs",
        "compile": "torch_compile",
        "liger": "use_liger_kernel",
        "optimizer": "optim (adamw_torch, adamw_torch_fused, adafactor, sgd, ...)",
        "reshard_after_forward": "fsdp_config",
        "reduce_dtype": "fsdp_config (accelerate's FSDP2 mixed_precision_policy)",
        "fp8": "torchao's convert_to_float8_training on the model in the entry function",
    },
    planning="raybench.planning.stacks.hf", runtime="raybench.runtime.stacks.hf")

_LIGHTNING = StackKind(
    name="lightning", summary="a LightningModule and Lightning Trainer", in_process=True, tokenized_data=True,
    mapped={  # Lightning Trainer arguments (runtime/stacks/lightning.py); with data.source hf, seq_len too
        "steps": ("max_steps",),
        "grad_accum": ("accumulate_grad_batches",),
        "precision": ("precision",),  # fp32: 32-true, bf16: bf16-mixed, fp16: 16-mixed
        "max_grad_norm": ("gradient_clip_val",),  # clipped by norm; null: no clipping
        "seed": (),  # seed_everything(seed, workers=True) before the function runs
    },
    own_keys={
        "strategy": "stack.overrides.strategy: ddp, fsdp, deepspeed_stage_2 or deepspeed_stage_3",
        "zero_stage": "stack.overrides.strategy: deepspeed_stage_2 or deepspeed_stage_3",
        "micro_batch": "your function's DataLoader batch size, as one of its parameters (stack.overrides.batch_size)",
        "seq_len": "your function's sequence length, as one of its parameters (stack.overrides.seq_len); with "
                   "data.source hf, ctx.train_rows() takes train.seq_len",
        "lr": "your configure_optimizers, its rate one of your function's parameters (stack.overrides.lr)",
        "optimizer": "your LightningModule's configure_optimizers",
        "weight_decay": "your LightningModule's configure_optimizers",
        "compile": "torch.compile inside your LightningModule",
        "ac_ratio": "activation checkpointing inside your module (model.gradient_checkpointing_enable())",
        "finetune": "adapters inside your module (peft.get_peft_model)",
    },
    planning="raybench.planning.stacks.lightning", runtime="raybench.runtime.stacks.lightning")

_TORCHTUNE = StackKind(
    name="torchtune", summary="a torchtune recipe in its own environment (stack.python)", in_process=False,
    tokenized_data=False, own_python=True,
    mapped={  # torchtune config keys, set on the recipe's command line
        "steps": ("max_steps_per_epoch", "epochs"),  # with epochs=1
        "micro_batch": ("batch_size",),
        "grad_accum": ("gradient_accumulation_steps",),
        "seed": ("seed",),
        "lr": ("optimizer.lr",),
        "weight_decay": ("optimizer.weight_decay",),
        "max_grad_norm": ("clip_grad_norm",),
        "precision": ("dtype",),  # fp32 or bf16
        "seq_len": ("tokenizer.max_seq_len",),
        "compile": ("compile",),
        "ac_ratio": ("enable_activation_checkpointing",),  # '0': false, '1': true
        "reshard_after_forward": ("fsdp_reshard_after_forward",),
        "strategy": (),  # fsdp2 only: torchtune's distributed recipes shard with FSDP2
        "finetune": (),  # the recipe: lora_finetune_distributed is lora, full_finetune_distributed full
        # nested: train.lora.rank, alpha, dropout -> model.lora_rank, lora_alpha, lora_dropout (LoRA recipes)
    },
    own_keys={
        "tp_size": "tensor_parallel_plan and tensor_parallel_dim (full_finetune_distributed)",
        "zero_stage": "none: FSDP2 shards parameters, gradients and optimizer state",
        "offload": "fsdp_cpu_offload",
        "grad_scaler": "none: torchtune's distributed recipes refuse fp16",
        "ac_mode": "ac_mode and ac_option (full_finetune_distributed)",
        "ac_saved_ops": "none: torchtune checkpoints whole blocks",
        "liger": "loss._component_ (torchtune's chunked cross-entropy)",
        "optimizer": "optimizer._component_ (e.g. torch.optim.AdamW) and optimizer.fused",
        "compile_cache_dir": "train.env TORCHINDUCTOR_CACHE_DIR",
    },
    planning="raybench.planning.stacks.torchtune", runtime="raybench.runtime.stacks.torchtune_recipe")

_TORCHTITAN = StackKind(
    name="torchtitan", summary="torchtitan's trainer in its own environment (stack.python)", in_process=False,
    tokenized_data=False, own_python=True,
    mapped={  # torchtitan job config keys, set on its trainer's command line
        "steps": ("training.steps",),
        "micro_batch": ("training.local_batch_size",),
        "grad_accum": ("training.global_batch_size",),  # micro_batch x grad_accum x data-parallel ranks
        "seq_len": ("training.seq_len",),
        "seed": ("debug.seed",),
        "max_grad_norm": ("training.max_norm",),
        "precision": ("training.mixed_precision_param",),  # fp32: float32, bf16: bfloat16
        "compile": ("compile.enable",),
        "strategy": (),  # fsdp2 only: torchtitan shards with FSDP2
        "finetune": (),  # full only: torchtitan's trainer trains every weight
    },
    own_keys={
        "lr": "the config function's optimizer, e.g. default_adamw(lr=3e-4) (its param_groups' optimizer_kwargs)",
        "weight_decay": "the config function's optimizer, e.g. default_adamw(lr=..., weight_decay=0.1)",
        "optimizer": "the config function's optimizer (param_groups' optimizer_name, optimizer.implementation)",
        "ac_ratio": "the config function's activation_checkpoint: FullAC.Config(), SelectiveAC.Config() or None",
        "ac_mode": "the config function's activation_checkpoint: FullAC.Config() or SelectiveAC.Config()",
        "ac_saved_ops": "the config function's activation_checkpoint (SelectiveAC.Config)",
        "reshard_after_forward": "stack.overrides parallelism.fsdp_reshard_after_forward (default, always, never)",
        "reduce_dtype": "stack.overrides training.mixed_precision_reduce (torchtitan 0.3.0 takes float32 only)",
        "fp8": "the config function's model converters (torchtitan's float8 converter and its recipe)",
        "tp_size": "stack.overrides parallelism.tensor_parallel_degree",
        "offload": "stack.overrides training.enable_cpu_offload",
        "zero_stage": "none: FSDP2 shards parameters, gradients and optimizer state",
        "grad_scaler": "none: torchtitan trains in fp32 or bf16",
        "liger": "the config function's loss (ChunkedLossWrapper)",
        "compile_cache_dir": "train.env TORCHINDUCTOR_CACHE_DIR",
    },
    planning="raybench.planning.stacks.torchtitan", runtime="raybench.runtime.stacks.torchtitan_train")

# raybench's train fields a command can take, each as the {placeholder} of the same name in stack.command; the
# command takes one only where it uses its placeholder (planning.stacks.command.mapped).
_COMMAND_PLACEHOLDERS = ("steps", "micro_batch", "seq_len", "grad_accum", "lr", "seed", "precision")

_COMMAND = StackKind(
    name="command", summary="any command line, its ranks timed by the probe", in_process=False,
    tokenized_data=False,
    mapped={name: (f"{{{name}}}",) for name in _COMMAND_PLACEHOLDERS},
    # A train field the command does not use: the fix is to use its placeholder.
    own_keys={name: f"use {{{name}}} in stack.command" for name in _COMMAND_PLACEHOLDERS},
    needs_weights=False, planning="raybench.planning.stacks.command")

_RAYBENCH = StackKind(name=RAYBENCH, summary="raybench's own training loop", in_process=True, tokenized_data=True,
                      warm_pool=True, own_loop=True)

# Every kind, in the order stack.kind's description and refusals list them.
KINDS: dict[str, StackKind] = {k.name: k for k in (_RAYBENCH, _HF, _LIGHTNING, _TORCHTUNE, _TORCHTITAN, _COMMAND)}


def kind(name: str) -> StackKind:
    """The descriptor of a kind stack.kind allows."""
    return KINDS[name]


def user_kinds() -> list[str]:
    """The kinds that run a user's own stack (every kind but raybench's own loop)."""
    return [name for name in KINDS if name != RAYBENCH]
