"""One training step of a trial, traced as one rank of its full world: fake storage, torch's fake process group,
torch's memory trackers, every collective and every operator's roofline cost.

Known correction: under an active FakeTensorMode, DTensor's sharding propagation runs each op once more on
fake tensors of the *global* shape, in the same fake mode, so torch's trackers count those phantom tensors as
real (issue 16 reports ~825 GiB of "optimizer state" for a 72B model's AdamW step instead of ~8.5; the unit
test reproduces the mechanism on a foreach op). `Propagation` marks
those calls through ShardingPropagator's `_fake_mode_lock` hook and the tracker skips them.

The trace's pieces: `traced_model` builds the trial as traced, `step_tracker` watches the step's memory and
hands every operator to `step_costs`; this module wraps the model as the trial's strategy does and runs the step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from fractions import Fraction

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from raybench.rehearse.fake_world import fake_allreduce_hook, fake_mode, marking_propagation, one_sequence_per_row
from raybench.rehearse.fitted import SHIPPED_CALIBRATION, Calibration
from raybench.rehearse.roofline import gpu_roofline
from raybench.rehearse.traced_model import (
    build_traced,
    fake_batches,
    liger_rope,
    steady_state_ddp_buckets,
    traced_train,
)
from raybench.rehearse.worlds import MemoryEvents, Sharding, fsdp_sharding
from raybench.runtime import bench, strategies
from raybench.runtime.build import fill
from raybench.runtime.materialize import to_empty_keeping_ties
from raybench.runtime.strategies import RankContext
from raybench.spec.presets import ModelShape
from raybench.spec.schema import GIB
from raybench.spec.sweep_spec import TrainSpec, TrialConfig

@dataclass
class StepTrace:
    """What one traced step did on this rank: memory at its peak, collectives, operator costs."""

    memory_gib: dict[str, float]  # at the step's peak, by step_tracker.CATEGORIES
    resident_gib: dict[str, float]  # parameters and optimizer state held after the step (this rank's storage)
    comm_bytes: dict[str, int]  # per step, by collective (the tensor each one moves, as nccl-tests sizes it)
    comm_calls: dict[str, int]
    overlapped_comm: tuple[str, ...]  # collectives the strategy issues next to compute (FSDP, DDP buckets)
    flops: float  # FLOPs of every operator the flop counter knows (matmuls, attention)
    roofline_s: float  # sum over operators of max(FLOPs / peak, bytes / bandwidth); 0 without a GPU row
    compute_s: float  # the FLOP part alone (sum of FLOPs / peak)
    memory_s: float  # the bytes part alone (sum of bytes / bandwidth)
    op_s: dict[str, float] = field(default_factory=dict)  # roofline seconds by operator
    # Roofline seconds of the FLOP-less (elementwise, reduction, copy) operators run inside decoder blocks, in
    # forward, backward or recomputation: what torch.compile fuses into its generated kernels.
    block_memory_bound_s: float = 0.0
    # One decoder block's operators (`block_ops`), for op-level policies: fully checkpointed FSDP2 GPU trials.
    block_ops: dict | None = None
    grad_accum: int = 1  # micro-batches the step runs: the times and collectives above cover all of them
    traced_micro_batches: int = 1  # how many of them the trace ran (`traced_accumulation`); the rest are scaled
    optimizer_roofline_s: float = 0.0  # the part of roofline_s run once per step (clipping, optimizer, zero_grad)
    launches: int = 0  # operators that run a kernel (`Roofline.launches_kernel`), collectives apart: host work
    # Memory by step_tracker.CATEGORIES at each place's own highest point (`step_tracker.place_of`), and the memory
    # in use as each block's backward began, by (part, block): what a deeper model's peak is extrapolated from
    # (depth.py).
    place_gib: dict[str, dict[str, float]] = field(default_factory=dict)
    backward_entry_gib: dict[tuple[int, int], float] = field(default_factory=dict)
    # The step as its two streams see it, for the overlap of collectives with compute (step_time.exposed_s): each
    # traced part's events (`step_costs.PartCosts.events`) with the number of times the step runs that part. A
    # deep model's is a linear combination of its shallow models' (depth.py), so weights need not be whole or
    # positive.
    timeline: list[tuple[float, list]] = field(default_factory=list)
    # Where the trace was asked to (record_events): the memory after every operator, and how FSDP2 sharded the
    # model; what worlds.py shares the step across world sizes from.
    memory_events: MemoryEvents | None = None
    sharding: Sharding | None = None
    # Where the trace was asked to (second_dp): the step at that FSDP2 group size, from this trace (shards.py).
    second: StepTrace | None = None

    @property
    def peak_gib(self) -> float:
        return sum(self.memory_gib.values())


def traced_accumulation(grad_accum: int) -> tuple[int, list[int]]:
    """How many micro-batches the trace runs for a step of `grad_accum`, and how many of the step's micro-batches
    each traced one stands for.

    A step's micro-batches come in at most three kinds, by the state they start in and what they run: the first
    (no gradient yet: it creates them, without reducing), the middle ones (each starts with the gradients the
    ones before accumulated, and adds to them without reducing: the same shapes, the same operators, the same
    collectives, so each is the same as the next) and the last (accumulates, then reduces). The trace runs one
    of each kind there is (1, 2, or 3 micro-batches) and counts the middle one grad_accum - 2 times."""
    if grad_accum <= 2:
        return grad_accum, [1] * grad_accum
    return 3, [1, grad_accum - 2, 1]


class _PartsClock(bench.PhaseClock):
    """train_step's phase clock, telling the tracker where each micro-batch's forward begins and where each
    micro-batch, and so the optimizer step, begins to be counted."""

    def __init__(self, device: torch.device, tracker):
        super().__init__(device)
        self.tracker = tracker
        self.micro_batches = 0

    def mark(self, phase: str) -> None:
        super().mark(phase)
        if phase == "data":  # the micro-batch's data is ready: its forward is next
            if self.micro_batches:
                self.tracker.next_micro_batch()
            self.micro_batches += 1
        elif phase == "backward":  # what follows belongs to the next micro-batch, or to the optimizer step
            self.tracker.next_part()


def _resident_gib(model: nn.Module, optimizer) -> dict[str, float]:
    """Bytes of this rank's own parameter and optimizer-state storage (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    def local_bytes(t: torch.Tensor) -> int:
        local = t.to_local() if isinstance(t, DTensor) else t
        return local.numel() * local.element_size()

    params = sum(local_bytes(p) for p in {id(p): p for p in model.parameters()}.values())
    states = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {"parameters": params / GIB, "optimizer_state": states / GIB}


