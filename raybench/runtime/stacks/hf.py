"""The hf stack on one rank: a transformers Trainer or a TRL SFTTrainer with raybench's probe hooked in.

The trial's arguments (SFTConfig, or TrainingArguments without TRL) are the stack's config file, its overrides
and raybench's mapped train fields (spec.stacks.hf.trial_args), with a temporary output directory and the
trial's device. The trainer comes from the user's entry function, `function(overrides, ctx)` with ctx a
`StackContext`, or, with a config file alone, raybench builds an SFTTrainer on model.path and the data spec's
tokenized data. The context hands out raybench's tokenized data (data.source hf): the cached per-sample dataset
(what an SFTTrainer takes pre-tokenized), or the very rows and collate function raybench's loop trains on.

The probe sees each optimizer step through two hooks: a TrainerCallback starts it when training begins and ends a
step at each on_step_end, and a thin wrapper around the trainer's `training_step` counts the tokens of each
micro-batch (input_ids, padding included; the batch's own NONPAD_TOKENS count, else attention_mask, for the real
ones) and adds up the losses it returns, which the Trainer has already divided over the accumulation steps: their sum
is the step's loss as the Trainer logs it.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raybench.runtime.data import NONPAD_TOKENS
from raybench.runtime.probe import StepCounter, StepProbe
from raybench.runtime.stacks.measure import StackData, StackRun
from raybench.runtime.strategies import RankContext
from raybench.spec.payload import TrialPayload
from raybench.spec.stacks import hf as hf_args
from raybench.spec.sweep_spec import TrialConfig


@dataclass
class StackContext:
    """What an entry function gets besides the trial's overrides: build the trainer with `args`."""

    args: Any  # the trial's SFTConfig (TrainingArguments without TRL): pass it to the trainer as it is
    config: TrialConfig  # the whole trial
    rank: int
    world_size: int
    device: torch.device
    model_path: str | None = None  # model.path
    data_path: str | None = None  # data.path (None: the entry brings its own data)
    seq_len: int = 0  # train.seq_len: no sequence may be longer (SFTConfig's max_length)
    data: StackData | None = None  # raybench's tokenized data (data.source hf): the three methods below

    def tokenized_dataset(self):
        """The data spec's tokenized `datasets.Dataset`, memory-mapped from the store's cache: input_ids, and
        assistant_masks for loss_on assistant. An SFTTrainer takes it as it is (pre-tokenized)."""
        return self._data().tokenized_dataset()

    def train_rows(self):
        """The trial's rows as raybench's loop lays them out (train.seq_len; data.packing, overflow, pack_order):
        a torch Dataset whose items the data_collator() turns into batches."""
        return self._data().train_rows()

    def data_collator(self):
        """raybench's loop's collate function: input_ids, labels, and position_ids (packed) or attention_mask
        (padded); pass it with train_rows() to a plain Trainer."""
        return self._data().data_collator()

    def _data(self) -> StackData:
        if self.data is None:
            raise ValueError("this StackContext was built without the trial's data (StackContext.data is None); "
                             "raybench builds it with StackData(payload)")
        return self.data

    def load_model(self):
        """model.path as raybench loads it for the config path: fp32 weights (autocast computes in the trial's
        precision), model.attn_implementation, model.trust_remote_code."""
        from transformers import AutoModelForCausalLM

        model = self.config.model
        return AutoModelForCausalLM.from_pretrained(
            model.path, dtype=torch.float32, attn_implementation=model.attn_implementation,
            trust_remote_code=model.trust_remote_code)

    def load_tokenizer(self):
        """data.tokenizer, else model.path's tokenizer."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.config.data.tokenizer or self.config.model.path,
                                             trust_remote_code=self.config.model.trust_remote_code)

    def load_dataset(self):
        """data.path's records as a datasets.Dataset with a `text` or `messages` column (data.format; data.field
        names the column where it is another)."""
        from datasets import Dataset

        if self.data_path is None:
            raise ValueError("ctx.load_dataset() reads data.path, which this trial does not set (data.source: hf, "
                             "data.path: a .jsonl or .json file)")
        path = Path(self.data_path)
        text = path.read_text()
        records = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines()
                                                                     if line.strip()]
        column = "messages" if self.config.data.format == "messages" else "text"
        source = self.config.data.field or column
        return Dataset.from_list([{column: record[source]} for record in records])


class _Batches:
    """The micro-batches the wrapped training_step sees: each one's tokens into the step's counter, its length
    checked and remembered."""

    def __init__(self, limit_seq_len: int | None):
        self.limit_seq_len = limit_seq_len  # refuse longer sequences (a plain Trainer: the user's collator sets it)
        self.seq_len: int | None = None  # the longest sequence seen (tokens per row of input_ids)
        self.counter = StepCounter()  # the Trainer's losses are already divided over the accumulation steps

    def add(self, inputs: dict) -> None:
        # raybench's collator counts a batch's real tokens itself (a packed row has no attention_mask): taken out
        # here, in the dict the model is called with, so that it never reaches the model.
        nonpad = inputs.pop(NONPAD_TOKENS, None)
        input_ids = inputs.get("input_ids")
        if input_ids is None:
            raise ValueError(f"the hf stack counts tokens from the batches' input_ids; this batch has only "
                             f"{sorted(inputs)}")
        length = int(input_ids.shape[-1])
        if self.limit_seq_len is not None and length > self.limit_seq_len:
            raise ValueError(f"a batch holds sequences of {length} tokens, longer than train.seq_len="
                             f"{self.limit_seq_len}: truncate to ctx.seq_len in the entry's data collator")
        self.seq_len = max(self.seq_len or 0, length)
        mask = inputs.get("attention_mask")
        if nonpad is None:
            nonpad = mask.sum() if mask is not None else input_ids.numel()
        self.counter.add(input_ids.numel(), nonpad)


def build(payload: TrialPayload, ctx: RankContext, probe: StepProbe) -> StackRun:
    config = payload.config
    _distributed_env(ctx)
    output_dir = tempfile.mkdtemp(prefix="raybench-hf-")  # nothing is saved there (save_strategy no)
    try:
        context = _context(payload, ctx, output_dir)
        trainer = _trainer(config, context)
        _check_args(trainer, config, context.args)
    except BaseException:
        shutil.rmtree(output_dir, ignore_errors=True)
        raise
    batches = _Batches(None if _is_sft(trainer) else config.train.seq_len)
    _hook_probe(trainer, probe, batches, checkpointed=config.train.ac_ratio == "1")
    run = StackRun(train=lambda: None, model=trainer.model, version=_version(trainer), data=context.data)

    def train() -> None:
        try:
            trainer.train()
        finally:
            shutil.rmtree(output_dir, ignore_errors=True)
        steps = len(probe.record.step_times_s)
        if steps != config.train.steps:
            raise RuntimeError(f"the trainer ran {steps} optimizer step(s), not train.steps={config.train.steps}: "
                               "its data ran out or a callback stopped it early")
        # FLOPs per token take the sequence length: TRL keeps every sequence (packed or not) within max_length.
        run.seq_len = min(batches.seq_len, config.train.seq_len) if batches.seq_len else None

    run.train = train
    return run


def _distributed_env(ctx: RankContext) -> None:
    """accelerate (under the Trainer) finds the process group raybench joined from the torchrun variables: Ray
    Train and torchrun set them; a launcher that did not gets them from the group itself."""
    os.environ.setdefault("RANK", str(ctx.rank))
    os.environ.setdefault("WORLD_SIZE", str(ctx.world_size))
    os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    # accelerate asks for a rendezvous address on several CPU nodes even when the group exists (it never dials it).
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


def _context(payload: TrialPayload, ctx: RankContext, output_dir: str) -> StackContext:
    config = payload.config
    cls = hf_args.args_class()
    fields = set(hf_args.field_types(cls))
    args = cls(**hf_args.trial_args(config, fields), output_dir=output_dir, use_cpu=ctx.device.type != "cuda")
    return StackContext(args=args, config=config, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device,
                        model_path=config.model.path, data_path=config.data.path, seq_len=config.train.seq_len,
                        data=StackData(payload))


def _trainer(config: TrialConfig, context: StackContext):
    """The entry function's trainer, or raybench's SFTTrainer for a config file alone."""
    from transformers import Trainer, set_seed

    set_seed(config.train.seed)  # the entry's own initialization (LoRA adapters, a new head) is the trial's
    if config.stack.entry is None:
        from trl import SFTTrainer

        return SFTTrainer(model=context.load_model(), args=context.args, train_dataset=context.tokenized_dataset(),
                          processing_class=context.load_tokenizer())
    module_name, _, function = config.stack.entry.partition(":")
    trainer = getattr(importlib.import_module(module_name), function)(dict(config.stack.overrides), context)
    if not isinstance(trainer, Trainer):
        raise TypeError(f"stack.entry {config.stack.entry} returned {type(trainer).__name__}; it must return a "
                        "transformers Trainer or a TRL SFTTrainer built with ctx.args")
    return trainer


def _check_args(trainer, config: TrialConfig, args) -> None:
    """The trainer runs the trial's arguments on every rank of the trial: an entry that built its own would
    measure something else, and a rank that missed the process group would train alone on the whole data."""
    if trainer.args.world_size != config.resources.workers:
        raise RuntimeError(f"the Trainer sees {trainer.args.world_size} process(es), the trial has "
                           f"{config.resources.workers}: accelerate did not join the trial's process group")
    keys = [*hf_args.mapped_values(config, set(vars(args))), "save_strategy", "eval_strategy", "report_to"]
    for key in keys:
        if getattr(trainer.args, key, None) != getattr(args, key):
            raise ValueError(f"the entry's trainer has {key}={getattr(trainer.args, key, None)!r}, the trial "
                             f"{getattr(args, key)!r}: build the trainer with ctx.args (docs/stacks/hf.md)")


def _is_sft(trainer) -> bool:
    """A TRL trainer (SFTTrainer or a subclass of it): it holds every sequence to max_length itself."""
    return any(c.__module__.startswith("trl.") for c in type(trainer).__mro__)


def _check_checkpointing(model, args, checkpointed: bool) -> None:
    """The layers checkpoint as train.ac_ratio says, whatever the trainer, TRL or the entry did: the row's ac_ratio
    is what ran. transformers' layers say it in their own `gradient_checkpointing` flag (a model without one is
    not checked)."""
    flags = [m.gradient_checkpointing for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing",
                                                                                     None), bool)]
    if flags and any(flags) != checkpointed:
        keys = ", ".join(f"{key}={getattr(args, key)}" for key in ("activation_checkpointing", "gradient_checkpointing")
                         if hasattr(args, key))
        raise ValueError(f"the trainer {'checkpoints' if any(flags) else 'does not checkpoint'} the model's layers "
                         f"but train.ac_ratio is {'1' if checkpointed else '0'} (its arguments: {keys}): set "
                         "train.ac_ratio, and do not turn checkpointing on or off in the entry")


def _hook_probe(trainer, probe: StepProbe, batches: _Batches, checkpointed: bool) -> None:
    """Start the probe when training begins (once the layers checkpoint as the trial says), end a step at each
    optimizer step, and count each micro-batch."""
    from transformers import TrainerCallback

    class ProbeCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            _check_checkpointing(kwargs["model"], args, checkpointed)
            probe.start()  # the model wrapped, the optimizer built: the next thing is the first step's batches

        def on_step_end(self, args, state, control, **kwargs):
            batches.counter.end_step(probe)

    original = trainer.training_step

    def training_step(*args, **kwargs):
        batches.add(args[1] if len(args) > 1 else kwargs["inputs"])
        loss = original(*args, **kwargs)
        batches.counter.add_loss(loss)
        return loss

    trainer.training_step = training_step
    trainer.add_callback(ProbeCallback())


def _version(trainer) -> str:
    """transformers, and TRL and PEFT where this trainer uses them."""
    import transformers

    parts = [f"transformers {transformers.__version__}"]
    if _is_sft(trainer):
        import trl

        parts.append(f"trl {trl.__version__}")
    if type(trainer.model).__module__.startswith("peft."):
        import peft

        parts.append(f"peft {peft.__version__}")
    return ", ".join(parts)
