"""Rehearse a trial at full scale in one CPU process: fake tensors, a fake process group, one traced step.

The trial's own worker path runs unchanged — meta build, techniques (`worker.prepare_model`), the strategy's
wrap (`strategies.setup`), one step of `bench.train_step` — as rank 0 of the trial's full world, but the
model's storage comes from `to_empty` under a FakeTensorMode (shapes and dtypes, no bytes) and the process
group is torch's fake backend (every collective returns at once). A dispatch mode watching that step reports:
- peak tensor memory by category (torch's MemTracker / FSDPMemTracker),
- bytes per step by collective (each c10d or functional collective the step issues),
- FLOPs and bytes per operator, turned into a roofline step time with the hardware table's peak FLOP/s
  and memory bandwidth, and communication time from a bus bandwidth (see `predict_step_time`).
For fully checkpointed FSDP2 trials it also records one decoder block's operators with torch's SAC
estimator (timed by the same roofline), from which `op_policy` derives an op-level checkpointing policy
with torch's SAC ILP.

This module is the one place that touches private torch APIs (torch.distributed._tools, the fake process
group, FakeTensorMode, DTensor's sharding propagator, the runtime-estimation op lists): a torch upgrade that
moves them breaks here, and tests/unit/test_rehearse.py pins each one (the SAC estimator's and ILP's too).
docs/rehearse.md describes the method, what it cannot see, and its measured accuracy.

Known correction: under an active FakeTensorMode, DTensor's sharding propagation runs each op once more on
fake tensors of the *global* shape, in the same fake mode, so torch's trackers count those phantom tensors as
real (issue 16 reports ~825 GiB of "optimizer state" for a 72B model's AdamW step instead of ~8.5; the unit
test reproduces the mechanism on a foreach op). `_Propagation` marks
those calls through ShardingPropagator's `_fake_mode_lock` hook and the tracker skips them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from raybench import bench, strategies
from raybench.config import TrainSpec, TrialConfig
from raybench.hardware import matmul_efficiency, memory_bandwidth_tb_per_s, peak_tflops
from raybench.materialize import to_empty_keeping_ties
from raybench.model import build_meta, decoder_blocks
from raybench.plan import checkpointed_blocks, config_id
from raybench.presets import ModelShape
from raybench.schema import GIB
from raybench.strategies import RankContext
from raybench.techniques import activation_checkpointing, liger_reference
from raybench.worker import prepare_model

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
    op_s: dict[str, float] = field(default_factory=dict)  # roofline seconds by operator (the 12 costliest)
    # Roofline seconds of the FLOP-less (elementwise, reduction, copy) operators run inside decoder blocks, in
    # forward, backward or recomputation: what torch.compile fuses into its generated kernels.
    block_memory_bound_s: float = 0.0
    # One decoder block's operators (`block_ops`), for op-level policies: fully checkpointed FSDP2 GPU trials.
    block_ops: dict | None = None

    @property
    def peak_gib(self) -> float:
        return sum(self.memory_gib.values())


# ---------------------------------------------------------------------------------------------------------
# Private torch pieces, each used here only.


def _fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Inputs built outside the mode (host scalars, the model's own small factory tensors) join the trace.
    return FakeTensorMode(allow_non_fake_inputs=True)


def init_fake_world(rank: int, world_size: int) -> None:
    """A process group of world_size ranks in which this process plays `rank`; collectives do nothing."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


class _Propagation:
    """DTensor's sharding propagator enters this around its global-shape fake run (`_fake_mode_lock`)."""

    def __init__(self) -> None:
        self.depth = 0

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc) -> None:
        self.depth -= 1


@contextlib.contextmanager
def _marking_propagation(propagation: _Propagation) -> Iterator[None]:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    saved = ShardingPropagator._fake_mode_lock
    ShardingPropagator._fake_mode_lock = propagation
    try:
        yield
    finally:
        ShardingPropagator._fake_mode_lock = saved


@contextlib.contextmanager
def _one_sequence_per_row() -> Iterator[None]:
    """transformers reads the position ids' values to tell packed rows (several sequences, a block-causal mask)
    from one sequence per row (no mask: SDPA's is_causal kernels). Fake tensors have no values, so it would
    assume packing and build a mask; the traced batches hold one sequence per row, as the worker's do (they
    pass no position ids), so say so."""
    from transformers import masking_utils

    saved = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = saved


