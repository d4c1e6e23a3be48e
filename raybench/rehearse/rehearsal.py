"""One trial's rehearsal: its step traced as one rank of its full world and priced on its GPU, or the analytic
estimate where the trace cannot run it, with the reason."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.distributed as dist

from raybench.planning.estimate import Estimate
from raybench.planning.plan import config_id
from raybench.rehearse import depth, worlds
from raybench.rehearse.compiled import compiled_block_saving_gib, compiled_block_traffic, offloaded_block_bytes
from raybench.rehearse.fake_world import init_fake_world
from raybench.rehearse.fitted import SHIPPED_CALIBRATION, Calibration
from raybench.rehearse.policy import block_ops
from raybench.rehearse.step_time import Layout, gathered_after_step, layout_of, link_busbw_gbps, predict_step_time
from raybench.rehearse.trace import StepTrace, trace_step
from raybench.rehearse.traced_model import (
    COMPILE_NOTE,
    COMPILED_ACTIVATIONS_NOTE,
    model_notes,
    traced_config,
    traced_train,
)
from raybench.runtime.strategies import RankContext
from raybench.runtime.techniques import activation_offload
from raybench.spec.hardware import host_link_gb_per_s
from raybench.spec.presets import ModelShape
from raybench.spec.schema import GIB
from raybench.spec.sac import checkpointed_blocks
from raybench.spec.strategies import FSDP2
from raybench.spec.sweep_spec import TrialConfig


@dataclass
class Rehearsal:
    """One trial's rehearsal (or its analytic fallback), per rank, as plain data."""

    method: str  # "traced" or "analytic"
    notes: list[str]
    rank: int
    world_size: int
    memory_gib: dict[str, float] = field(default_factory=dict)
    peak_gib: float | None = None  # tensor memory at the step's peak (what torch's allocator would hold)
    reserved_gib: float | None = None  # GPU trials: what the caching allocator would reserve (x its reserve)
    resident_gib: dict[str, float] = field(default_factory=dict)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_calls: dict[str, int] = field(default_factory=dict)
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
    grad_accum: int = 1  # micro-batches per step: the times and collectives cover them all, the memory the peak
    calibration: dict | None = None  # traced: the Calibration that priced it (its source names the profile)
    launches: int | None = None  # kernels the step launches (collectives apart)
    host_s: float | None = None  # launches x the profile's launch cost (compute_s is the longer of it and the GPU's)
    comm_latency_s: float | None = None  # the collectives' latency per call, part of comm_s
    comm_algorithms: dict[str, str] | None = None  # per collective, the algorithm NCCL's model runs it with
    layout: dict | None = None  # GPUs and NICs per node the collectives were priced on
    timeline: list | None = None  # StepTrace.timeline, kept where op_policy may start from this trial (block_ops)
    # Activations and temporaries where together they hold the most, at the peak or not (`_working_gib`): what a
    # ZeRO trial holds beside its own states (`_zero_from_twin`).
    working_gib: dict[str, float] = field(default_factory=dict)
    gpu: str | None = None  # the GPU it was priced for (`best --predict --gpu` refuses another's); None on CPU

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _analytic(config: TrialConfig, analytic: Estimate | None, rank: int, why: str) -> Rehearsal:
    """The analytic estimate in a rehearsal's shape, saying why the trial was not traced."""
    if analytic is None:
        return Rehearsal("analytic", [why + "; analytic estimate"], rank, config.resources.workers,
                         memory_gib=dict.fromkeys(("parameters", "gradients", "optimizer_state", "activations")))
    memory = {"parameters": analytic.params_gib, "gradients": analytic.grads_gib,
              "optimizer_state": analytic.optimizer_gib, "activations": analytic.activations_gib}
    return Rehearsal("analytic", [why + "; analytic estimate"], rank, config.resources.workers, memory_gib=memory,
                     peak_gib=analytic.measured_part_gib, step_time_s=analytic.step_time_s)


def why_not_traceable(config: TrialConfig) -> str | None:
    train = config.train
    if not train.parallelism.traced:
        return f"strategy {train.strategy} is not traced (it needs real storage or communication)"
    if train.tuning.quantized_base:
        return "qlora is not traced (bitsandbytes quantizes real weights on CUDA)"
    return None


