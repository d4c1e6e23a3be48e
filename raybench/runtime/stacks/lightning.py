"""Lightning as a trial: the user's function builds a LightningModule and its training data; raybench builds the
Lightning Trainer from the trial (docs/stacks/lightning.md) and times each optimizer step with the probe.

The ranks already share a process group (Ray Train or torchrun made it): Lightning joins it through a cluster
environment that reads the group (`_JoinedGroup`), and its strategies skip their own init_process_group when one
exists. Rows: no phases, no build peaks, no exposed communication (measure.py); MFU where the module holds a
transformers decoder.

A function that declares a `ctx` parameter gets a `LightningContext`: the trial, its rank, and raybench's tokenized
data (data.source hf) as raybench's loop trains on it (train_rows and data_collator, or the tokenized dataset).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass

import lightning
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer, seed_everything
from torch import nn

from raybench.runtime.data import NONPAD_TOKENS
from raybench.runtime.probe import StepCounter, StepProbe
from raybench.runtime.stacks.measure import StackData, StackRun
from raybench.runtime.strategies import RankContext
from raybench.spec.payload import TrialPayload
from raybench.spec.stacks.lightning import CONTEXT_PARAMETER, takes_context
from raybench.spec.sweep_spec import TrialConfig

# raybench's train.precision as Lightning's precision flag: autocast over fp32 weights (DeepSpeed: its own bf16/fp16
# engine), as raybench's own loop runs it.
PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
# The strategy a trial runs when stack.overrides.strategy is not set: raybench's own default.
DEFAULT_STRATEGY = "ddp"
# Lightning would validate every epoch and sanity-check before the first step: time spent outside training steps.
NO_VALIDATION = {"limit_val_batches": 0, "num_sanity_val_steps": 0}


@dataclass
class LightningContext:
    """What a user function that declares `ctx` gets besides its overrides."""

    config: TrialConfig  # the whole trial
    rank: int
    world_size: int
    device: torch.device
    data: StackData  # raybench's tokenized data (data.source hf): the three methods below

    def tokenized_dataset(self):
        """The data spec's tokenized `datasets.Dataset`, memory-mapped from the store's cache: input_ids, and
        assistant_masks for loss_on assistant."""
        return self.data.tokenized_dataset()

    def train_rows(self):
        """The trial's rows as raybench's loop lays them out (train.seq_len; data.packing, overflow, pack_order):
        a torch Dataset for your DataLoader, batched by data_collator()."""
        return self.data.train_rows()

    def data_collator(self):
        """raybench's loop's collate function (the DataLoader's collate_fn): input_ids, labels, and position_ids
        (packed) or attention_mask (padded)."""
        return self.data.data_collator()


class _JoinedGroup(ClusterEnvironment):
    """The ranks as the launcher made them: Lightning creates no process and reads its ranks from the group."""

    def __init__(self, ctx: RankContext, local_world_size: int):
        super().__init__()
        self._ctx = ctx
        self._local_world_size = local_world_size

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:  # read only when no process group exists yet, which never happens here
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "29500"))

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._ctx.world_size

    def set_world_size(self, size: int) -> None:
        pass  # fixed by the launcher's process group

    def global_rank(self) -> int:
        return self._ctx.rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._ctx.local_rank

    def node_rank(self) -> int:
        return self._ctx.rank // self._local_world_size


class _ProbeCallback(Callback):
    """Starts the probe when training starts and ends one probe step per optimizer step: Lightning calls
    on_train_batch_end once per micro-batch, and trainer.global_step advances when the optimizer stepped."""

    def __init__(self, probe: StepProbe, run: StackRun):
        self.probe = probe
        self.run = run
        self._steps_seen = 0
        # Lightning's outputs["loss"] is the micro-batch's loss divided by accumulate_grad_batches: their sum over
        # the step is the step's mean loss, as raybench's loop records it.
        self._counter = StepCounter()
        self._batch_nonpad = None  # the current batch's own NONPAD_TOKENS count

    def on_train_start(self, trainer, pl_module) -> None:
        self._steps_seen = trainer.global_step
        self.probe.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # raybench's collator counts a batch's real tokens itself (a packed row has no attention_mask). Lightning
        # hands this very dict, moved to the device, to training_step next: taken out here, it never reaches the
        # user's module.
        self._batch_nonpad = batch.pop(NONPAD_TOKENS, None) if isinstance(batch, dict) else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        tokens, nonpad, seq_len = batch_tokens(batch)
        if self._batch_nonpad is not None:
            nonpad = self._batch_nonpad
        self.run.seq_len = seq_len
        self._counter.add(tokens, nonpad)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._counter.add_loss(loss.detach().float())
        if trainer.global_step == self._steps_seen:
            return  # a micro-batch whose gradients wait for the next
        self._steps_seen = trainer.global_step
        self._counter.end_step(self.probe)


def batch_tokens(batch) -> tuple[int, torch.Tensor | int, int]:
    """(tokens, non-padding tokens, sequence length) of one micro-batch: a mapping with input_ids (and
    attention_mask when it pads), a tensor of token ids, or a tuple/list whose first item is one."""
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        ids = batch.get("input_ids")
        mask = batch.get("attention_mask")
    elif isinstance(batch, (tuple, list)) and batch:
        ids, mask = batch[0], None
    else:
        ids, mask = batch, None
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"the training batch holds no token ids raybench can count ({type(batch).__name__}); "
                        "yield a dict with input_ids (and attention_mask), or a tensor of token ids "
                        "(docs/stacks/lightning.md)")
    tokens = ids.numel()
    # A device tensor until the probe's step ends (after its synchronization): no sync per micro-batch.
    nonpad = mask.sum() if isinstance(mask, torch.Tensor) else tokens
    return tokens, nonpad, int(ids.shape[-1])


def user_kwargs(function, overrides: dict) -> dict:
    """The overrides that are the user function's own keyword parameters (the rest are Trainer arguments)."""
    params = inspect.signature(function).parameters
    trainer_params = inspect.signature(Trainer.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in overrides.items() if k not in trainer_params}
    return {k: v for k, v in overrides.items() if k in params}


def trainer_kwargs(payload: TrialPayload, ctx: RankContext, overrides: dict) -> dict:
    """The Trainer's arguments: raybench's mapped fields, the rank's layout, the trial's own Trainer overrides, and
    everything that would do work outside the timed steps (logging, checkpoints, validation) off."""
    config = payload.config
    train = config.train
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    if ctx.world_size % local_world_size:
        raise RuntimeError(f"Lightning needs the same number of ranks on every node; this trial has "
                           f"{ctx.world_size} ranks with {local_world_size} on this node")
    trainer_params = inspect.signature(Trainer.__init__).parameters
    own = {k: v for k, v in overrides.items() if k in trainer_params}
    strategy = own.pop("strategy", DEFAULT_STRATEGY)
    return {
        **NO_VALIDATION, **own,
        "accelerator": "gpu" if ctx.device.type == "cuda" else "cpu",
        "devices": local_world_size, "num_nodes": ctx.world_size // local_world_size,
        "strategy": strategy, "plugins": [_JoinedGroup(ctx, local_world_size)],
        "max_steps": train.steps, "accumulate_grad_batches": train.grad_accum,
        "precision": PRECISION[train.precision], "gradient_clip_val": train.max_grad_norm,
        "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False,
    }


def _decoder(module: LightningModule) -> nn.Module:
    """The transformers model the LightningModule trains, when it holds one and nothing else to train (its shape
    gives raybench's FLOP model, hence MFU); else the LightningModule itself."""
    total = sum(p.numel() for p in module.parameters())
    for child in module.modules():
        if child is not module and hasattr(getattr(child, "config", None), "num_hidden_layers"):
            return child if sum(p.numel() for p in child.parameters()) == total else module
    return module


def _versions(strategy: str) -> str:
    versions = [f"lightning {lightning.__version__}", f"torch {torch.__version__}"]
    if str(strategy).startswith("deepspeed"):
        versions.append(f"deepspeed {importlib.import_module('deepspeed').__version__}")
    return ", ".join(versions)


def build(payload: TrialPayload, ctx: RankContext, probe: StepProbe) -> StackRun:
    """Call the user's function and build the Lightning Trainer around what it returns."""
    stack = payload.config.stack
    module_name, _, name = stack.entry.partition(":")
    function = getattr(importlib.import_module(module_name), name)
    seed_everything(payload.config.train.seed, workers=True, verbose=False)  # the same weights on every rank
    arguments = user_kwargs(function, stack.overrides)
    stack_data = StackData(payload)
    if takes_context(inspect.signature(function).parameters):
        arguments[CONTEXT_PARAMETER] = LightningContext(config=payload.config, rank=ctx.rank,
                                                        world_size=ctx.world_size, device=ctx.device, data=stack_data)
    module, data = _module_and_data(function(**arguments), stack.entry)
    kwargs = trainer_kwargs(payload, ctx, stack.overrides)

    def train() -> None:
        trainer.fit(module, data)  # fit takes a LightningDataModule in the DataLoader's place

    run = StackRun(train=train, model=_decoder(module), version=_versions(kwargs["strategy"]), data=stack_data)
    trainer = Trainer(**kwargs, callbacks=[_ProbeCallback(probe, run)])
    return run


def _module_and_data(built, entry: str) -> tuple[LightningModule, object]:
    """(module, train DataLoader or LightningDataModule) from what the user's function returned."""
    if isinstance(built, (tuple, list)) and len(built) == 2 and isinstance(built[0], LightningModule):
        module, data = built
        if isinstance(data, LightningDataModule) or hasattr(data, "__iter__"):
            return module, data
    raise TypeError(f"stack.entry {entry} returned {type(built).__name__}; it must return (LightningModule, "
                    "train DataLoader) or (LightningModule, LightningDataModule) (docs/stacks/lightning.md)")
