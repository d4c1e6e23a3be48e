"""Run a user's stack on this rank with the probe hooked in, and reduce every rank's record into the row.

The same clocks as raybench's own loop (`worker`): peaks over the training window (the stack's trainer built, to
its last step), steps between device synchronizations, the timed window after train.warmup_steps, the slowest
rank's setup; the same reduction (`rank_metrics`). What only raybench's loop knows is null (phases, the build's own
peaks, weights-cache columns, the exposed communication).

`StackData` hands a stack raybench's tokenized data (data.source hf) as raybench's loop takes it; the row's data
columns describe the trial only when every rank's entry took it (the result's `data_taken`: "rows", or "samples"
when the stack laid out its own rows, which leaves the packing efficiency null).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from raybench.runtime import (data, fingerprint, limits, provenance, rank_memory, rank_metrics, rank_progress,
                              warm_up)
from raybench.runtime.probe import StepProbe, param_counts
from raybench.runtime.rank_metrics import RankMeasurement, TrialFacts
from raybench.runtime.sampler import Sampler
from raybench.runtime.strategies import RankContext
from raybench.spec import metrics, tokenized_data
from raybench.spec.hardware import peak_tflops
from raybench.spec.payload import TrialPayload
from raybench.spec.schema import GIB, DataTaken, RankResult
from raybench.spec.tokenized_data import TokenizedData


class StackData:
    """raybench's tokenized data for a user's stack: the cached `datasets.Dataset`, and the trial's rows and collate
    function exactly as raybench's loop builds them (`data.hf_rows`: truncation, padding or packing, labels,
    position ids). Remembers what the entry took (`used`): the samples alone ("samples": the stack lays out its
    own rows, so the row's packing efficiency, which is raybench's layout, does not apply) or raybench's rows
    ("rows"); None: neither, and no data column applies."""

    def __init__(self, payload: TrialPayload):
        self.config = payload.config
        self.ref = payload.tokenized  # None: the sweep's driver did not tokenize it (data.require_tokenized)
        self.used: str | None = None
        self._rows = None

    def tokenized_dataset(self):
        """The cached per-sample dataset, memory-mapped: input_ids, and assistant_masks for loss_on assistant."""
        dataset = tokenized_data.load(self._ref().path)  # imports datasets offline (tokenized_data.offline_datasets)
        import datasets

        self.used = self.used or "samples"
        # A stack's own map over it (TRL's labels and truncation) would write its results next to the cached
        # files, into the store's cache that every trial shares: keep them in temporary files instead.
        datasets.disable_caching()
        return dataset

    def train_rows(self):
        """The trial's rows (`data.TokenRows`): row r holds the samples raybench's loop puts in row r."""
        return self._hf_rows()[0]

    def data_collator(self):
        """The collate function of raybench's loop: a list of rows -> a batch dict of tensors, with its non-padding
        token count under data.NONPAD_TOKENS (an int the probe takes out before the model sees the batch)."""
        return self._hf_rows()[1]

    def _ref(self) -> TokenizedData:
        config = self.config
        if config.data.source != "hf":
            raise ValueError(f"raybench's tokenized data needs data.source: hf (this trial has "
                             f"{config.data.source!r}); set data.source: hf and data.path, or load your own data")
        return data.require_tokenized(self.ref)

    def _hf_rows(self):
        if self._rows is None:
            self._rows = data.hf_rows(self.config, self._ref())
        self.used = "rows"
        return self._rows


@dataclass
class StackRun:
    """A stack's trainer, built for one trial with the probe hooked in."""

    train: Callable[[], None]  # runs the training to its last step (Trainer.train, Lightning's fit)
    model: nn.Module  # the model as the user built it, before any wrapping (parameter counts, FLOPs)
    version: str  # the stack's libraries and their versions, for the row's stack_version
    seq_len: int | None = None  # tokens per sequence, as the stack's callback last saw them (for FLOPs)
    data: StackData | None = None  # raybench's data, as the stack's context offered it


# build(payload, ctx, probe) -> StackRun: the stack's module (hf, lightning) builds its trainer.
Build = Callable[[TrialPayload, RankContext, StepProbe], StackRun]