# A ZeRO trial's rehearsal: what DeepSpeed holds for the whole step, and what its FSDP2 twin's trace holds at its peak.
ZERO_NOTE = ("ZeRO-{stage}: weights, gradients and optimizer state as DeepSpeed partitions them (16-bit weights, "
             "fp32 master and states over the ranks, its reduce buckets), activations and temporaries traced on "
             "its FSDP2 twin; step time the twin's operators and collectives (ZeRO-3: weights gathered in forward "
             "and again in backward; ZeRO-1/2: once a step, after the optimizer step, with nothing beside it)")


def zero_twin(config: TrialConfig) -> TrialConfig | None:
    """The FSDP2 trial that runs a DeepSpeed ZeRO trial's operators and moves its bytes: each rank computes on
    whole 16-bit weights gathered from shards, reduce-scatters its gradients, and steps the optimizer on its shard
    of fp32 weights and states. ZeRO-3 frees the gathered weights after forward and gathers them again for
    backward (FSDP2's reshard_after_forward); ZeRO-1/2 keep them whole and gather the updated shards once a step,
    which moves the bytes of FSDP2 gathering once and keeping them through backward. With bf16 both reduce the
    gradients in bf16 (DeepSpeed's communication dtype is the model's). None where DeepSpeed does what FSDP2 does
    not: offload (the optimizer runs on the host) and qlora."""
    train = config.train
    if not train.parallelism.zero or train.offload != "none" or train.tuning.quantized_base:
        return None
    reduce_dtype = "bf16" if train.precision == "bf16" else "fp32"
    twin = train.model_copy(update={"strategy": "fsdp2", "reshard_after_forward": train.zero_stage == 3,
                                    "reduce_dtype": reduce_dtype})
    return config.model_copy(update={"train": twin})


def _zero_from_twin(config: TrialConfig, twin: Rehearsal, analytic: Estimate | None, why: str) -> Rehearsal:
    """A ZeRO trial's rehearsal from its FSDP2 twin's (zero_twin): the states DeepSpeed keeps for the whole step
    (its weights, gradients with their buckets, fp32 master and optimizer state: the estimate's partitioning) in
    place of FSDP2's, beside the activations and temporaries the twin's trace holds at its peak, which the two run
    alike (the same operators on the same micro-batches); the twin's step time, collectives and micro-batches. The
    analytic estimate where the twin was not traced, or no estimate is at hand."""
    if twin.method != "traced" or analytic is None:
        return _analytic(config, analytic, twin.rank, why)
    memory = {"parameters": analytic.params_gib, "gradients": analytic.grads_gib,
              "optimizer_state": analytic.optimizer_gib, **twin.working_gib}
    peak_gib = sum(memory.values())
    reserve = twin.reserved_gib / twin.peak_gib if twin.reserved_gib and twin.peak_gib else 1.0
    notes = [ZERO_NOTE.format(stage=config.train.zero_stage), *twin.notes]
    # The twin's operator list and timeline are an FSDP2 step's, which an op-level policy must not start from.
    return dataclasses.replace(twin, notes=notes, memory_gib=memory, peak_gib=peak_gib,
                               reserved_gib=peak_gib * reserve, resident_gib={}, block_ops=None, timeline=None)