def _fake_allreduce_hook(_state, bucket):  # no return annotation: DDP checks it as an object, not a string
    """DDP's bucket all-reduce on the fake group. DDP's built-in hook hands back the value of the collective's
    future, which the fake group leaves empty; this one runs the all-reduce and hands back the bucket itself.

    It does not divide by the world size as the built-in path does: there the reducer scales each gradient
    while copying it into its bucket, one pass the trace already counts as the copy. And it must not write
    into the bucket: the reducer allocated it outside the fake mode, as real host memory never touched."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _collective_ops() -> tuple[set, set]:
    """(every collective op, the c10d ones that FSDP2 and DDP issue beside compute)."""
    from torch.distributed._tools.fake_collectives import collective_ops, sync_ops

    c10d = torch.ops.c10d
    overlapped = {c10d._allgather_base_.default, c10d._reduce_scatter_base_.default, c10d.allreduce_.default,
                  c10d.allgather_into_tensor_coalesced_.default, c10d.reduce_scatter_tensor_coalesced_.default}
    return (collective_ops | overlapped) - sync_ops, overlapped


def _comm_bytes(func, out, args, kwargs) -> int:
    from torch.distributed._tools.fake_collectives import CollectiveOp

    try:
        return int(CollectiveOp.get_comm_tensor_size(func, out, args, kwargs))
    except (NotImplementedError, IndexError, AttributeError, TypeError):
        # torch's table has no entry for this collective's argument layout: count its tensor arguments.
        return sum(t.untyped_storage().nbytes() for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor))


def _flop_formulas() -> dict:
    """Operator → FLOP formula: torch's flop counter registry, plus the CPU flash-attention kernels (which
    the CPU trace dispatches to) mapped to the CUDA flash formulas they mirror."""
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    formulas = dict(flop_registry)
    formulas[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
        aten._scaled_dot_product_flash_attention]
    formulas[aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_flash_backward_flop
    return formulas


def _cpu_flash_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _not_memory_traffic() -> set:
    """Operators that move no data worth counting: torch's runtime estimator's lists (views, metadata, RNG
    seeds), and allocations (an empty tensor is reserved, not written)."""
    from torch.utils._runtime_estimation import _IGNORE_OPS, _VIEW_OPS

    aten = torch.ops.aten
    allocations = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided}
    return set(_IGNORE_OPS) | set(_VIEW_OPS) | allocations


class _Roofline:
    """One operator's roofline cost on a GPU: FLOPs / peak FLOP/s of its output dtype and bytes moved / memory
    bandwidth (the step tracker sums them; the SAC estimator takes them per operator)."""

    def __init__(self, peaks: dict, bandwidth: float | None):
        self.peaks, self.bandwidth = peaks, bandwidth  # FLOP/s by dtype; bytes/s
        self.formulas, self.skip_traffic = _flop_formulas(), _not_memory_traffic()

    def cost(self, func, args, kwargs, out) -> tuple[float, float, float]:
        """(FLOPs, seconds at peak FLOP/s, seconds at the memory bandwidth)."""
        packet = func._overloadpacket
        flops = 0.0
        if packet in self.formulas:
            flops = float(self.formulas[packet](*args, **kwargs, out_val=out))
            if kwargs.get("is_causal") or (len(args) > 4 and args[4] is True):
                flops /= 2  # causal kernels skip the masked half of the score matrix
        moved = 0
        # An operator that neither returns a tensor nor writes one (prim.device, size queries) reads metadata.
        writes = func._schema.is_mutable or any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(out))
        if packet not in self.skip_traffic and not func.is_view and writes:
            moved = sum(t.untyped_storage().nbytes() if t.dim() == 0 else t.numel() * t.element_size()
                        for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        dtype = next((t.dtype for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        peak = self.peaks.get(dtype)
        return flops, flops / peak if peak else 0.0, moved / self.bandwidth if self.bandwidth else 0.0


def _gpu_roofline(gpu: str | None) -> _Roofline:
    """The roofline of raybench's hardware table for `gpu` (no GPU: every operator costs 0 s). Its tensor-core
    peaks are scaled by the GPU's measured matmul efficiency relative to the GPU ROOFLINE_EFFICIENCY was fitted
    on (`matmul_efficiency_ratio`)."""
    ratio = matmul_efficiency_ratio(gpu)
    peaks = {dtype: (peak_tflops(gpu, name) or 0) * 1e12 * (ratio if name != "fp32" else 1.0) for dtype, name in
             ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32"))} if gpu else {}
    bandwidth = (memory_bandwidth_tb_per_s(gpu) or 0) * 1e12 or None
    return _Roofline(peaks, bandwidth)


def matmul_efficiency_ratio(gpu: str | None) -> float:
    """How much more of its bf16 peak a GPU's matmuls reach than the H100 SXM's (1 when either is unmeasured):
    ROOFLINE_EFFICIENCY holds for the H100, and a GB200 reaches 0.729 of its peak where an H100 reaches 0.803."""
    own, reference = matmul_efficiency(gpu), matmul_efficiency(ROOFLINE_REFERENCE_GPU)
    return own / reference if own and reference else 1.0


def _tracker(model: nn.Module, optimizer, fsdp: bool):
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.utils.weak import WeakIdKeyDictionary

    base = FSDPMemTracker if fsdp else MemTracker

    class StepTracker(base):
        """torch's tracker, plus: skip DTensor's global-shape propagation runs, count collectives and the
        roofline cost of every operator this rank runs."""

        def __init__(self, roofline: _Roofline):
            super().__init__(*((model, optimizer) if fsdp else ()))
            self.propagation = _Propagation()
            self.collectives, self.overlapped = _collective_ops()
            self.roofline = roofline
            self.comm_bytes: dict[str, int] = defaultdict(int)
            self.comm_calls: dict[str, int] = defaultdict(int)
            self.overlapped_names: set[str] = set()
            self.flops = self.roofline_s = self.compute_s = self.memory_s = 0.0
            self.op_s: dict[str, float] = defaultdict(float)
            self.block_memory_bound_s = 0.0
            self.stand_ins: list[torch.Tensor] = []
            self.held_elsewhere = WeakIdKeyDictionary()  # storages the stand-ins count
            self.op_reads_held_elsewhere = False

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
            for st in get_untyped_storages(t):
                if self.op_reads_held_elsewhere and st not in self._WINFO:
                    self.held_elsewhere[st] = True
                if st in self.held_elsewhere:
                    return
            super()._track(reftype, t)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.propagation.depth:  # DTensor's global-shape run: no memory of this rank's
                return func(*args, **(kwargs or {}))
            self.op_reads_held_elsewhere = bool(self.stand_ins) and self._reads_held_elsewhere(args, kwargs)
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                self.op_reads_held_elsewhere = False
            if out is NotImplemented:  # DTensor desugars first; its local ops come back through here
                return out
            if func in self.collectives:
                name = func._overloadpacket.__name__.strip("_")
                self.comm_bytes[name] += _comm_bytes(func, out, args, kwargs or {})
                self.comm_calls[name] += 1
                if func in self.overlapped:
                    self.overlapped_names.add(name)
            else:
                self._cost(func, args, kwargs or {}, out)
            return out

        def _cost(self, func, args, kwargs, out) -> None:
            flops, compute_s, memory_s = self.roofline.cost(func, args, kwargs, out)
            self.flops += flops
            self.compute_s += compute_s
            self.memory_s += memory_s
            self.roofline_s += max(compute_s, memory_s)
            self.op_s[func._overloadpacket.__name__] += max(compute_s, memory_s)
            if _fusable(func, flops) and any(_BLOCK_NAME.search(name) for name in self._mod_tracker.parents):
                self.block_memory_bound_s += memory_s

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


def _fusable(func, flops: float) -> bool:
    """A memory-bound operator torch.compile fuses: no FLOPs (matmuls and attention have theirs), and not one of
    Liger's kernels (fused already, and opaque to compile like matmuls and attention)."""
    return not flops and func.namespace != liger_reference.NAMESPACE


class _NoHook:
    """The hook handle of a parameter that got no hook."""

    def remove(self) -> None:
        pass


# A decoder block's module name as torch's module tracker reports it (model.model.layers.7, or inside wrappers).
_BLOCK_NAME = re.compile(r"\.layers\.\d+(\.|$)")

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


