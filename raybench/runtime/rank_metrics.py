"""One trial's measurements: what each rank measured, reduced across ranks in one place, into TrialMetrics.

Every rank calls `reduce_ranks` (it runs the collectives); rank 0 then turns the reduction into the typed
`schema.TrialMetrics` record with `trial_metrics`. How each quantity combines across ranks:
- a step lasts as long as its slowest rank (max per step);
- losses and phase times are averaged over ranks (each rank's phases add up to its own step time, so phases
  reconcile with the rank-averaged step time, not with the slowest rank's);
- non-padding tokens are summed over ranks, then divided by tp_size (a TP group's ranks share one batch);
- sampled utilization and clocks are averaged over ranks; peaks are kept per rank and their maximum reported;
- setup times (model build, wrap, time to first step) are the slowest rank's: the trial waits for it;
- throughput divides by the timed window's real elapsed time, from the earliest rank's start of the first
  timed step to the latest rank's end of the last one, on the wall clock (NTP-synchronized across nodes; its
  error is far below a window of seconds). Summing each step's slowest rank would overstate it whenever
  different ranks are slow in different steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raybench.runtime.bench import LoopRecord
from raybench.spec import metrics
from raybench.spec.schema import TrialMetrics
from raybench.spec.sweep_spec import TrainSpec

SAMPLED = ("cpu_util_pct", "gpu_util_pct", "gpu_power_w", "gpu_sm_clock_mhz", "gpu_mem_clock_mhz")


@dataclass(frozen=True)
class Peaks:
    """Peak memory of one rank over one window (the build, or training)."""

    rss_gib: float
    alloc_gib: float | None  # None on CPU
    reserved_gib: float | None


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured with its own clocks and counters."""

    loop: LoopRecord
    sampled: dict[str, float]  # means over the timed window; a missing key was not sampled
    peaks: Peaks  # training: from the end of the build to the end of the loop
    build_peaks: Peaks  # the build: meta model, techniques, wrap, this rank's values
    rss_before_build_gib: float
    host_held_gib: float  # held from earlier trials (warm pool actors); the host figures above are net of it
    model_build_s: float
    wrap_s: float
    time_to_first_step_s: float


@dataclass(frozen=True)
class RankReduction:
    """The measurements of all ranks, combined (identical on every rank)."""

    step_times_s: list[float]  # per step, the slowest rank's
    timed_window_s: float  # earliest start of the first timed step to the latest end of the last one
    mean_rank_step_times_s: list[float]
    losses: list[float]
    nonpad_tokens: list[float]
    phase_times_s: dict[str, list[float]]
    sampled: dict[str, float | None]
    peak_rss_gib_by_rank: list[float]
    peak_alloc_gib_by_rank: list[float] | None
    peak_reserved_gib_by_rank: list[float] | None
    build_peak_rss_gib_by_rank: list[float]
    build_peak_alloc_gib_by_rank: list[float] | None
    build_peak_reserved_gib_by_rank: list[float] | None
    rss_before_build_gib_by_rank: list[float]
    host_held_gib_by_rank: list[float]
    model_build_s: float
    wrap_s: float
    time_to_first_step_s: float