def rehearse(config: TrialConfig, shape: ModelShape, gpu: str | None, busbw_gbps: float | None = None,
             busbw_source: str = "probe", analytic: Estimate | None = None,
             calibration: Calibration = SHIPPED_CALIBRATION, rank: int = 0, traces: dict | None = None,
             extrapolate_depth: bool = True, layout: Layout | None = None, share_worlds: bool = True,
             gathers_after_step: bool = False) -> Rehearsal:
    """Trace `config` as `rank` of its full world, or fall back to its analytic estimate (`analytic`).

    `calibration` prices it: the shipped H100 constants, or the profile `raybench calibrate` stored for the
    device (a CPU profile gives CPU trials a roofline, and so a step time); the row names it in its notes.

    `traces` (a dict the caller keeps) reuses the trace of a trial whose traced step is identical: compiled
    and eager twins trace the same eager step and differ only in the predicted time. A deep model's step is
    extrapolated from shallow ones (depth.py) unless extrapolate_depth is False, and those are reused too: a
    sweep's sAC ratios share most of theirs. An FSDP2 or TP x FSDP2 step (each shallow one) is shared across world
    sizes (worlds.py) once two world sizes are traced, unless share_worlds is False.

    `layout` (the sweep's estimate.gpus_per_node and nics_per_node) places the ranks on nodes for the
    collectives' bandwidth and latency; None: the GPU's NVLink domain, one NIC per GPU.

    `gathers_after_step`: a ZeRO-1/2 trial's twin, priced as DeepSpeed gathers (step_time.gathered_after_step).
    """
    world = config.resources.workers
    calibration = calibration.for_finetune(config.train.tuning)  # stored with the rehearsal, as priced
    why_not = why_not_traceable(config)
    if why_not:
        twin = zero_twin(config)
        if twin is None:
            return _analytic(config, analytic, rank, why_not)
        traced_twin = rehearse(twin, shape, gpu, busbw_gbps, busbw_source, None, calibration, rank, traces,
                               extrapolate_depth, layout, share_worlds, gathers_after_step=config.train.zero_stage < 3)
        return _zero_from_twin(config, traced_twin, analytic, why_not)
    on_gpu = config.resources.gpus_per_worker > 0
    _, notes = traced_train(config.train, on_gpu)
    notes = [*notes, *model_notes(config.model)]
    full_loss = config.train.full_loss_reason(shape.tie_word_embeddings)
    if full_loss and config.train.loss == "chunked" and not config.train.liger:  # the trial's loss, as it runs
        notes = [*notes, f"loss full: {full_loss}"]
    traces = {} if traces is None else traces
    key = (config_id(step_config(config)), rank, gpu if on_gpu else None, calibration.source)
    t0 = time.perf_counter()
    if key not in traces:
        try:
            traces[key], trace_notes = _deep_trace(config, shape, rank, gpu if on_gpu else None, calibration,
                                                   traces, extrapolate_depth, share_worlds)
            if on_gpu and gpu and is_policy_base(config):
                ops_key = block_ops_key(config, gpu, calibration)
                if ops_key not in traces:
                    traces[ops_key] = block_ops(config, shape, gpu, calibration)
                traces[key].block_ops = traces[ops_key]
        except Exception as err:  # one trial's model or technique the trace cannot run must not stop a sweep
            return _analytic(config, analytic, rank, f"trace failed ({type(err).__name__}: {err})"[:300])
        traces[key, "trace notes"] = trace_notes
    notes = [*notes, *traces[key, "trace notes"]]
    trace = gathered_after_step(traces[key]) if gathers_after_step else traces[key]
    memory = dict(trace.memory_gib)
    if config.train.compile:
        saving_gib = _compiled_saving_gib(config, shape, rank, traces)
        if isinstance(saving_gib, str):
            notes = [*notes, saving_gib]
        elif saving_gib is not None:
            memory["activations"] -= saving_gib
            notes = [COMPILED_ACTIVATIONS_NOTE if n == COMPILE_NOTE else n for n in notes]
    traffic = None
    if config.train.compile and on_gpu:
        traffic, why_not = _compiled_traffic(config, shape, traces)
        notes += [why_not] if why_not else []
    copies_s = 0.0
    if config.train.offload_activations and on_gpu:
        offloaded_gib, copies_s, note = _offloaded(config, shape, gpu, traces)
        memory["activations"] -= offloaded_gib
        notes = [*notes, note]
    peak_gib = sum(memory.values())
    working_gib = _working_gib(trace, trace.memory_gib["activations"] - memory["activations"])
    source = busbw_source if busbw_gbps else "links"
    layout = (layout or layout_of(gpu)) if on_gpu else None
    busbw = busbw_gbps or link_busbw_gbps(gpu, world, layout)
    timing = predict_step_time(trace, world, busbw, source if busbw else "none", calibration.efficiency, traffic,
                               launch_s=calibration.launch_s if on_gpu else None, layout=layout)
    has_time = (on_gpu or bool(calibration.peaks)) and trace.roofline_s > 0
    notes = [*notes, f"priced with {calibration.source}"] if on_gpu or calibration.profiled else notes
    return Rehearsal(
        "traced", notes, rank, world, memory_gib=memory, peak_gib=peak_gib,
        reserved_gib=peak_gib * (calibration.reserve if on_gpu else 1.0),
        resident_gib=trace.resident_gib, comm_bytes=trace.comm_bytes, comm_calls=trace.comm_calls, flops=trace.flops,
        compute_s=timing.compute_s + copies_s if has_time else None, comm_s=timing.comm_s if busbw else None,
        exposed_comm_s=timing.exposed_comm_s if has_time and busbw else None,
        step_time_s=timing.step_time_s + copies_s if has_time else None, busbw_gbps=busbw,
        busbw_source=timing.busbw_source,
        overlap=timing.overlap, roofline_s=trace.roofline_s if has_time else None,
        block_memory_bound_s=trace.block_memory_bound_s if has_time else None, compiled_traffic=traffic,
        trace_s=time.perf_counter() - t0,
        overlapped_comm=list(trace.overlapped_comm), block_ops=trace.block_ops if has_time else None,
        grad_accum=trace.grad_accum, calibration=calibration.as_dict(), launches=trace.launches,
        host_s=timing.host_s if has_time else None, comm_latency_s=timing.comm_latency_s if busbw else None,
        comm_algorithms=timing.comm_algorithms if busbw else None,
        layout=dataclasses.asdict(layout) if layout else None,
        timeline=trace.timeline if has_time and trace.block_ops else None, working_gib=working_gib,
        gpu=gpu if on_gpu else None)