# ---------------------------------------------------------------------------------------------------------
# The traced step


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
    trials are traced eager; their step time accounts for fusion (predict_step_time) and, under fsdp2, their
    activations for what compiled blocks keep (compiled_block_saving_gib). Liger's Triton kernels are traced
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


def _build_traced(config: TrialConfig, train: TrainSpec) -> tuple[nn.Module, str, dict]:
    """build_meta and the techniques of `train` (a traced TrainSpec), with Liger's reference operators where
    the trial asks for Liger: they come first, as Liger does in worker.TECHNIQUES."""
    model, source, info = build_meta(config.model, train.seed)
    if train.liger:
        model = liger_reference.apply(model)
        train = train.model_copy(update={"liger": False})  # the reference operators stand in for the kernels
    return prepare_model(model, train), source, info


def _liger_rope(config: TrialConfig, shape: ModelShape):
    """The context a Liger trial's forward runs in: Liger's rotary kernel in place of transformers' function."""
    if not config.train.liger:
        return contextlib.nullcontext()
    return liger_reference.rope_patched(shape.model_type)


def trace_step(config: TrialConfig, shape: ModelShape, ctx: RankContext, fake: bool = True,
               gpu: str | None = None, skip_propagation: bool = True) -> StepTrace:
    """Build, wrap and run one training step of `config` on this rank under the step tracker.

    fake=True: storage is fake (call `init_fake_world` first); fake=False: the real thing on a real process
    group (tests compare the two). The caller's process group decides the world. skip_propagation=False leaves
    torch's tracker as it is (the test that pins why the correction is needed).
    """
    on_gpu = config.resources.gpus_per_worker > 0
    train, _ = traced_train(config.train, on_gpu)
    model, source, info = _build_traced(config, train)
    mode = _fake_mode() if fake else contextlib.nullcontext()

    def materialize(whole: bool) -> None:
        with mode:
            to_empty_keeping_ties(model, ctx.device)  # as the worker does: a tied head stays the embedding
        if not fake:  # real runs need real values for a finite loss; fake ones have none to give
            from raybench.model import fill

            fill(model, ctx.device, source, info, whole)

    trainable = strategies.setup(train.strategy, model, train, ctx, materialize)
    if train.strategy == "ddp" and fake:
        trainable.model.register_comm_hook(None, _fake_allreduce_hook)
    fsdp = train.strategy in ("fsdp2", "tp_fsdp2")
    tracker_cls = _tracker(trainable.model, trainable.optimizer, fsdp)
    with mode:
        _create_optimizer_state(trainable)
        batches = fake_batches(train, shape.vocab_size, ctx.device)
        tracker = tracker_cls(_gpu_roofline(gpu))
        if not fsdp:
            tracker.track_external(trainable.model, trainable.optimizer)
        if train.strategy == "ddp":  # its reducer holds a bucket copy of every trainable gradient from construction
            tracker.count_from_start([b.buffer() for b in trainable.model.reducer._get_zeros_like_grad_buckets()])
        marking = _marking_propagation(tracker.propagation) if skip_propagation else contextlib.nullcontext()
        with marking, tracker, _liger_rope(config, shape), _one_sequence_per_row():
            bench.train_step(trainable, batches, train, ctx.device, bench.PhaseClock(ctx.device))
    return StepTrace(
        memory_gib=tracker.category_gib(), resident_gib=_resident_gib(trainable.model, trainable.optimizer),
        comm_bytes=dict(tracker.comm_bytes), comm_calls=dict(tracker.comm_calls),
        overlapped_comm=tuple(sorted(tracker.overlapped_names)), flops=tracker.flops,
        roofline_s=tracker.roofline_s, compute_s=tracker.compute_s, memory_s=tracker.memory_s,
        op_s=dict(sorted(tracker.op_s.items(), key=lambda kv: -kv[1])[:12]),
        block_memory_bound_s=tracker.block_memory_bound_s)


# ---------------------------------------------------------------------------------------------------------
# What torch.compile keeps for backward

# Strategies whose decoder blocks run on plain local tensors (FSDP2 gathers them before the block runs); under
# tp the block's tensors are DTensors and its compiled graph is not inspected here.
COMPILE_INSPECTED_STRATEGIES = ("fsdp2",)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # views share their base's storage: one key per allocation


def _unwrapped_model(config: TrialConfig) -> tuple[nn.Module, TrainSpec]:
    """The trial's model with its techniques (no checkpointing, no compile) on the meta device, in the dtype
    FSDP2's mixed-precision policy computes in (bf16 casts parameters before each forward, fsdp2.shard), and
    the TrainSpec it was built with. Cast on meta: fake storage cannot be swapped in place afterwards."""
    train = config.train.model_copy(update={"ac_ratio": "0", "compile": False})
    model, _, _ = _build_traced(config, train)
    if train.precision == "bf16":
        model.to(torch.bfloat16)
    return model, train


def _block_and_inputs(config: TrialConfig, shape: ModelShape, mode) -> tuple[nn.Module, torch.Tensor, dict]:
    """One decoder block of the trial's model (its techniques applied, unsharded, in its compute dtype) with
    its storage created under `mode` (a FakeTensorMode: shapes only), and inputs as the model passes them:
    hidden states of micro_batch x seq_len, positions, rotary embeddings, no mask (packed batches have none)."""
    model, train = _unwrapped_model(config)
    dtype = next(model.parameters()).dtype
    block = decoder_blocks(model)[-1]
    rotary = next(m for name, m in model.named_modules() if name.endswith("rotary_emb"))
    with mode:
        block.to_empty(device="cpu")
        rotary.to_empty(device="cpu")
        hidden = torch.randn(train.micro_batch, train.seq_len, shape.hidden_size, dtype=dtype, requires_grad=True)
        positions = torch.arange(train.seq_len).unsqueeze(0)
        rope = rotary(hidden, positions)
    return block, hidden, {"position_ids": positions, "position_embeddings": rope, "attention_mask": None}