def _create_optimizer_state(trainable: strategies.Trainable) -> None:
    """One untracked optimizer step on zero gradients, so that the traced step starts in the steady state
    (optimizer state present, as from the second step of a real run on)."""
    params = [p for p in trainable.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    trainable.optimizer.step()
    trainable.optimizer.zero_grad(set_to_none=True)


def trace_step(config: TrialConfig, shape: ModelShape, ctx: RankContext, fake: bool = True,
               gpu: str | None = None, skip_propagation: bool = True, every_micro_batch: bool = False,
               calibration: Calibration = SHIPPED_CALIBRATION, kinds: tuple[bool, ...] | None = None,
               record_events: bool = False, second_dp: int | None = None) -> StepTrace:
    """Build, wrap and run one training step of `config` on this rank under the step tracker.

    fake=True: storage is fake (call `init_fake_world` first); fake=False: the real thing on a real process
    group (tests compare the two). The caller's process group decides the world. skip_propagation=False leaves
    torch's tracker as it is (the test that pins why the correction is needed).

    A step of several micro-batches (grad_accum) runs one of each kind of micro-batch (`traced_accumulation`):
    the memory is that of every state the real step goes through, and the time and collectives count each
    traced micro-batch as many times as the step runs its kind. every_micro_batch=True traces them all (the
    tests' check that both agree).

    kinds: trace a shallow model of len(kinds) blocks, those marked True checkpointed (depth.py).
    record_events: keep the memory after every operator and FSDP2's sharding (worlds.py); second_dp (with
    record_events, FSDP2 trials): also build the step at that FSDP2 group size from this trace (`StepTrace.second`,
    shards.py; None where its sizes do not come out whole).
    """
    from raybench.rehearse import shards  # torch's trackers load slowly: only when tracing
    from raybench.rehearse.step_tracker import tracker_for

    train, _ = traced_train(config.train, config.resources.gpus_per_worker > 0)
    model, source, info = build_traced(config, train, kinds)
    mode = fake_mode() if fake else contextlib.nullcontext()
    trainable = _wrapped(model, train, ctx, mode, fake, source, info)
    with mode:
        _create_optimizer_state(trainable)
        batches = fake_batches(train, shape.vocab_size, ctx.device)
        tracker = tracker_for(trainable.model, trainable.optimizer, train.fsdp2_sharded, gpu_roofline(gpu, calibration))
        _track_from_start(tracker, trainable, train)
        if record_events:
            tracker.record_events()
        if record_events and second_dp and train.fsdp2_sharded:
            dp = ctx.world_size // train.tp_size  # FSDP2 shards over the TP groups (tp_size 1: the world)
            tracker.ledger = shards.ShardLedger(tracker, trainable, Fraction(dp, second_dp))
        marking = marking_propagation(tracker.propagation) if skip_propagation else contextlib.nullcontext()
        traced, times = traced_accumulation(train.grad_accum)
        if every_micro_batch:
            traced, times = train.grad_accum, [1] * train.grad_accum
        # The loss is divided by grad_accum either way: the traced micro-batches run the step's own operators.
        traced_train_step = train.model_copy(update={"grad_accum": traced})
        with marking, tracker, liger_rope(config, shape), one_sequence_per_row():
            bench.train_step(trainable, batches, traced_train_step, ctx.device, _PartsClock(ctx.device, tracker))
    trace = _step_trace(tracker, trainable, train, traced, times)
    if record_events:
        trace.memory_events, trace.sharding = tracker.events, fsdp_sharding(trainable.model)
    if tracker.ledger is not None and trace.sharding is not None:
        try:
            trace.second = shards.second_end(trace, tracker.ledger, second_dp, times)
        except shards.NotSplit:
            pass  # a size on the shards not whole there: the line needs a second traced group size
    return trace


def _wrapped(model: nn.Module, train: TrainSpec, ctx: RankContext, mode, fake: bool, source: str,
             info: dict) -> strategies.Trainable:
    """The model wrapped by the trial's strategy, its storage made under `mode` (fake: no values; real: filled as
    the worker fills it); DDP with its steady-state buckets, all-reducing on the fake group when fake."""

    def materialize(whole: bool) -> None:
        with mode:
            to_empty_keeping_ties(model, ctx.device)  # as the worker does: a tied head stays the embedding
        if not fake:  # real runs need real values for a finite loss; fake ones have none to give
            fill(model, ctx.device, source, info, whole)

    with steady_state_ddp_buckets(model) if train.parallelism.reducer else contextlib.nullcontext():
        trainable = strategies.setup(train.strategy, model, train, ctx, materialize)
    if isinstance(trainable.model, DistributedDataParallel) and fake:
        trainable.model.register_comm_hook(None, fake_allreduce_hook)
    return trainable


def _track_from_start(tracker, trainable: strategies.Trainable, train: TrainSpec) -> None:
    """What the tracker must count from the step's start: the model and optimizer (FSDP2's tracker follows them
    already) and DDP's gradient buckets."""
    if not train.fsdp2_sharded:
        tracker.track_external(trainable.model, trainable.optimizer)
    if isinstance(trainable.model, DistributedDataParallel):  # its reducer holds a bucket copy of every trainable
        # gradient from construction (one rank runs without DDP: strategies/ddp.py)
        tracker.count_from_start([b.buffer() for b in trainable.model.reducer._get_zeros_like_grad_buckets()])


def _step_trace(tracker, trainable: strategies.Trainable, train: TrainSpec, traced: int,
                times: list[int]) -> StepTrace:
    """The traced step's StepTrace: each traced micro-batch counted as many times as the step runs its kind."""
    *micro_batches, optimizer_step = tracker.costs.parts
    assert len(micro_batches) == traced, (len(micro_batches), traced)
    total = tracker.costs.step_total(times)
    return StepTrace(
        memory_gib=tracker.category_gib(), resident_gib=_resident_gib(trainable.model, trainable.optimizer),
        comm_bytes=dict(total.comm_bytes), comm_calls=dict(total.comm_calls),
        overlapped_comm=tuple(sorted(tracker.costs.overlapped_names)), flops=total.flops,
        roofline_s=total.roofline_s, compute_s=total.compute_s, memory_s=total.memory_s,
        op_s=dict(total.op_s),
        block_memory_bound_s=total.block_memory_bound_s, grad_accum=train.grad_accum, traced_micro_batches=traced,
        optimizer_roofline_s=optimizer_step.roofline_s, launches=total.launches, place_gib=tracker.place_gib(),
        backward_entry_gib=tracker.backward_entry_gib(),
        timeline=[(count, part.events) for part, count in zip(micro_batches, times)] + [(1, optimizer_step.events)])