def _working_gib(trace: StepTrace, kept_off_gib: float) -> dict[str, float]:
    """Activations and temporaries at the place of the step (StepTrace.place_gib) where together they hold the
    most, less `kept_off_gib` of activations (what compile and activation offloading keep off the GPU at the
    peak, where every block's activations are held); the peak's where the trace has no places."""
    places = list(trace.place_gib.values()) or [trace.memory_gib]
    held = ({"activations": max(place["activations"] - kept_off_gib, 0.0), "temporaries": place["temporaries"]}
            for place in places)
    return max(held, key=lambda gib: sum(gib.values()))


def step_config(config: TrialConfig) -> TrialConfig:
    """The trial as its traced step depends on it: traced_config, and a DDP world of 2 ranks or more as 2. A DDP
    rank holds a whole replica and all-reduces buckets sized by bytes, and the fake group's collectives return at
    once, so its traced step is the same at every world size from 2 (the world prices it afterwards:
    predict_step_time); a sweep's DDP world sizes share one trace. One rank runs DDP without all-reduces."""
    traced = traced_config(config)
    if not traced.train.parallelism.reducer or traced.resources.workers < 2:
        return traced
    return traced.model_copy(update={"resources": traced.resources.model_copy(update={"workers": 2})})


def any_world(config: TrialConfig) -> TrialConfig:
    """The step a sweep's world sizes of an FSDP2 or TP x FSDP2 trial share (worlds.py): the traced step
    (step_config) with the world its TP group alone (tp_size: 1 under fsdp2). Trials alike but for their world
    size have the same."""
    tp = config.train.tp_size
    return step_config(config.model_copy(update={"resources": config.resources.model_copy(update={"workers": tp})}))


def block_ops_key(config: TrialConfig, gpu: str, calibration: Calibration) -> tuple:
    """What one decoder block's operators (policy.block_ops) depend on: the model, its techniques, the strategy's
    compute dtype, one micro-batch's shape, the GPU and what prices it. Not the world size, the micro-batches a
    step or the checkpointing: block_ops runs one forward of the unwrapped model on one micro-batch, so a sweep's
    world sizes and accumulation counts share it."""
    train = config.train.model_copy(update={"ac_ratio": "0", "compile": False, "grad_accum": 1})
    resources = config.resources.model_copy(update={"workers": 1})
    one = config.model_copy(update={"train": train, "resources": resources})
    return ("block ops", config_id(traced_config(one)), gpu, calibration.source)


