"""An op-level checkpointing policy: which operators of every decoder block to save, chosen by torch's SAC ILP
within a memory limit, from one block's operators recorded by torch's SAC estimator."""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from raybench.rehearse.compiled import compiled_block_saving_gib
from raybench.rehearse.fake_world import fake_mode, one_sequence_per_row
from raybench.rehearse.fitted import SHIPPED_CALIBRATION, Calibration
from raybench.rehearse.roofline import Roofline, flop_formulas, gpu_roofline
from raybench.rehearse.step_time import Layout, predict_step_time
from raybench.rehearse.trace import StepTrace
from raybench.rehearse.traced_model import fake_batches, liger_rope, unwrapped_model
from raybench.runtime.techniques import activation_checkpointing
from raybench.spec.presets import ModelShape
from raybench.spec.schema import GIB
from raybench.spec.sweep_spec import TrialConfig


def _sac_estimator(roofline: Roofline):
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


def block_ops(config: TrialConfig, shape: ModelShape, gpu: str,
              calibration: Calibration = SHIPPED_CALIBRATION, layers: int | None = 1) -> dict:
    """One decoder block's operators in forward, as torch's SACStats (plain data): each operator's name, output
    bytes, roofline milliseconds on `gpu`, and the estimator's constraints (views, random and in-place ops).

    One forward of the trial's model (its techniques applied, no checkpointing) on fake tensors, not wrapped:
    FSDP2 would run its all-gathers and parameter casts inside each block and they would count as the block's
    operators. FSDP2's bf16 mixed-precision policy computes in bf16 (parameters cast before each forward),
    which casting the whole model reproduces. Every block runs the same operators; the first one's are taken,
    from a model of that one block (`layers`; None: the whole model; a 72B's 80 blocks gave the same figures in
    2.0 s against 1.3 s).
    """
    model, train = unwrapped_model(config, layers)
    estimator = _sac_estimator(gpu_roofline(gpu, calibration))
    with fake_mode():
        model.to_empty(device="cpu")
        batch = next(fake_batches(train, shape.vocab_size, torch.device("cpu")))
        with estimator, liger_rope(config, shape), one_sequence_per_row():
            model(input_ids=batch["input_ids"], use_cache=False)
    first = next(name for name in estimator.sac_mod_stats if _FIRST_BLOCK.search(name))
    return dataclasses.asdict(estimator.sac_mod_stats[first])


# The first decoder block's name as torch's module tracker reports it (LlamaForCausalLM.model.layers.0).
_FIRST_BLOCK = re.compile(r"\.layers\.0$")



@dataclass
class OpPolicy:
    """The op-level checkpointing policy for every decoder block, and what the step would be with it."""

    saved: dict[str, int]  # operator -> how many of one block's run are saved in forward (not recomputed)
    recomputed: dict[str, int]  # operator -> how many backward recomputes (views, free, left out)
    ac_saved_ops: list[str]  # the policy as train.ac_saved_ops, to run it (ac_mode op)
    kept_fraction: float  # the ILP's budget: share of the block's recomputable output bytes it may keep
    saved_gib_per_block: float  # what the policy keeps per block run eager
    peak_gib: float  # tensor peak (compiled blocks: what the partitioner keeps given the policy, `compiled_policy`)
    reserved_gib: float  # x the calibration's reserve, as rehearsals report for GPUs
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