def _saved_bytes(run, params: nn.Module, mode, kept_by_policy: dict[int, int] | None = None) -> int:
    """Bytes autograd keeps for backward while `run()` runs its forward (`params`' own storage excluded).

    A compiled graph saves what its partitioner chose through its autograd function (`save_for_backward`),
    which the same hooks see, so eager and compiled are counted alike. An eager op-level checkpoint keeps its
    policy's outputs in its own cache, unseen by the hooks: `run` reports those in `kept_by_policy` (storage
    key -> bytes, `_policy_block`)."""
    exclude = {_storage_key(p) for p in params.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[_storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    saved.update(kept_by_policy or {})
    return sum(n for key, n in saved.items() if key not in exclude)


def _partitioned_like_inductor(block: nn.Module, generated_bytes: list[int] | None = None) -> Callable:
    """`block` under torch.compile with inductor's decompositions and partitioner (its joint-graph passes, then
    min-cut rematerialization), so it keeps for backward what the real compile keeps, but with no code
    generated: the partitioned graphs run as they are, on whatever tensors they get (fake ones here).

    generated_bytes: each graph is also lowered and scheduled by inductor (`_scheduled_bytes`), and what its
    generated kernels would read and write is appended there (forward, then backward when it runs)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    def compiler(is_backward: bool):
        def as_is(graph: torch.fx.GraphModule, inputs) -> torch.fx.GraphModule:
            if generated_bytes is not None:
                generated_bytes.append(_scheduled_bytes(graph, inputs, is_backward))
            return graph

        return as_is

    backend = aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True), partition_fn=partition_fn,
                           decompositions=select_decomp_table())
    return torch.compile(block, backend=backend)


def _scheduled_bytes(graph: torch.fx.GraphModule, inputs: list, is_backward: bool) -> int:
    """Bytes the kernels inductor would generate for `graph` read and write: its post-grad passes, lowering and
    scheduler (which fuses), as compile_fx runs them, then no code generated. Matmuls, attention and custom
    operators (Liger's) stay extern kernels and are left out: the roofline prices them as they are.

    Each kernel's count is the scheduler's own (`get_read_write_buffers_sizes`, what inductor's
    `GraphLowering.count_bytes` sums when its metrics log is on)."""
    import copy

    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.debug import DebugContext
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
    from torch._inductor.virtualized import V

    graph = copy.deepcopy(graph)  # the passes rewrite it; the caller runs the original
    view_to_reshape(graph)
    with _disable_current_modes(), DebugContext(), V.set_fake_mode(detect_fake_mode(inputs)):
        _recursive_post_grad_passes(graph, is_inference=False)
        lowering = GraphLowering(graph, example_inputs=inputs, is_inference=False, is_backward=is_backward)
        with V.set_graph_handler(lowering):
            lowering.run(*inputs)
            lowering.init_wrapper_code()
            lowering._update_scheduler()
            return sum(node.get_read_write_buffers_sizes() for node in lowering.scheduler.nodes
                       if not isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode)))


def compiled_block_traffic(config: TrialConfig, shape: ModelShape) -> float:
    """What torch.compile's generated kernels move for one decoder block's forward and backward, as a share of
    what its memory-bound operators (FLOP-less, Liger's left out) move eager: the bytes `block_memory_bound_s`
    prices. Both on fake tensors at the trial's micro-batch, sequence length and compute dtype. Inductor fuses
    a norm's or an activation's chain of elementwise operators into one kernel, but an operator between two
    extern kernels (a residual add between a matmul and Liger's norm) it cannot fuse with anything."""
    eager = _MemoryBoundBytes()
    _block_forward_backward(config, shape, lambda block: block, eager)
    generated: list[int] = []
    torch._dynamo.reset()  # this process's compile state before and after stays as the trace left it
    try:
        _block_forward_backward(config, shape, lambda block: _partitioned_like_inductor(block, generated))
    finally:
        torch._dynamo.reset()
    return sum(generated) / eager.bytes


def _block_forward_backward(config: TrialConfig, shape: ModelShape, wrap: Callable,
                            counting: TorchDispatchMode | None = None) -> None:
    """One decoder block's forward and backward on fake tensors, run as `wrap(block)`, `counting` watching both."""
    mode = _fake_mode()
    block, hidden, kwargs = _block_and_inputs(config, shape, mode)
    run = wrap(block)
    counting = counting or contextlib.nullcontext()
    with _liger_rope(config, shape), mode:
        with counting:
            out = run(hidden, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        grad = torch.ones_like(out)  # outside the count: backward starts from it
        with counting:
            out.backward(grad)


class _MemoryBoundBytes(TorchDispatchMode):
    """Bytes the FLOP-less operators read and write, Liger's left out (as the step tracker's
    block_memory_bound_s counts them, in bytes rather than seconds)."""

    def __init__(self):
        super().__init__()
        self.roofline, self.bytes = _Roofline({}, 1.0), 0.0  # a bandwidth of 1 byte/s: seconds are bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops, _, moved = self.roofline.cost(func, args, kwargs, out)
        if _fusable(func, flops):
            self.bytes += moved
        return out


def compiled_block_saving_gib(config: TrialConfig, shape: ModelShape, op_policy: bool = False) -> float:
    """Activation memory one decoder block keeps for backward run eager, minus what it keeps compiled.

    The eager trace keeps every tensor autograd saves; a compiled block keeps what torch.compile's partitioner
    chose and recomputes the rest (norms, activations, casts) in backward. Each non-checkpointed compiled block
    holds this much less from its forward to its backward (blocks checkpointed whole keep only their input
    either way). op_policy: the block checkpointed with the trial's op-level policy (ac_mode "op"), whose tags
    the partitioner takes as constraints; what it then keeps need not be what the eager policy keeps (on the
    1B sweep's H200 run it was what compile keeps with no checkpointing, to the byte).
    """
    eager, compiled = (_block_kept_bytes(config, shape, run_compiled, op_policy) for run_compiled in (False, True))
    return (eager - compiled) / GIB


def _block_kept_bytes(config: TrialConfig, shape: ModelShape, compiled: bool, op_policy: bool) -> int:
    mode = _fake_mode()
    block, hidden, kwargs = _block_and_inputs(config, shape, mode)
    kept_by_policy: dict[int, int] = {}
    run = _policy_block(block, config.train, None if compiled else kept_by_policy) if op_policy else block
    torch._dynamo.reset()  # this process's compile state before and after stays as the trace left it
    try:
        run = _partitioned_like_inductor(run) if compiled else run
        with _liger_rope(config, shape):
            return _saved_bytes(lambda: run(hidden, **kwargs), block, mode, kept_by_policy)
    finally:
        torch._dynamo.reset()


def _policy_block(block: nn.Module, train: TrainSpec, kept_by_policy: dict[int, int] | None) -> nn.Module:
    """`block` checkpointed with the op-level policy of `train`, as the worker wraps it; the outputs its
    forward keeps go into `kept_by_policy` (storage key -> bytes) when given."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def keep(t: torch.Tensor) -> None:
        kept_by_policy[_storage_key(t)] = t.untyped_storage().nbytes()

    on_saved = keep if kept_by_policy is not None else None
    return checkpoint_wrapper(block, context_fn=activation_checkpointing.policy_context_fn(train, on_saved))


# ---------------------------------------------------------------------------------------------------------
# A decoder block's operators, for an op-level checkpointing policy (torch's SAC estimator and ILP)


def _sac_estimator(roofline: _Roofline):
    """torch's SACEstimator, timing each operator with raybench's roofline.

    Its own modes cannot run here: "operator-level-cost-model" (RuntimeEstimator._roofline_estimate) asserts
    torch.cuda.is_available() to read the device's peak FLOP/s and bandwidth, and "operator-level-benchmark"
    runs real CUDA kernels. The estimator calls the runtime function it holds on the instance
    (`_estimate_runtime`, set by __init__ and __call__), so this instance gets raybench's roofline for the GPU
    the trial will run on, and nothing global changes.
    """
    from torch.distributed._tools.sac_estimator import SACEstimator

    # The estimator matches what autograd saves to operators by hash(storage), which is the storage object's
    # id: once an operator's output is freed, a tensor saved later may get its id and mark that operator as
    # saved too (it happened at random, 1 run in ~5). Holding every output while the estimator lives keeps each
    # id unique; they are fake tensors, so this holds no memory.
    outputs = []

    def estimate_ms(func, args, kwargs):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs.append(out)
        _, compute_s, memory_s = roofline.cost(func, args, kwargs, out)
        return out, max(compute_s, memory_s) * 1e3  # SACStats keep milliseconds

    estimator = SACEstimator()
    estimator._estimate_runtime = estimate_ms
    return estimator


def block_ops(config: TrialConfig, shape: ModelShape, gpu: str) -> dict:
    """One decoder block's operators in forward, as torch's SACStats (plain data): each operator's name, output
    bytes, roofline milliseconds on `gpu`, and the estimator's constraints (views, random and in-place ops).

    One forward of the trial's model (its techniques applied, no checkpointing) on fake tensors, not wrapped:
    FSDP2 would run its all-gathers and parameter casts inside each block and they would count as the block's
    operators. FSDP2's bf16 mixed-precision policy computes in bf16 (parameters cast before each forward),
    which casting the whole model reproduces. Every block runs the same operators; the first one's are taken.
    """
    model, train = _unwrapped_model(config)
    estimator = _sac_estimator(_gpu_roofline(gpu))
    with _fake_mode():
        model.to_empty(device="cpu")
        batch = next(fake_batches(train, shape.vocab_size, torch.device("cpu")))
        with estimator, _liger_rope(config, shape), _one_sequence_per_row():
            model(input_ids=batch["input_ids"], use_cache=False)
    first = next(name for name in estimator.sac_mod_stats if _FIRST_BLOCK.search(name))
    return dataclasses.asdict(estimator.sac_mod_stats[first])


# The first decoder block's name as torch's module tracker reports it (LlamaForCausalLM.model.layers.0).
_FIRST_BLOCK = re.compile(r"\.layers\.0$")


# ---------------------------------------------------------------------------------------------------------
# Step time


# The three constants fitted on measurements; every other figure of the prediction comes from the trace.
# Achieved fraction of the per-operator roofline (peak FLOP/s and memory bandwidth) on an H100 SXM, the median
# of roofline / measured step time over the 10 eager rows of the committed 1B sAC sweep
# (docs/results/gpu-2026-11-22/gpu-sac-1b.parquet): 0.7048, range 0.67-0.72 (docs/results/rehearse-2026-11-25.md).
# Other GPUs get the same fraction of their own roofline, with tensor-core peaks scaled by their measured matmul
# efficiency relative to this GPU's (`matmul_efficiency_ratio`; the hardware table's public MAMF figures).
ROOFLINE_EFFICIENCY = 0.70
ROOFLINE_REFERENCE_GPU = "H100 SXM"
# The caching allocator reserves more than the tensors it holds (block rounding, fragmentation), and GPU rows
# report the reserved peak. Fitted the same way: median peak_reserved_gib / peak_alloc_gib over the same 10
# rows, 1.159 (range 1.12-1.23). A GPU rehearsal's reserved_gib is its tensor peak times this.
ALLOCATOR_RESERVE = 1.16
# torch.compile (not traced: compiled trials trace eager) fuses the elementwise, reduction and copy operators
# of each compiled decoder block into generated kernels; how many bytes those move, against the eager
# operators', inductor itself counts on one block (compiled_block_traffic). A byte its kernels move costs this
# many times a byte of the eager operators' roofline. Fitted like the two above on the 10 compiled rows of the
# same sweep (docs/results/rehearse-2026-11-26.md, section 5).
COMPILED_BYTE_COST = 1.26


@dataclass(frozen=True)
class Link:
    """Nominal links of one GPU, GB/s in each direction (vendor data sheets)."""

    nvlink_gbps: float  # NVLink, between the GPUs of one NVLink domain
    nic_gbps: float  # its network adapter (one per GPU) to the GPUs beyond the domain
    nvlink_gpus: int  # GPUs in one NVLink domain: 8 in an HGX node, 72 in a GB200 NVL72 rack


# Used when the cluster has no stored all-reduce probe. H100/H200 SXM: NVLink 4, 900 GB/s bidirectional (450
# each way), one 400 Gb/s NDR NIC per GPU (50 GB/s). A100 SXM: NVLink 3, 600 GB/s (300 each way), one 200 Gb/s
# HDR NIC per GPU (25 GB/s). B200: NVLink 5, 1.8 TB/s (900 each way), 400 Gb/s per GPU. Eight GPUs to an NVLink
# domain, except GB200 NVL72, whose NVLink switches join the 72 GPUs of a rack (18 trays of 4). First match
# wins, so GB200 comes before B200.
LINKS = {"GB200": Link(900.0, 50.0, 72), "B200": Link(900.0, 50.0, 8), "H100": Link(450.0, 50.0, 8),
         "H200": Link(450.0, 50.0, 8), "A100": Link(300.0, 25.0, 8)}


def link_busbw_gbps(gpu: str | None, world_size: int) -> float | None:
    """Bus bandwidth a ring collective reaches on nominal links.

    Within an NVLink domain: NVLink. Beyond it, each of NCCL's rings leaves the domain once and NCCL spreads its
    rings over the domain's NICs, so a rank's bus bandwidth is the domain's NICs together, capped by NVLink
    (nccl-tests across 8-GPU nodes with 8 NICs reach about 8 x the one-NIC figure)."""
    link = next((v for k, v in LINKS.items() if gpu and k.lower() in gpu.lower()), None)
    if link is None or world_size == 1:  # one rank communicates with nobody
        return None
    if world_size <= link.nvlink_gpus:
        return link.nvlink_gbps
    return min(link.nvlink_gbps, link.nvlink_gpus * link.nic_gbps)


# nccl-tests' bus-bandwidth factors: the share of a collective's buffer that crosses each link of the ring.
def _bus_factor(collective: str, world_size: int) -> float:
    n = world_size
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n if "allreduce" in collective or "all_reduce" in collective else (n - 1) / n


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # roofline of every operator
    comm_s: float  # every collective at the bus bandwidth
    exposed_comm_s: float  # the part of comm_s not hidden behind compute
    step_time_s: float
    busbw_gbps: float | None
    busbw_source: str  # "set" (estimate.busbw_gbps, --busbw), "probe" (the store's all-reduce measurement of
    # the cluster), "links" (nominal), "none"
    overlap: str  # the assumption, in words


def predict_step_time(trace: StepTrace, world_size: int, busbw_gbps: float | None, busbw_source: str,
                      efficiency: float = ROOFLINE_EFFICIENCY, compiled_traffic: float | None = None) -> StepTime:
    """Roofline compute plus communication; FSDP/DDP collectives overlap compute, the others (TP) do not.

    efficiency scales the roofline (achieved fraction of peak FLOP/s and bandwidth), a global constant.
    compiled_traffic (compiled trials, `compiled_block_traffic`): the decoder blocks' memory-bound operators
    run as inductor's kernels, which move this share of their bytes at COMPILED_BYTE_COST times the price (the
    trace itself runs them eager).
    """
    fused_s = 0.0
    if compiled_traffic is not None:
        fused_s = (1 - COMPILED_BYTE_COST * compiled_traffic) * trace.block_memory_bound_s
    compute_s = (trace.roofline_s - fused_s) / efficiency
    overlapped = blocking = 0.0
    for name, nbytes in trace.comm_bytes.items():
        if busbw_gbps:
            seconds = nbytes * _bus_factor(name, world_size) / (busbw_gbps * 1e9)
            if name in trace.overlapped_comm:
                overlapped += seconds
            else:
                blocking += seconds
    exposed = blocking + max(0.0, overlapped - compute_s)
    return StepTime(compute_s=compute_s, comm_s=overlapped + blocking, exposed_comm_s=exposed,
                    step_time_s=compute_s + exposed, busbw_gbps=busbw_gbps, busbw_source=busbw_source,
                    overlap="FSDP all-gathers/reduce-scatters and DDP all-reduces run beside compute (exposed only "
                            "beyond it); other collectives (TP) are on the critical path")


# ---------------------------------------------------------------------------------------------------------
# Op-level policy: which operators of every decoder block to save, by torch's ILP, within a memory limit


@dataclass
class OpPolicy:
    """The op-level checkpointing policy for every decoder block, and what the step would be with it."""

    saved: dict[str, int]  # operator -> how many of one block's run are saved in forward (not recomputed)
    recomputed: dict[str, int]  # operator -> how many backward recomputes (views, free, left out)
    ac_saved_ops: list[str]  # the policy as train.ac_saved_ops, to run it (ac_mode op)
    kept_fraction: float  # the ILP's budget: share of the block's recomputable output bytes it may keep
    saved_gib_per_block: float  # what the policy keeps per block run eager
    peak_gib: float  # tensor peak (compiled blocks: what the partitioner keeps given the policy, `compiled_policy`)
    reserved_gib: float  # x ALLOCATOR_RESERVE, as rehearsals report for GPUs
    compute_s: float
    step_time_s: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _recomputable(ops: dict):
    """The block's operators as torch's SACStats, cut after the last one whose output autograd saves.

    Non-reentrant checkpointing stops recomputing once backward has every tensor it saved (early stop, torch's
    default), so the operators after that one (a Llama block's down projection and residual add) are never
    recomputed: saving them would cost memory for nothing, and the full-AC trace the policy starts from did
    not recompute them either.
    """
    from torch.distributed._tools.sac_estimator import SACStats

    end = max(ops["saved_autograd_ops"]) + 1
    return SACStats(
        func_names=ops["func_names"][:end], runtimes=ops["runtimes"][:end], memory=ops["memory"][:end],
        view_like_ops=[i for i in ops["view_like_ops"] if i < end], rand_ops=[i for i in ops["rand_ops"] if i < end],
        saved_autograd_ops=[i for i in ops["saved_autograd_ops"] if i < end],
        inplace_ops=[tuple(pair) for pair in ops["inplace_ops"] if max(pair) < end],
        force_store_random=ops["force_store_random"])


def _kib(memory: list[int]) -> list[int]:
    """Byte counts in KiB, rounded up, as the ILP takes them: with byte counts (~1e9 per block at 1B scale) CBC
    reported the 1B block's problem at a kept fraction of 1.0 infeasible, which it is not (saving nothing always
    fits). Rounded up, what a fraction of the KiB total admits also fits that fraction of the byte room."""
    return [-(-nbytes // 1024) for nbytes in memory]


def _solve(stats, kept_fraction: float) -> list[int]:
    """torch's ILP (PuLP's CBC): per operator 1 = save, 0 = recompute, keeping at most kept_fraction of the
    block's output bytes while recomputing the least time."""
    from torch.distributed._tools.sac_ilp import get_optimal_checkpointing_policy_per_module

    in_kib = dataclasses.replace(stats, memory=_kib(stats.memory))
    decisions = get_optimal_checkpointing_policy_per_module(in_kib, kept_fraction)
    if not decisions:
        raise RuntimeError(f"torch's SAC ILP found no policy for a kept fraction of {kept_fraction:.3f}")
    return decisions


def op_policy(full_ac: dict, layers: int, reserved_limit_gib: float,
              efficiency: float = ROOFLINE_EFFICIENCY) -> OpPolicy | None:
    """The op-level policy torch's ILP picks for every decoder block so that the GPU's reserved peak stays
    within `reserved_limit_gib`, from the rehearsal of the same trial with every block checkpointed whole
    (`full_ac`: a Rehearsal as a dict, with block_ops; a compiled trial's has its compiled_traffic). None when
    even full AC does not fit.

    With every block checkpointed, each keeps only its input; a policy that saves S bytes of a block's
    operator outputs adds layers x S to that peak, and takes the saved operators' time off the recomputation
    the full-AC step pays. Both come from the trace (the same roofline, `block_ops`), nothing is fitted here.
    """
    stats = _recomputable(full_ac["block_ops"])
    room_gib = reserved_limit_gib / ALLOCATOR_RESERVE - full_ac["peak_gib"]
    if room_gib < 0:
        return None
    kept_fraction = min(1.0, room_gib * GIB / 1024 / layers / sum(_kib(stats.memory)))
    decisions = _solve(stats, kept_fraction)
    views = set(stats.view_like_ops)
    saved = [i for i, keep in enumerate(decisions) if keep]
    flop_ops = {packet.__name__ for packet in _flop_formulas()}
    saved_s = sum(stats.runtimes[i] for i in saved) / 1e3
    saved_memory_bound_s = sum(stats.runtimes[i] for i in saved if stats.func_names[i] not in flop_ops) / 1e3
    saved_bytes = sum(stats.memory[i] for i in saved)
    trace = StepTrace(memory_gib={}, resident_gib={}, comm_bytes=full_ac["comm_bytes"], comm_calls={},
                      overlapped_comm=tuple(full_ac["overlapped_comm"]), flops=0.0,
                      roofline_s=full_ac["roofline_s"] - layers * saved_s, compute_s=0.0, memory_s=0.0,
                      block_memory_bound_s=full_ac["block_memory_bound_s"] - layers * saved_memory_bound_s)
    timing = predict_step_time(trace, full_ac["world_size"], full_ac["busbw_gbps"], full_ac["busbw_source"],
                               efficiency, full_ac.get("compiled_traffic"))
    peak = full_ac["peak_gib"] + layers * saved_bytes / GIB
    return OpPolicy(
        saved=_counts(stats.func_names, saved), kept_fraction=kept_fraction,
        ac_saved_ops=_as_saved_ops(full_ac["block_ops"]["func_names"], [i for i in saved if i not in views]),
        recomputed=_counts(stats.func_names, [i for i, keep in enumerate(decisions) if not keep and i not in views]),
        saved_gib_per_block=saved_bytes / GIB, peak_gib=peak, reserved_gib=peak * ALLOCATOR_RESERVE,
        compute_s=timing.compute_s, step_time_s=timing.step_time_s)


def compiled_policy(policy: OpPolicy, config: TrialConfig, shape: ModelShape) -> OpPolicy:
    """`policy` for blocks that run compiled: torch.compile's partitioner takes the policy's tags as constraints
    and keeps what it then chooses, which the ILP (eager) does not see (compiled_block_saving_gib)."""
    train = config.train.model_copy(update={"ac_ratio": "1", "ac_mode": "op", "ac_saved_ops": policy.ac_saved_ops})
    saving = compiled_block_saving_gib(config.model_copy(update={"train": train}), shape, op_policy=True)
    peak = policy.peak_gib - shape.num_hidden_layers * saving
    return dataclasses.replace(policy, peak_gib=peak, reserved_gib=peak * ALLOCATOR_RESERVE)


def _as_saved_ops(names: list[str], saved: list[int]) -> list[str]:
    """Saved operators (indices into one block's `names`, in forward order) as train.ac_saved_ops spells them:
    a name when every call of it in the block is saved, else name#k for its k-th call."""
    names = [activation_checkpointing.policy_name(name) for name in names]
    calls = [names[:i].count(name) for i, name in enumerate(names)]
    kept = set(saved)
    spelled = []
    for name in dict.fromkeys(names):
        indices = [i for i, n in enumerate(names) if n == name]
        if all(i in kept for i in indices):
            spelled.append(name)
        else:
            spelled += [f"{name}#{calls[i]}" for i in indices if i in kept]
    return spelled


def _counts(names: list[str], indices: list[int]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for i in indices:
        counts[names[i]] += 1
    return dict(counts)


# ---------------------------------------------------------------------------------------------------------
# One trial


@dataclass
class Rehearsal:
    """One trial's rehearsal (or its analytic fallback), per rank, as plain data."""

    method: str  # "traced" or "analytic"
    notes: list[str]
    rank: int
    world_size: int
    memory_gib: dict[str, float] = field(default_factory=dict)
    peak_gib: float | None = None  # tensor memory at the step's peak (what torch's allocator would hold)
    reserved_gib: float | None = None  # GPU trials: what the caching allocator would reserve (x ALLOCATOR_RESERVE)
    resident_gib: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    flops: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    exposed_comm_s: float | None = None
    step_time_s: float | None = None
    busbw_gbps: float | None = None
    busbw_source: str | None = None
    overlap: str | None = None
    roofline_s: float | None = None  # the trace's roofline before efficiency (what the constants are fitted on)
    block_memory_bound_s: float | None = None  # its memory-bound part inside decoder blocks (compile fuses it)
    compiled_traffic: float | None = None  # compiled trials: compiled_block_traffic
    trace_s: float | None = None  # seconds this process spent tracing (0 when an identical trace was reused)
    overlapped_comm: list[str] = field(default_factory=list)  # collectives issued beside compute (op_policy)
    block_ops: dict | None = None  # one decoder block's operators, when op_policy can start from this trial

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _analytic(config: TrialConfig, analytic: dict | None, rank: int, why: str) -> Rehearsal:
    """The analytic estimate in a rehearsal's shape, saying why the trial was not traced."""
    est = analytic or {}
    memory = {"parameters": est.get("params_gib"), "gradients": est.get("grads_gib"),
              "optimizer_state": est.get("optimizer_gib"), "activations": est.get("activations_gib")}
    return Rehearsal("analytic", [why + "; analytic estimate"], rank, config.resources.workers, memory_gib=memory,
                     peak_gib=est.get("measured_part_gib"), step_time_s=est.get("step_time_s"))


def why_not_traceable(config: TrialConfig) -> str | None:
    train = config.train
    if train.strategy not in TRACEABLE_STRATEGIES:
        return f"strategy {train.strategy} is not traced (it needs real storage or communication)"
    if train.finetune == "qlora":
        return "qlora is not traced (bitsandbytes quantizes real weights on CUDA)"
    if train.liger and train.strategy != "fsdp2":
        return (f"liger is traced under fsdp2 only (its reference operators take plain tensors, {train.strategy} "
                "DTensors)")
    return None


def rehearse(config: TrialConfig, shape: ModelShape, gpu: str | None, busbw_gbps: float | None = None,
             busbw_source: str = "probe", analytic: dict | None = None, efficiency: float = ROOFLINE_EFFICIENCY,
             rank: int = 0, traces: dict | None = None) -> Rehearsal:
    """Trace `config` as `rank` of its full world, or fall back to its analytic estimate (`analytic`).

    `traces` (a dict the caller keeps) reuses the trace of a trial whose traced step is identical: compiled
    and eager twins trace the same eager step and differ only in the predicted time.
    """
    world = config.resources.workers
    why_not = why_not_traceable(config)
    if why_not:
        return _analytic(config, analytic, rank, why_not)
    on_gpu = config.resources.gpus_per_worker > 0
    _, notes = traced_train(config.train, on_gpu)
    traces = {} if traces is None else traces
    key = (config_id(traced_config(config)), rank, gpu if on_gpu else None)
    t0 = time.perf_counter()
    if key not in traces:
        init_fake_world(rank, world)
        try:
            ctx = RankContext(rank, world, rank, torch.device("cpu"))
            traces[key] = trace_step(config, shape, ctx, fake=True, gpu=gpu if on_gpu else None)
            if on_gpu and gpu and is_policy_base(config):
                traces[key].block_ops = block_ops(config, shape, gpu)
        except Exception as err:  # one trial's model or technique the trace cannot run must not stop a sweep
            return _analytic(config, analytic, rank, f"trace failed ({type(err).__name__}: {err})"[:300])
        finally:
            dist.destroy_process_group()
    trace = traces[key]
    memory = dict(trace.memory_gib)
    if config.train.compile and config.train.strategy in COMPILE_INSPECTED_STRATEGIES:
        saving_gib = _compiled_saving_gib(config, shape, rank, traces)
        if saving_gib is not None:
            memory["activations"] -= saving_gib
            notes = [COMPILED_ACTIVATIONS_NOTE if n == COMPILE_NOTE else n for n in notes]
    traffic = None
    if config.train.compile and on_gpu:
        traffic, why_not = _compiled_traffic(config, shape, traces)
        notes += [why_not] if why_not else []
    peak_gib = sum(memory.values())
    source = busbw_source if busbw_gbps else "links"
    busbw = busbw_gbps or link_busbw_gbps(gpu, world)
    timing = predict_step_time(trace, world, busbw, source if busbw else "none", efficiency, traffic)
    has_time = on_gpu and trace.roofline_s > 0
    return Rehearsal(
        "traced", notes, rank, world, memory_gib=memory, peak_gib=peak_gib,
        reserved_gib=peak_gib * (ALLOCATOR_RESERVE if on_gpu else 1.0),
        resident_gib=trace.resident_gib, comm_bytes=trace.comm_bytes, flops=trace.flops,
        compute_s=timing.compute_s if has_time else None, comm_s=timing.comm_s if busbw else None,
        exposed_comm_s=timing.exposed_comm_s if has_time and busbw else None,
        step_time_s=timing.step_time_s if has_time else None, busbw_gbps=busbw, busbw_source=timing.busbw_source,
        overlap=timing.overlap, roofline_s=trace.roofline_s if has_time else None,
        block_memory_bound_s=trace.block_memory_bound_s if has_time else None, compiled_traffic=traffic,
        trace_s=time.perf_counter() - t0,
        overlapped_comm=list(trace.overlapped_comm), block_ops=trace.block_ops if has_time else None)


def _compiled_saving_gib(config: TrialConfig, shape: ModelShape, rank: int, traces: dict) -> float | None:
    """What the compiled blocks of a trial keep less than the eager trace counts (compiled_block_saving_gib):
    every block not checkpointed, and every block under an op-level policy; blocks checkpointed whole keep their
    input either way. None when no block is of those kinds."""
    layers = shape.num_hidden_layers
    checkpointed = len(checkpointed_blocks(Fraction(config.train.ac_ratio), layers))
    counts = {False: layers - checkpointed, True: checkpointed if config.train.ac_mode == "op" else 0}
    if not any(counts.values()):
        return None
    saving_gib = 0.0
    for op_policy, blocks in counts.items():
        if not blocks:
            continue
        # One block's saving does not depend on how many blocks are checkpointed: a sweep's sAC ratios share it.
        block_train = {"ac_ratio": "1" if op_policy else "0"}
        one = config.model_copy(update={"train": config.train.model_copy(update=block_train)})
        key = ("compiled block saving", config_id(traced_config(one)), rank)
        if key not in traces:
            traces[key] = compiled_block_saving_gib(config, shape, op_policy)
        saving_gib += blocks * traces[key]
    return saving_gib


def _compiled_traffic(config: TrialConfig, shape: ModelShape, traces: dict) -> tuple[float | None, str | None]:
    """compiled_block_traffic for a compiled trial, or None and why: a block inductor cannot lower is priced
    eager, and the sweep's other trials go on."""
    # One block's traffic does not depend on checkpointing or the strategy: a sweep's compiled trials share it.
    block_train = {"ac_ratio": "0", "ac_mode": "block", "ac_saved_ops": None, "strategy": "fsdp2", "tp_size": 1}
    one = config.model_copy(update={"train": config.train.model_copy(update=block_train)})
    key = ("compiled block traffic", config_id(traced_config(one)))
    if key not in traces:
        try:
            traces[key] = compiled_block_traffic(config, shape)
        except Exception as err:  # inductor failing to lower one model must not stop a sweep
            traces[key] = f"compile's fusion not counted, step priced eager ({type(err).__name__}: {err})"[:300]
    found = traces[key]
    return (None, found) if isinstance(found, str) else (found, None)


def is_policy_base(config: TrialConfig) -> bool:
    """Whether an op-level policy (op_policy) starts from this trial's rehearsal: every decoder block
    checkpointed whole, under FSDP2, whose ranks run whole blocks (TP shards each block's operators)."""
    train = config.train
    return train.strategy == "fsdp2" and train.ac_mode == "block" and Fraction(train.ac_ratio) == 1