def _deep_trace(config: TrialConfig, shape: ModelShape, rank: int, gpu: str | None, calibration: Calibration,
                traces: dict, extrapolate_depth: bool, share_worlds: bool) -> tuple[StepTrace, list[str]]:
    """The trial's StepTrace, extrapolated from shallow models where that holds (depth.py), else traced whole;
    each traced step shared from other world sizes' where that holds (worlds.py); and the row's notes on how
    (or why not)."""
    layers = shape.num_hidden_layers
    checkpointed = set(checkpointed_blocks(Fraction(config.train.ac_ratio), layers))
    kinds = tuple(i in checkpointed for i in range(layers))
    world_notes: list[str] = []

    def traced(key: tuple, layout: tuple[bool, ...] | None = None) -> StepTrace:
        if key not in traces:
            traces[key], traces[key, "world note"] = (
                _world_trace(config, shape, rank, gpu, calibration, traces, layout) if share_worlds
                else (_trace(config, shape, rank, gpu, calibration, layout), None))
        note = traces[key, "world note"]
        world_notes.extend([note] if note and note not in world_notes else [])
        return traces[key]

    whole = ("whole", config_id(step_config(config)), rank, gpu, calibration.source)
    layouts = depth.shallow_layouts(kinds) if extrapolate_depth else None
    if not layouts:
        return traced(whole), world_notes
    # The checkpointed blocks are in `kinds`: shallow models of every sAC ratio of a sweep share their key.
    base = config.model_copy(update={"train": config.train.model_copy(update={"ac_ratio": "0"})})
    shallow = {name: traced(("shallow", config_id(step_config(base)), layout, rank, gpu, calibration.source), layout)
               for name, layout in layouts.items()}
    deep = depth.extrapolate(kinds, shallow)
    if isinstance(deep, StepTrace):
        depths = sorted({len(layout) for layout in layouts.values()})
        return deep, [f"traced at depth {depths[0]}-{depths[-1]}, extrapolated to {layers} blocks", *world_notes]
    world_notes.clear()
    return traced(whole), [deep, *world_notes]


def _world_trace(config: TrialConfig, shape: ModelShape, rank: int, gpu: str | None, calibration: Calibration,
                 traces: dict, kinds: tuple[bool, ...] | None) -> tuple[StepTrace, str | None]:
    """An FSDP2 or TP x FSDP2 step (of a shallow model where `kinds` says) on the line through two ends
    (worlds.share), else traced, and kept as one end of that line where it can be one; and the row's note: how it
    was shared, or why not where two ends were there to share from. The first step traced gives both ends: itself,
    and itself at twice its FSDP2 group size, its part on the shards scaled (shards.py); should that one not come
    out, a second world size traced is the second end."""
    if not config.train.fsdp2_sharded:
        return _trace(config, shape, rank, gpu, calibration, kinds), None
    tp = config.train.tp_size
    world, dp = config.resources.workers, config.resources.workers // tp
    key = (config_id(any_world(config)), kinds, rank, gpu, calibration.source)
    ends = traces.setdefault(("world ends", *key), {})
    split_from = traces.setdefault(("world ends split from", *key), {})  # a second end's group size -> the traced
    if dp in split_from:
        return dataclasses.replace(ends[dp], memory_events=None), (
            f"traced at {split_from[dp] * tp} ranks, its part on the shards scaled to {world} (shards.py)")
    shared = worlds.share(dp, ends)
    if isinstance(shared, StepTrace):
        dp1, dp2 = list(ends)[:2]
        ends_are = (f"traced at {dp1 * tp} ranks and split" if dp2 in split_from
                    else f"traced at {dp1 * tp} and {dp2 * tp} ranks")
        return shared, f"{ends_are}, shared to {world} (the shards' sizes and costs on their line)"
    trace = _trace(config, shape, rank, gpu, calibration, kinds, record_events=True,
                   second_dp=2 * dp if not ends and dp >= 2 else None)
    second, trace.second = trace.second, None
    if len(ends) < 2 and worlds.why_not_recorded(trace) is None:
        ends[dp] = trace
        if second is not None and worlds.why_not_recorded(second) is None:
            ends[second.sharding.dp] = second
            split_from[second.sharding.dp] = dp
        if len(ends) == 2:  # of the memory after every operator, what can hold a peak
            worlds.compact(ends)
    else:  # the memory after every operator is kept for the line's ends alone
        trace.memory_events = None
    return trace, f"world size not shared: {shared}" if shared else None