def _reduce(values: list[float], op, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    world = dist.get_world_size()
    return [v / world for v in _reduce(values, dist.ReduceOp.SUM, device)]


def _gather(values: list, world: int) -> list[list]:
    """values[i] of every rank, as one list per i (in rank order)."""
    gathered = [None] * world
    dist.all_gather_object(gathered, values)
    return [list(per_rank) for per_rank in zip(*gathered)]


def _peak_values(peaks: Peaks) -> list:
    return [peaks.rss_gib, peaks.alloc_gib, peaks.reserved_gib]


def _timed_window_s(loop: LoopRecord, warmup_steps: int, device: torch.device) -> float:
    wall_offset = time.time() - time.perf_counter()  # this rank's monotonic clock on the shared wall clock
    start = loop.step_starts[warmup_steps] + wall_offset
    end = loop.step_starts[-1] + loop.step_times_s[-1] + wall_offset
    neg_start, end = _reduce([-start, end], dist.ReduceOp.MAX, device)
    return end + neg_start


def reduce_ranks(m: RankMeasurement, tp_size: int, warmup_steps: int, device: torch.device) -> RankReduction:
    """Combine every rank's measurement; a collective, so every rank must call it."""
    world = dist.get_world_size()
    sampled = mean_over_ranks([m.sampled.get(k, math.nan) for k in SAMPLED], device)
    rss, alloc, reserved, build_rss, build_alloc, build_reserved, before, held = _gather(
        _peak_values(m.peaks) + _peak_values(m.build_peaks) + [m.rss_before_build_gib, m.host_held_gib], world)
    on_gpu = m.peaks.alloc_gib is not None
    build_s, wrap_s, first_step_s = _reduce([m.model_build_s, m.wrap_s, m.time_to_first_step_s], dist.ReduceOp.MAX,
                                            device)
    return RankReduction(
        step_times_s=_reduce(m.loop.step_times_s, dist.ReduceOp.MAX, device),
        timed_window_s=_timed_window_s(m.loop, warmup_steps, device),
        mean_rank_step_times_s=mean_over_ranks(m.loop.step_times_s, device),
        losses=mean_over_ranks(m.loop.losses, device),
        nonpad_tokens=[n / tp_size for n in _reduce([float(n) for n in m.loop.nonpad_tokens], dist.ReduceOp.SUM,
                                                    device)],
        phase_times_s={p: mean_over_ranks(t, device) for p, t in m.loop.phase_times_s.items()},
        sampled={k: None if math.isnan(v) else v for k, v in zip(SAMPLED, sampled)},
        peak_rss_gib_by_rank=rss,
        peak_alloc_gib_by_rank=alloc if on_gpu else None,
        peak_reserved_gib_by_rank=reserved if on_gpu else None,
        build_peak_rss_gib_by_rank=build_rss,
        build_peak_alloc_gib_by_rank=build_alloc if on_gpu else None,
        build_peak_reserved_gib_by_rank=build_reserved if on_gpu else None,
        rss_before_build_gib_by_rank=before,
        host_held_gib_by_rank=held,
        model_build_s=build_s, wrap_s=wrap_s, time_to_first_step_s=first_step_s,
    )


@dataclass(frozen=True)
class TrialFacts:
    """What rank 0 knows of the trial besides the reduced measurements."""

    train: TrainSpec
    world_size: int
    dp_size: int  # data-parallel ranks: each draws its own batch
    params_total: int
    params_trainable: int
    flops_per_token: float
    peak_tflops: float | None  # the device's dense peak for the trial's precision; None: MFU unknown
    comm_exposed_p50_s: float | None
    weights_cache: str | None
    weights_copy_s: float | None
    worker_wall_s: float
    process_trial_index: int  # trials the worker processes ran before this one (0: fresh processes)
    compiled: dict  # dynamo's graph and graph-break columns over the timed loop (techniques.compile); nulls eager


def trial_metrics(r: RankReduction, facts: TrialFacts) -> TrialMetrics:
    train = facts.train
    warm = train.warmup_steps
    timed = r.step_times_s[warm:]
    tokens_per_step = train.micro_batch * train.seq_len * train.grad_accum * facts.dp_size
    tok_per_s = tokens_per_step * len(timed) / r.timed_window_s
    per_device = tok_per_s / facts.world_size
    nonpad_per_s = sum(r.nonpad_tokens[warm:]) / r.timed_window_s
    step_p50 = metrics.percentile(timed, 50)
    return TrialMetrics(
        **metrics.step_time_stats(timed),
        **metrics.phase_stats({p: t[warm:] for p, t in r.phase_times_s.items()}, r.mean_rank_step_times_s[warm:]),
        comm_exposed_p50_s=facts.comm_exposed_p50_s,
        comm_exposed_frac=facts.comm_exposed_p50_s / step_p50 if facts.comm_exposed_p50_s is not None else None,
        steps_timed=len(timed),
        tokens_per_step=tokens_per_step,
        nonpad_tokens_per_step=sum(r.nonpad_tokens[warm:]) / len(timed),
        tok_per_s=tok_per_s,
        tok_per_s_per_device=per_device,
        nonpad_tok_per_s=nonpad_per_s,
        nonpad_tok_per_s_per_device=nonpad_per_s / facts.world_size,
        tflops_per_device=per_device * facts.flops_per_token / 1e12,
        mfu=metrics.mfu(per_device, facts.flops_per_token, facts.peak_tflops),
        flops_per_token=facts.flops_per_token,
        loss_first=r.losses[0],
        loss_final=r.losses[-1],
        peak_rss_gib=max(r.peak_rss_gib_by_rank),
        peak_alloc_gib=_max(r.peak_alloc_gib_by_rank),
        peak_reserved_gib=_max(r.peak_reserved_gib_by_rank),
        peak_rss_gib_by_rank=r.peak_rss_gib_by_rank,
        peak_alloc_gib_by_rank=r.peak_alloc_gib_by_rank,
        peak_reserved_gib_by_rank=r.peak_reserved_gib_by_rank,
        build_peak_rss_gib=max(r.build_peak_rss_gib_by_rank),
        build_peak_alloc_gib=_max(r.build_peak_alloc_gib_by_rank),
        build_peak_reserved_gib=_max(r.build_peak_reserved_gib_by_rank),
        build_peak_rss_gib_by_rank=r.build_peak_rss_gib_by_rank,
        rss_before_build_gib_by_rank=r.rss_before_build_gib_by_rank,
        host_held_gib=max(r.host_held_gib_by_rank),
        params_total=facts.params_total,
        params_trainable=facts.params_trainable,
        model_build_s=r.model_build_s,
        weights_cache=facts.weights_cache,
        weights_copy_s=facts.weights_copy_s,
        wrap_s=r.wrap_s,
        warmup_s=sum(r.step_times_s[:warm]),
        time_to_first_step_s=r.time_to_first_step_s,
        timed_window_s=r.timed_window_s,
        first_step_s=r.step_times_s[0],
        # Compilation happens inside the first step; its excess over a typical step is the compile cost.
        compile_s=r.step_times_s[0] - step_p50 if train.compile else None,
        **facts.compiled,
        worker_wall_s=facts.worker_wall_s,
        process_trial_index=facts.process_trial_index,
        **r.sampled,
    )


def _max(values: list[float] | None) -> float | None:
    return max(values) if values else None
