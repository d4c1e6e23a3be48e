"""One training step of a trial, traced as one rank of its full world: fake storage, torch's fake process group,
torch's memory trackers, every collective and every operator's roofline cost.

Known correction: under an active FakeTensorMode, DTensor's sharding propagation runs each op once more on
fake tensors of the *global* shape, in the same fake mode, so torch's trackers count those phantom tensors as
real (issue 16 reports ~825 GiB of "optimizer state" for a 72B model's AdamW step instead of ~8.5; the unit
test reproduces the mechanism on a foreach op). `Propagation` marks
those calls through ShardingPropagator's `_fake_mode_lock` hook and the tracker skips them.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial, wraps
from unittest import mock

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from raybench.rehearse.fake_world import (
    Propagation,
    collective_ops,
    comm_bytes,
    fake_allreduce_hook,
    fake_mode,
    marking_propagation,
    one_sequence_per_row,
)
from raybench.rehearse.fitted import SHIPPED_CALIBRATION, Calibration
from raybench.rehearse.roofline import Roofline, fusable, gpu_roofline
from raybench.runtime import bench, strategies
from raybench.runtime.materialize import to_empty_keeping_ties
from raybench.runtime.model import build_meta, decoder_blocks
from raybench.runtime.strategies import RankContext
from raybench.runtime.techniques import activation_checkpointing, fp8, liger_reference
from raybench.runtime.worker import TECHNIQUES, prepare_model
from raybench.spec.presets import ModelShape
from raybench.spec.schema import GIB
from raybench.spec.sweep_spec import TrainSpec, TrialConfig

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# Strategies the fake process group can drive. DeepSpeed's engine needs real communication and storage at
# initialize: it falls back to the analytic estimate, and says so.
TRACEABLE_STRATEGIES = ("ddp", "fsdp2", "tp", "tp_fsdp2")


@dataclass
class StepTrace:
    """What one traced step did on this rank: memory at its peak, collectives, operator costs."""

    memory_gib: dict[str, float]  # at the step's peak, by CATEGORIES
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
    # Memory by CATEGORIES at each place's own highest point (`place_of`), and how much memory grew in backward
    # across the middle blocks (`middle_growth_gib`): what a deeper model's peak is extrapolated from (depth.py).
    place_gib: dict[str, dict[str, float]] = field(default_factory=dict)
    middle_growth_gib: float = 0.0
    # The step as its two streams see it, for the overlap of collectives with compute (step_time.exposed_s): each
    # traced part's events (`_Costs.events`) with the number of times the step runs that part. A deep model's
    # is a linear combination of its shallow models' (depth.py), so weights need not be whole or positive.
    timeline: list[tuple[float, list]] = field(default_factory=list)

    @property
    def peak_gib(self) -> float:
        return sum(self.memory_gib.values())



@dataclass
class _Costs:
    """What one part of the step (a micro-batch, or the optimizer step) ran: operator costs and collectives."""

    flops: float = 0.0
    roofline_s: float = 0.0
    compute_s: float = 0.0
    memory_s: float = 0.0
    block_memory_bound_s: float = 0.0
    launches: int = 0
    op_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    comm_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    comm_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # In the order the rank issued them: ["compute", roofline seconds, index of the collective it waits for or -1,
    # in backward] (consecutive operators of one pass that wait for nothing merged into one) and ["comm", name,
    # bytes, kind], kind as `comm_kind` says. Not added up by `add`: the trace keeps each part's own
    # (StepTrace.timeline).
    events: list[list] = field(default_factory=list)
    collectives: int = 0  # "comm" events so far: the next one's index

    def add(self, other: _Costs, times: int = 1) -> None:
        for name in ("flops", "roofline_s", "compute_s", "memory_s", "block_memory_bound_s", "launches"):
            setattr(self, name, getattr(self, name) + times * getattr(other, name))
        for name in ("op_s", "comm_bytes", "comm_calls"):
            mine = getattr(self, name)
            for key, value in getattr(other, name).items():
                mine[key] += times * value

    def computed(self, seconds: float, waits_for: int, backward: bool) -> None:
        last = self.events[-1] if self.events else None
        if waits_for < 0 and last is not None and last[0] == "compute" and last[3] == backward:
            last[1] += seconds
        else:
            self.events.append(["compute", seconds, waits_for, backward])

    def communicated(self, name: str, nbytes: int, kind: str) -> int:
        self.events.append(["comm", name, nbytes, kind])
        self.collectives += 1
        return self.collectives - 1


def comm_kind(name: str, overlapped: bool) -> str:
    """How a collective sits beside compute (step_time.exposed_s): "gather", FSDP's all-gathers, issued ahead of
    the compute that reads them; "reduce", FSDP's reduce-scatters and DDP's all-reduces, which nothing in the
    step reads until it ends (they run on the collectives' stream, their own copies too); "blocking", the rest
    (TP's), whose result the next operators wait for."""
    if not overlapped:
        return "blocking"
    return "gather" if "gather" in name else "reduce"


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


def _tracker(model: nn.Module, optimizer, fsdp: bool):
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.utils.weak import WeakIdKeyDictionary

    base = FSDPMemTracker if fsdp else MemTracker

    class StepTracker(base):
        """torch's tracker, plus: skip DTensor's global-shape propagation runs, count collectives and the
        roofline cost of every operator this rank runs."""

        def __init__(self, roofline: Roofline, layers: int):
            super().__init__(*((model, optimizer) if fsdp else ()))
            self.layers = layers
            self.place_peaks: dict[str, tuple[int, dict]] = {}  # place_of: (bytes in use, snapshot) at its highest
            self.backward_entry: dict[tuple[int, int], int] = {}  # (part, block): bytes in use as its backward began
            self.last_total = 0
            self.last_block: dict[tuple[int, bool], int] = {}  # (part, backward): the block that ran last
            self.propagation = Propagation()
            self.collectives, self.overlapped = collective_ops()
            self.roofline = roofline
            self.parts = [_Costs()]  # the micro-batches traced so far, then the optimizer step (`next_part`)
            self.overlapped_names: set[str] = set()
            self.awaited = WeakIdKeyDictionary()  # storage a gather or blocking collective wrote -> its index
            self.accumulating_grads = False
            self.stand_ins: list[torch.Tensor] = []
            self.held_elsewhere = WeakIdKeyDictionary()  # storages the stand-ins count
            self.op_reads_held_elsewhere = False

        def next_part(self) -> None:
            """Count what follows as the step's next part (the next micro-batch, or the optimizer step)."""
            self.parts.append(_Costs())
            self.awaited = WeakIdKeyDictionary()  # each part's timeline starts with its streams idle

        def next_micro_batch(self) -> None:
            """Before a micro-batch's forward, except the first: torch's trackers take a second forward of the
            root module for a second step and refuse it; a micro-batch is not one, so clear the per-module
            statistics of the last micro-batch as torch's message advises (`reset_mod_stats`). The step's peak,
            and every tensor tracked, are the tracker's own and carry on."""
            self.reset_mod_stats()

        def count_from_start(self, stand_ins: list[torch.Tensor]) -> None:
            """Count `stand_ins` as gradients from the step's start, for storage a wrapper allocated before the
            step where the tracker cannot see it (DDP's gradient buckets, inside its C++ reducer): torch's
            tracker would first see that storage when the step uses it, and count it only from there.

            That storage is not counted again. Once stand-ins are given, a storage an operator takes as input
            before the tracker saw it is theirs (everything the step creates, the tracker sees created; the
            model and optimizer are tracked from the start), and so is what an operator on it returns that the
            tracker has not seen: a view of it or, under a fake mode, the fake twin of that real storage."""
            self.stand_ins = stand_ins
            for t in stand_ins:
                self._update_and_maybe_create_winfos(t, _MemRefType.GRAD)

        def _reads_held_elsewhere(self, args, kwargs) -> bool:
            held = False
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    for st in get_untyped_storages(t):
                        if st not in self._WINFO:
                            self.held_elsewhere[st] = True
                        held = held or st in self.held_elsewhere
            return held

        def _track(self, reftype, t: torch.Tensor) -> None:
            if self.accumulating_grads:
                reftype = self._ref_class.UNSHARDED_GRAD
            for st in get_untyped_storages(t):
                if self.op_reads_held_elsewhere and st not in self._WINFO:
                    self.held_elsewhere[st] = True
                if st in self.held_elsewhere:
                    return
            super()._track(reftype, t)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.propagation.depth:  # DTensor's global-shape run: no memory of this rank's
                return func(*args, **(kwargs or {}))
            costs = self.parts[-1]
            self.op_reads_held_elsewhere = bool(self.stand_ins) and self._reads_held_elsewhere(args, kwargs)
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.op_reads_held_elsewhere = False
            if out is NotImplemented:  # DTensor desugars first; its local ops come back through here
                return out
            if func in self.collectives:
                name = func._overloadpacket.__name__.strip("_")
                nbytes = comm_bytes(func, out, args, kwargs or {})
                costs.comm_bytes[name] += nbytes
                costs.comm_calls[name] += 1
                if func in self.overlapped:
                    self.overlapped_names.add(name)
                kind = comm_kind(name, func in self.overlapped)
                index = costs.communicated(name, nbytes, kind)
                if kind != "reduce":
                    self._awaits(out, index)
            else:
                seconds = self._cost(costs, func, args, kwargs or {}, out)
                costs.computed(seconds, self._waits_for(args, kwargs) if self.awaited else -1, self._mod_tracker.is_bw)
            return out

        def _awaits(self, out, index: int) -> None:
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    for st in get_untyped_storages(t):
                        self.awaited[st] = index

        def _waits_for(self, args, kwargs) -> int:
            """The latest collective whose output this operator is the first to read (-1: none)."""
            waits_for = -1
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    for st in get_untyped_storages(t):
                        index = self.awaited.pop(st, -1)
                        waits_for = max(waits_for, index)
            return waits_for

        def _cost(self, costs: _Costs, func, args, kwargs, out) -> float:
            flops, compute_s, memory_s = self.roofline.cost(func, args, kwargs, out)
            costs.flops += flops
            costs.compute_s += compute_s
            costs.memory_s += memory_s
            costs.roofline_s += max(compute_s, memory_s)
            costs.op_s[func._overloadpacket.__name__] += max(compute_s, memory_s)
            costs.launches += self.roofline.launches_kernel(func, out)
            if fusable(func, flops) and any(_BLOCK_NAME.search(name) for name in self._mod_tracker.parents):
                costs.block_memory_bound_s += memory_s
            return max(compute_s, memory_s)

        def _update_peak_stats(self, peak_state) -> None:
            # The step's peak, and each place's (`place_of`): torch's tracker keeps every module's own peak instead,
            # walking all the model's modules after every operator (quadratic in depth: 40% of a 72B trace).
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL]:
                    self._peak_mem[dev] = dev_snap[_TOTAL]
                    self._peak_mem_snap[dev] = dict(dev_snap)
            total = sum(dev_snap[_TOTAL] for dev_snap in self._curr_mem_snap.values())
            # Backward leaves torch's module tracker with stale entries of the blocks above (it runs top-down):
            # the lowest block entered is the one running.
            block = min((int(m.group(1)) for name in self._mod_tracker.parents if (m := _BLOCK_ITSELF.search(name))),
                        default=None)
            part, backward = len(self.parts) - 1, self._mod_tracker.is_bw
            if block is None:  # between blocks, or past the last (the head in forward, the embedding in backward)
                block = self.last_block.get((part, backward))
            else:
                self.last_block[part, backward] = block
                if backward:
                    self.backward_entry.setdefault((part, block), self.last_total)
            self.last_total = total
            place = place_of(part, backward, block, self.layers)
            if total > self.place_peaks.get(place, (-1, None))[0]:
                self.place_peaks[place] = (total, {dev: dict(snap) for dev, snap in self._curr_mem_snap.items()})

        def place_gib(self) -> dict[str, dict[str, float]]:
            return {place: _categories(snapshot) for place, (_, snapshot) in self.place_peaks.items()}

        def middle_growth_gib(self) -> float:
            """The most memory grew, in any micro-batch's backward, from entering the highest middle block (the
            first one backward reaches) to entering the bottom block: 0 without middle blocks."""
            if self.layers <= END_BLOCKS:
                return 0.0
            entry = self.backward_entry
            highest_middle = self.layers - END_BLOCKS  # below the two top blocks
            growth = [entry[(p, 0)] - entry[(p, highest_middle)] if (p, 0) in entry and (p, highest_middle) in entry
                      else float("inf") for p in {part for part, _ in entry}]
            return max(growth, default=float("inf")) / GIB

        def _fsdp_param_group_post_backward(self, fsdp_mod, orig_post_backward):
            # A micro-batch that does not reduce (set_requires_gradient_sync(False)) leaves each gradient unsharded
            # and, under a mixed-precision policy, casts it to the reduce dtype in FSDP's post-backward: torch's
            # tracker would count that cast as a temporary of backward, where it is the gradient the next
            # micro-batches accumulate into and the last one reduces.
            @wraps(orig_post_backward)
            def post_backward(*args, **kwargs):
                group = fsdp_mod._get_fsdp_state()._fsdp_param_group
                self.accumulating_grads = group is not None and not group.reduce_grads
                try:
                    return orig_post_backward(*args, **kwargs)
                finally:
                    self.accumulating_grads = False

            return super()._fsdp_param_group_post_backward(fsdp_mod, post_backward)

        def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
            # torch's MemTracker hooks every parameter's gradient and fails on frozen ones (LoRA's base weights,
            # which have none): a handle that removes nothing marks those as hooked already.
            for param in module.parameters():
                if not param.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(param, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def category_gib(self) -> dict[str, float]:
            return _categories(self.get_tracker_snapshot("peak"))

    return StepTracker



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


class _NoHook:
    """The hook handle of a parameter that got no hook."""

    def remove(self) -> None:
        pass


# A decoder block's module name as torch's module tracker reports it (model.model.layers.7, or inside wrappers).
_BLOCK_NAME = re.compile(r"\.layers\.\d+(\.|$)")
_BLOCK_ITSELF = re.compile(r"\.layers\.(\d+)(\._checkpoint_wrapped_module)?$")  # the block, not a module inside

# The blocks a shallow model keeps as the deep one has them: the bottom one, and the two top ones (the head's
# end, where backward starts). The blocks between them are the middle.
END_BLOCKS = 3


def place_of(part: int, backward: bool, block: int | None, layers: int) -> str:
    """Where in the step an operator runs, by what a shallow model keeps of the deep one's structure: the part
    (micro-batch, or the optimizer step), forward or backward, and the decoder block that runs it or ran last
    (bottom, top-1, top, or middle: any other block), or outside: before any block (forward's embedding,
    backward's head and loss) and in the optimizer step."""
    if block is None:
        where = "outside"
    elif block == 0:
        where = "bottom"
    elif block >= layers - 2:
        where = "top" if block == layers - 1 else "top-1"
    else:
        where = "middle"
    return f"{part}:{'backward' if backward else 'forward'}:{where}"

# Tracker reference types (torch's names) by the categories raybench reports.
_CATEGORY_OF = {
    "sharded_param": "parameters", "unsharded_param": "parameters", "all_gather": "parameters",
    "parameter": "parameters", "buffer": "parameters",
    "sharded_grad": "gradients", "unsharded_grad": "gradients", "reduce_scatter": "gradients",
    "gradient": "gradients",
    "optstate": "optimizer_state",
    "activation": "activations", "inputs": "activations",
    "temp": "temporaries", "other": "temporaries",
}
_TOTAL = "Total"  # the snapshot's own sum


def _categories(snapshot: dict) -> dict[str, float]:
    """Sum a tracker snapshot's reference types (over devices) into CATEGORIES, in GiB."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for device_snapshot in snapshot.values():
        for reftype, nbytes in device_snapshot.items():
            value = str(getattr(reftype, "value", reftype))
            if value != _TOTAL:  # an unknown reference type (a torch upgrade) fails here, loudly
                totals[_CATEGORY_OF[value.lower().replace(" ", "_")]] += nbytes / GIB
    return totals



def traced_config(config: TrialConfig) -> TrialConfig:
    """The trial as the trace runs it (see traced_train): trials with equal traced configs trace the same step."""
    train, _ = traced_train(config.train, config.resources.gpus_per_worker > 0)
    return config.model_copy(update={"train": train})


COMPILE_NOTE = "compile traced eager"
LIGER_NOTE = "liger traced with reference operators, one per Triton kernel"
COMPILED_ACTIVATIONS_NOTE = "compile traced eager, its blocks' saved activations from torch.compile's partitioner"


def traced_train(train: TrainSpec, on_gpu: bool) -> tuple[TrainSpec, list[str]]:
    """The TrainSpec the trace runs, and what it changes from the trial (each change is reported per row).

    The trace runs on CPU fake tensors, so it runs the GPU worker's choices explicitly: AdamW's fused kernel
    (what "adamw" picks on CUDA). torch.compile is not traced (its graphs would be compiled for CPU): compiled
    trials are traced eager; their step time accounts for fusion (predict_step_time) and their activations for
    what compiled blocks keep (compiled_block_saving_gib). Liger's Triton kernels are traced
    as reference operators with the same inputs, outputs and saved tensors (`_build_traced`).
    """
    changes = {}
    notes = []
    if on_gpu and train.optimizer == "adamw":
        changes["optimizer"] = "adamw_fused"
    if train.liger:
        notes.append(LIGER_NOTE)
    if train.compile:
        changes["compile"] = False
        notes.append(COMPILE_NOTE)
    return (train.model_copy(update=changes) if changes else train), notes


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


def fake_batches(train: TrainSpec, vocab_size: int, device: torch.device) -> Iterator[dict]:
    """Packed synthetic micro-batches (no padding: input_ids and labels), as the worker's data would be."""
    while True:
        ids = torch.randint(0, vocab_size, (train.micro_batch, train.seq_len), device=device)
        yield {"input_ids": ids, "labels": ids}


class _Fp8Traced:
    """train.fp8 as the trace applies it: the same linears converted to torchao's Float8Linear, without the
    worker's check for FP8 tensor cores (the trace runs on a fake GPU; the plan has refused CPU trials)."""

    wanted = staticmethod(fp8.wanted)
    apply = staticmethod(fp8.convert)


TRACED_TECHNIQUES = tuple(_Fp8Traced if technique is fp8 else technique for technique in TECHNIQUES)


def _build_traced(config: TrialConfig, train: TrainSpec,
                  kinds: tuple[bool, ...] | None = None) -> tuple[nn.Module, str, dict]:
    """build_meta and the techniques of `train` (a traced TrainSpec), with Liger's reference operators where
    the trial asks for Liger: they come first, as Liger does in worker.TECHNIQUES.

    kinds: build a model of len(kinds) decoder blocks instead, checkpointing those marked True (depth.py)."""
    model, source, info = build_meta(config.model, train.seed, layers=None if kinds is None else len(kinds))
    if train.liger:
        model = liger_reference.apply(model)
        train = train.model_copy(update={"liger": False})  # the reference operators stand in for the kernels
    if kinds is None:
        return prepare_model(model, train, TRACED_TECHNIQUES), source, info
    # The techniques before checkpointing, then checkpointing where `kinds` says (it comes after them).
    model = prepare_model(model, train.model_copy(update={"ac_ratio": "0"}), TRACED_TECHNIQUES)
    return activation_checkpointing.checkpoint(model, train, [i for i, ac in enumerate(kinds) if ac]), source, info


def liger_rope(config: TrialConfig, shape: ModelShape):
    """The context a Liger trial's forward runs in: Liger's rotary kernel in place of transformers' function."""
    if not config.train.liger:
        return contextlib.nullcontext()
    return liger_reference.rope_patched(shape.model_type)


# DDP all-reduces its gradients in buckets of at most 25 MiB (the first 1 MiB) as backward makes them, from its
# second iteration on; its first, the one the trace runs, all-reduces every gradient at once after backward: torch
# starts with one bucket and rebuilds the buckets in the order the first backward made the gradients.
DDP_BUCKET_CAP_BYTES = 25 * 2**20


def steady_state_ddp_buckets(model: nn.Module):
    """Build DDP with the buckets it rebuilds to: torch's own assignment (`_compute_bucket_assignment_by_size`,
    the rebuild's) over the trainable parameters in reverse order of definition, the order backward makes their
    gradients in (a norm's weight may land in the neighbouring bucket), handed to DDP as per-bucket limits in
    definition order, the order DDP packs its first buckets in."""
    from raybench.runtime.strategies import ddp

    ready = [p for p in model.parameters() if p.requires_grad][::-1]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        ready, [dist._DEFAULT_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES], [False] * len(ready))
    sizes = [sum(ready[i].numel() * ready[i].element_size() for i in bucket) for bucket in buckets]
    # DDP closes a bucket once it holds its limit: a limit half a byte under each size closes it on its last tensor.
    limits_mib = [(size - 0.5) / 2**20 for size in reversed(sizes)]
    return mock.patch.object(ddp, "DistributedDataParallel",
                             partial(ddp.DistributedDataParallel, bucket_cap_mb_list=limits_mib))


def trace_step(config: TrialConfig, shape: ModelShape, ctx: RankContext, fake: bool = True,
               gpu: str | None = None, skip_propagation: bool = True, every_micro_batch: bool = False,
               calibration: Calibration = SHIPPED_CALIBRATION, kinds: tuple[bool, ...] | None = None) -> StepTrace:
    """Build, wrap and run one training step of `config` on this rank under the step tracker.

    fake=True: storage is fake (call `init_fake_world` first); fake=False: the real thing on a real process
    group (tests compare the two). The caller's process group decides the world. skip_propagation=False leaves
    torch's tracker as it is (the test that pins why the correction is needed).

    A step of several micro-batches (grad_accum) runs one of each kind of micro-batch (`traced_accumulation`):
    the memory is that of every state the real step goes through, and the time and collectives count each
    traced micro-batch as many times as the step runs its kind. every_micro_batch=True traces them all (the
    tests' check that both agree).

    kinds: trace a shallow model of len(kinds) blocks, those marked True checkpointed (depth.py).
    """
    on_gpu = config.resources.gpus_per_worker > 0
    train, _ = traced_train(config.train, on_gpu)
    model, source, info = _build_traced(config, train, kinds)
    layers = len(kinds) if kinds is not None else len(decoder_blocks(model))
    mode = fake_mode() if fake else contextlib.nullcontext()

    def materialize(whole: bool) -> None:
        with mode:
            to_empty_keeping_ties(model, ctx.device)  # as the worker does: a tied head stays the embedding
        if not fake:  # real runs need real values for a finite loss; fake ones have none to give
            from raybench.runtime.model import fill

            fill(model, ctx.device, source, info, whole)

    with steady_state_ddp_buckets(model) if train.strategy == "ddp" else contextlib.nullcontext():
        trainable = strategies.setup(train.strategy, model, train, ctx, materialize)
    if train.strategy == "ddp" and fake:
        trainable.model.register_comm_hook(None, fake_allreduce_hook)
    fsdp = train.fsdp2_sharded
    tracker_cls = _tracker(trainable.model, trainable.optimizer, fsdp)
    with mode:
        _create_optimizer_state(trainable)
        batches = fake_batches(train, shape.vocab_size, ctx.device)
        tracker = tracker_cls(gpu_roofline(gpu, calibration), layers)
        if not fsdp:
            tracker.track_external(trainable.model, trainable.optimizer)
        if train.strategy == "ddp":  # its reducer holds a bucket copy of every trainable gradient from construction
            tracker.count_from_start([b.buffer() for b in trainable.model.reducer._get_zeros_like_grad_buckets()])
        marking = marking_propagation(tracker.propagation) if skip_propagation else contextlib.nullcontext()
        traced, times = traced_accumulation(train.grad_accum)
        if every_micro_batch:
            traced, times = train.grad_accum, [1] * train.grad_accum
        # The loss is divided by grad_accum either way: the traced micro-batches run the step's own operators.
        traced_train_step = train.model_copy(update={"grad_accum": traced})
        with marking, tracker, liger_rope(config, shape), one_sequence_per_row():
            bench.train_step(trainable, batches, traced_train_step, ctx.device, _PartsClock(ctx.device, tracker))
    *micro_batches, optimizer_step = tracker.parts
    assert len(micro_batches) == traced, (len(micro_batches), traced)
    total = _Costs()
    for part, count in zip(micro_batches, times):
        total.add(part, count)
    total.add(optimizer_step)
    return StepTrace(
        memory_gib=tracker.category_gib(), resident_gib=_resident_gib(trainable.model, trainable.optimizer),
        comm_bytes=dict(total.comm_bytes), comm_calls=dict(total.comm_calls),
        overlapped_comm=tuple(sorted(tracker.overlapped_names)), flops=total.flops,
        roofline_s=total.roofline_s, compute_s=total.compute_s, memory_s=total.memory_s,
        op_s=dict(total.op_s),
        block_memory_bound_s=total.block_memory_bound_s, grad_accum=train.grad_accum, traced_micro_batches=traced,
        optimizer_roofline_s=optimizer_step.roofline_s, launches=total.launches, place_gib=tracker.place_gib(),
        middle_growth_gib=tracker.middle_growth_gib(),
        timeline=[(count, part.events) for part, count in zip(micro_batches, times)] + [(1, optimizer_step.events)])



def unwrapped_model(config: TrialConfig) -> tuple[nn.Module, TrainSpec]:
    """The trial's model with its techniques (no checkpointing, no compile) on the meta device, its parameters
    in the dtype its strategy computes with, and the TrainSpec it was built with. FSDP2's mixed-precision
    policy casts them to bf16 before each forward (fsdp2.shard); ddp and tp keep them fp32 (a LoRA base in
    train.lora.base_dtype, cast by the LoRA technique itself) and run forward under autocast
    (`strategies.autocast_for`). Cast on meta: fake storage cannot be swapped in place afterwards."""
    train = config.train.model_copy(update={"ac_ratio": "0", "compile": False})
    model, _, _ = _build_traced(config, train)
    if train.precision == "bf16" and train.fsdp2_sharded:
        model.to(torch.bfloat16)
    return model, train