def op_policy(full_ac: dict, layers: int, reserved_limit_gib: float) -> OpPolicy | None:
    """The op-level policy torch's ILP picks for every decoder block so that the GPU's reserved peak stays
    within `reserved_limit_gib`, from the rehearsal of the same trial with every block checkpointed whole
    (`full_ac`: a Rehearsal as a dict, with block_ops; a compiled trial's has its compiled_traffic). None when
    even full AC does not fit.

    With every block checkpointed, each keeps only its input; a policy that saves S bytes of a block's
    operator outputs adds layers x S to that peak, and takes the saved operators' time off the recomputation
    the full-AC step pays. Both come from the trace (the same roofline, `block_ops`), nothing is fitted here.
    A step of several micro-batches recomputes each block once per micro-batch, and holds one micro-batch's
    activations at a time. The reserve and efficiency are those the rehearsal was priced with (its calibration).
    """
    calibration = Calibration.of(full_ac)
    stats = _recomputable(full_ac["block_ops"])
    room_gib = reserved_limit_gib / calibration.reserve - full_ac["peak_gib"]
    if room_gib < 0:
        return None
    kept_fraction = min(1.0, room_gib * GIB / 1024 / layers / sum(_kib(stats.memory)))
    decisions = _solve(stats, kept_fraction)
    views = set(stats.view_like_ops)
    saved = [i for i, keep in enumerate(decisions) if keep]
    flop_ops = {packet.__name__ for packet in flop_formulas()}
    saved_s = sum(stats.runtimes[i] for i in saved) / 1e3
    saved_memory_bound_s = sum(stats.runtimes[i] for i in saved if stats.func_names[i] not in flop_ops) / 1e3
    saved_bytes = sum(stats.memory[i] for i in saved)
    recomputed_blocks = layers * full_ac.get("grad_accum", 1)  # rehearsals stored before it was kept ran one
    trace = StepTrace(memory_gib={}, resident_gib={}, comm_bytes=full_ac["comm_bytes"],
                      comm_calls=full_ac.get("comm_calls") or {}, launches=full_ac.get("launches") or 0,
                      overlapped_comm=tuple(full_ac["overlapped_comm"]), flops=0.0,
                      roofline_s=full_ac["roofline_s"] - recomputed_blocks * saved_s, compute_s=0.0, memory_s=0.0,
                      block_memory_bound_s=full_ac["block_memory_bound_s"] - recomputed_blocks * saved_memory_bound_s,
                      timeline=_without_recomputation(full_ac.get("timeline") or [], recomputed_blocks * saved_s))
    layout = Layout(**full_ac["layout"]) if full_ac.get("layout") else None
    timing = predict_step_time(trace, full_ac["world_size"], full_ac["busbw_gbps"], full_ac["busbw_source"],
                               calibration.efficiency, full_ac.get("compiled_traffic"),
                               launch_s=calibration.launch_s, layout=layout)
    peak = full_ac["peak_gib"] + layers * saved_bytes / GIB
    return OpPolicy(
        saved=_counts(stats.func_names, saved), kept_fraction=kept_fraction,
        ac_saved_ops=_as_saved_ops(full_ac["block_ops"]["func_names"], [i for i in saved if i not in views]),
        recomputed=_counts(stats.func_names, [i for i, keep in enumerate(decisions) if not keep and i not in views]),
        saved_gib_per_block=saved_bytes / GIB, peak_gib=peak, reserved_gib=peak * calibration.reserve,
        compute_s=timing.compute_s, step_time_s=timing.step_time_s)


def _without_recomputation(timeline: list, saved_s: float) -> list:
    """The full-AC step's timeline (StepTrace.timeline) with `saved_s` roofline seconds of recomputation taken
    off backward, where recomputation runs: every backward compute event shortened in proportion."""
    backward_s = sum(weight * event[1] for weight, events in timeline for event in events
                     if event[0] == "compute" and event[3])
    if not backward_s:
        return timeline
    keep = max(0.0, 1 - saved_s / backward_s)
    return [(weight, [[*event[:1], event[1] * keep, *event[2:]] if event[0] == "compute" and event[3] else event
                      for event in events]) for weight, events in timeline]


def compiled_policy(policy: OpPolicy, config: TrialConfig, shape: ModelShape,
                    calibration: Calibration = SHIPPED_CALIBRATION) -> OpPolicy:
    """`policy` for blocks that run compiled: torch.compile's partitioner takes the policy's tags as constraints
    and keeps what it then chooses, which the ILP (eager) does not see (compiled_block_saving_gib)."""
    train = config.train.model_copy(update={"ac_ratio": "1", "ac_mode": "op", "ac_saved_ops": policy.ac_saved_ops})
    saving = compiled_block_saving_gib(config.model_copy(update={"train": train}), shape, op_policy=True)
    peak = policy.peak_gib - shape.num_hidden_layers * saving
    return dataclasses.replace(policy, peak_gib=peak, reserved_gib=peak * calibration.reserve)


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