def _trace(config: TrialConfig, shape: ModelShape, rank: int, gpu: str | None, calibration: Calibration,
           kinds: tuple[bool, ...] | None = None, record_events: bool = False,
           second_dp: int | None = None) -> StepTrace:
    """trace_step as `rank` of the trial's fake world (of a shallow model where `kinds` says)."""
    world = config.resources.workers
    init_fake_world(rank, world)
    try:
        return trace_step(config, shape, RankContext(rank, world, rank, torch.device("cpu")), fake=True, gpu=gpu,
                          calibration=calibration, kinds=kinds, record_events=record_events, second_dp=second_dp)
    finally:
        dist.destroy_process_group()


def _compiled_saving_gib(config: TrialConfig, shape: ModelShape, rank: int, traces: dict) -> float | str | None:
    """What the compiled blocks of a trial keep less than the eager trace counts (compiled_block_saving_gib):
    every block not checkpointed, and every block under an op-level policy; blocks checkpointed whole keep their
    input either way. None when no block is of those kinds; why not, when torch.compile cannot capture a block
    whole (the eager activations stand: an upper bound, never a saving that did not happen)."""
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
            try:
                traces[key] = compiled_block_saving_gib(config, shape, op_policy)
            except Exception as err:  # one block dynamo cannot capture must not stop a sweep
                traces[key] = (f"compile's saved activations not counted, eager's kept "
                               f"({type(err).__name__}: {err})")[:300]
        if isinstance(traces[key], str):
            return traces[key]
        saving_gib += blocks * traces[key]
    return saving_gib


def _offloaded(config: TrialConfig, shape: ModelShape, gpu: str | None, traces: dict) -> tuple[float, float, str]:
    """What activation offloading (train.offload_activations) takes off the GPU at the step's peak, in GiB, the
    seconds its copies add to a step, and the row's note. Each block not checkpointed sends what its forward saves
    (activation_offload.offloads: parameters and small tensors stay) to host memory; at the peak, as backward
    begins, all of it is there but the last block's, which backward brings back first. The copies run on the
    compute stream: out and back, at the GPU's host link, for every micro-batch."""
    layers = shape.num_hidden_layers
    blocks = layers - len(checkpointed_blocks(Fraction(config.train.ac_ratio), layers))
    key = ("offloaded block", config_id(traced_config(config.model_copy(update={"train": config.train.model_copy(
        update={"ac_ratio": "0", "grad_accum": 1})}))))
    if key not in traces:
        traces[key] = offloaded_block_bytes(config, shape, activation_offload.offloads) / GIB
    host_gib = blocks * traces[key]
    link = host_link_gb_per_s(gpu)
    copies_s = 2 * host_gib * GIB / (link * 1e9) * config.train.grad_accum if link else 0.0
    priced = f"{copies_s * 1e3:.0f} ms of copies a step at {link:g} GB/s" if link else "copies unpriced (host link " \
        "unknown)"
    note = f"activations offloaded: {host_gib:.2f} GiB from {blocks} blocks to pinned host memory, {priced}"
    return max(blocks - 1, 0) * traces[key], copies_s, note


def _compiled_traffic(config: TrialConfig, shape: ModelShape, traces: dict) -> tuple[float | None, str | None]:
    """compiled_block_traffic for a compiled trial, or None and why: a block inductor cannot lower is priced
    eager, and the sweep's other trials go on."""
    # One block's traffic is counted as FSDP2 runs it (bf16 weights, the block whole) for every strategy: it
    # does not depend on checkpointing, and a sweep's compiled trials share it.
    block_train = {"ac_ratio": "0", "ac_mode": "block", "ac_saved_ops": None, "strategy": "fsdp2", "tp_size": 1}
    one = config.model_copy(update={"train": config.train.model_copy(update=block_train)})
    key = ("compiled block traffic", config_id(traced_config(one)))
    if key not in traces:
        try:
            traces[key] = compiled_block_traffic(one, shape)
        except Exception as err:  # inductor failing to lower one model must not stop a sweep
            traces[key] = f"compile's fusion not counted, step priced eager ({type(err).__name__}: {err})"[:300]
    found = traces[key]
    return (None, found) if isinstance(found, str) else (found, None)


def is_policy_base(config: TrialConfig) -> bool:
    """Whether an op-level policy (op_policy) starts from this trial's rehearsal: every decoder block
    checkpointed whole, under FSDP2, whose ranks run whole blocks (TP shards each block's operators)."""
    train = config.train
    return train.parallelism is FSDP2 and train.ac_mode == "block" and Fraction(train.ac_ratio) == 1