def measured_run(payload: TrialPayload, build: Build) -> RankResult | None:
    """Build and run the stack; rank 0 returns the result, the other ranks None."""
    t_start = time.perf_counter()
    config = payload.config
    _import_path(config.stack.pythonpath)
    held_gib = rank_memory.held_from_earlier_trials_gib()
    limits.apply_memory_limit(config.resources.memory_limit_gib, int(held_gib * GIB))
    ctx = warm_up.init_distributed(config, timeout_s=config.resources.timeout_s)
    hostnames, busbw = provenance.hostnames_and_busbw(payload, ctx)
    nccl = provenance.transport_check(ctx, hostnames)
    limits.release_free_heap()
    _, file_at_reset_gib = rank_memory.reset_peaks(ctx.device)
    gpu_held_gib = rank_memory.gpu_allocated_gib(ctx.device)
    probe = StepProbe(ctx.device)
    sampler = Sampler(ctx.device.index if ctx.device.type == "cuda" else None)
    # How far this rank gets, for a timeout row (rank_progress.describe): slow or hung, as raybench's own loop.
    marks = rank_progress.Marks(payload.cache_dir, payload.trial_id, ctx.rank, config.train.steps)
    marks.reached("build")

    def on_step() -> None:
        sampler.tick()
        marks.step(probe.record.step_times_s[-1])

    probe.on_step = on_step
    run = build(payload, ctx, probe)
    marks.reached("first step")
    params_total, params_trainable = param_counts(run.model)
    run.train()
    sampler.close()
    if params_total == 0:  # built in the trainer's own hook (Lightning's configure_model): count it trained
        params_total, params_trainable = param_counts(run.model)
    record = probe.record
    if len(record.step_times_s) <= config.train.warmup_steps:
        raise RuntimeError(f"the stack ran {len(record.step_times_s)} step(s) on rank {ctx.rank}, no more than "
                           f"train.warmup_steps={config.train.warmup_steps}: no step was timed")
    measured = RankMeasurement(
        loop=record, sampled=sampler.means(since=record.step_starts[config.train.warmup_steps]),
        peaks=rank_memory.peaks(ctx.device, held_gib, file_at_reset_gib, gpu_held_gib), build_peaks=None,
        rss_before_build_gib=None, host_held_gib=held_gib, model_build_s=None, wrap_s=None,
        time_to_first_step_s=record.step_starts[0] + record.step_times_s[0] - t_start)
    reduced = rank_metrics.reduce_ranks(measured, tp_size=1, warmup_steps=config.train.warmup_steps)
    data_taken = _taken_on_every_rank(run.data.used if run.data is not None else None)
    if ctx.rank != 0:
        return None
    hardware = fingerprint.hardware(ctx.device)
    facts = TrialFacts(
        train=config.train, world_size=ctx.world_size, dp_size=ctx.world_size, params_total=params_total,
        params_trainable=params_trainable, flops_per_token=_flops_per_token(run, params_total, params_trainable),
        peak_tflops=peak_tflops(hardware["gpu_name"], config.train.precision), comm_exposed_p50_s=None,
        weights_cache=None, weights_copy_s=None, worker_wall_s=time.perf_counter() - t_start,
        process_trial_index=payload.process_trial_index)
    return rank_metrics.rank_result(reduced, facts, provenance.columns(config, ctx, hostnames, busbw, hardware, nccl),
                                    stack_version=run.version, data_taken=data_taken)


def _taken_on_every_rank(used: str | None) -> DataTaken | None:
    """What every rank's entry took of raybench's data (StackData.used): "rows" where all took the rows,
    "samples" where all took at least the samples, else None (a collective: every rank calls it)."""
    taken = [None] * dist.get_world_size()
    dist.all_gather_object(taken, used)
    if None in taken:
        return None
    return "rows" if set(taken) == {"rows"} else "samples"


def _import_path(directories: list[str]) -> None:
    """stack.pythonpath before sys.path, so that the stack's `module:function` imports."""
    for directory in reversed(directories):
        path = os.path.abspath(directory)
        if path not in sys.path:
            sys.path.insert(0, path)


def _flops_per_token(run: StackRun, params_total: int, params_trainable: int) -> float | None:
    """raybench's FLOP model (spec.metrics) where the model is a transformers decoder whose shape its config
    gives and the stack saw the sequence length; None otherwise (MFU unknown)."""
    shape = getattr(run.model, "config", None)
    names = ("hidden_size", "num_hidden_layers", "vocab_size")
    if run.seq_len is None or shape is None or not all(isinstance(getattr(shape, n, None), int) for n in names):
        return None
    tied = bool(getattr(shape, "tie_word_embeddings", False))
    matmul = metrics.matmul_params(params_total, shape.vocab_size, shape.hidden_size, tied)
    return metrics.flops_per_token(matmul, params_trainable, params_trainable == params_total,
                                   shape.num_hidden_layers, run.seq_len, shape.hidden_size)
