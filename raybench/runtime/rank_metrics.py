"""One trial's measurements: what each rank measured, reduced across ranks in one place, into TrialMetrics.

Every rank calls `reduce_ranks`, which gathers each rank's record and `combine`s them into a `RankReduction`; rank 0
then turns the reduction into what it returns, the typed `schema.RankResult`, with `rank_result` (its metrics:
`trial_metrics`). Records a user's stack wrote with the probe from processes raybench did not start (a `command`
trial) go through the same `combine` and `rank_result`. How each quantity combines across ranks:
- a step lasts as long as its slowest rank (max per step);
- losses and phase times are averaged over ranks (each rank's phases add up to its own step time, so phases
  reconcile with the rank-averaged step time, not with the slowest rank's);
- tokens (padded and not) are summed over ranks, then divided by tp_size (a TP group's ranks share one batch);
- sampled utilization and clocks are averaged over ranks; peaks are kept per rank and their maximum reported;
- setup times (model build, wrap, time to first step) are the slowest rank's: the trial waits for it;
- throughput divides by the timed window's real elapsed time, from the earliest rank's start of the first
  timed step to the latest rank's end of the last one, on the wall clock (NTP-synchronized across nodes; its
  error is far below a window of seconds). Summing each step's slowest rank would overstate it whenever
  different ranks are slow in different steps.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from raybench.runtime import collectives, fingerprint, stragglers
from raybench.runtime.probe import PHASES, LoopRecord
from raybench.runtime.techniques import compile as compile_technique
from raybench.spec import metrics
from raybench.spec.schema import DataTaken, RankResult, TrialMetrics
from raybench.spec.sweep_spec import TrainSpec

SAMPLED = ("cpu_util_pct", "gpu_util_pct", "gpu_power_w", "gpu_sm_clock_mhz", "gpu_mem_clock_mhz")
# The step profile's columns (runtime.step_profile fills them on the ranks; null when train.profile_steps is 0).
PROFILE_COLUMNS = tuple(f.name for f in dataclasses.fields(TrialMetrics) if f.name.startswith("profile_"))


@dataclass(frozen=True)
class Peaks:
    """Peak memory of one rank over one window (the build, or training)."""

    rss_gib: float
    alloc_gib: float | None  # None on CPU
    reserved_gib: float | None


@dataclass(frozen=True)
class RankMeasurement:
    """What one rank measured with its own clocks and counters. A user's stack measures the loop and the
    training peaks only (its build is its own business): the other fields are None there."""

    loop: LoopRecord
    sampled: dict[str, float]  # means over the timed window; a missing key was not sampled
    peaks: Peaks  # training: from the end of the build to the end of the loop
    build_peaks: Peaks | None  # the build: meta model, techniques, wrap, this rank's values
    rss_before_build_gib: float | None
    host_held_gib: float  # held from earlier trials (warm pool actors); the host figures above are net of it
    model_build_s: float | None
    wrap_s: float | None
    time_to_first_step_s: float

    def as_record(self) -> dict:
        """Plain data, step starts on the wall clock: what `combine` reads, from any process (the probe of a
        `command` trial writes the same keys, `probe.StepProbe.to_dict`)."""
        offset = time.time() - time.perf_counter()  # this rank's monotonic clock on the shared wall clock
        return {
            "step_times_s": self.loop.step_times_s, "step_starts_wall": [s + offset for s in self.loop.step_starts],
            "tokens": self.loop.tokens, "nonpad_tokens": self.loop.nonpad_tokens, "losses": self.loop.losses,
            "label_tokens": self.loop.label_tokens, "unlabelled_micro_batches": self.loop.unlabelled_micro_batches,
            "phase_times_s": self.loop.phase_times_s, "sampled": self.sampled,
            "peaks": dataclasses.asdict(self.peaks),
            "build_peaks": dataclasses.asdict(self.build_peaks) if self.build_peaks else None,
            "rss_before_build_gib": self.rss_before_build_gib, "host_held_gib": self.host_held_gib,
            "model_build_s": self.model_build_s, "wrap_s": self.wrap_s,
            "time_to_first_step_s": self.time_to_first_step_s,
            # The node as its users name it: SLURM's node name under SLURM (two slurmd may share a host), else the host.
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
        }


@dataclass(frozen=True)
class RankReduction:
    """The measurements of all ranks, combined."""

    step_times_s: list[float]  # per step, the slowest rank's
    timed_window_s: float  # earliest start of the first timed step to the latest end of the last one
    mean_rank_step_times_s: list[float]
    losses: list[float | None]  # None where the stack reported none (nan: the loss was nan)
    tokens: list[float]
    nonpad_tokens: list[float]
    phase_times_s: dict[str, list[float]]  # empty for a user's stack
    rank_step_times_s: list[list[float]]  # per rank, its own step times
    rank_local_times_s: list[list[float]] | None  # per rank, its local work per step (stragglers); None: no phases
    nodes_by_rank: list[str | None]  # None: a record without its host (a user's stack's probe)
    sampled: dict[str, float | None]
    peak_rss_gib_by_rank: list[float]
    peak_alloc_gib_by_rank: list[float] | None
    peak_reserved_gib_by_rank: list[float] | None
    build_peak_rss_gib_by_rank: list[float] | None
    build_peak_alloc_gib_by_rank: list[float] | None
    build_peak_reserved_gib_by_rank: list[float] | None
    rss_before_build_gib_by_rank: list[float] | None
    host_held_gib_by_rank: list[float]
    model_build_s: float | None
    wrap_s: float | None
    time_to_first_step_s: float


def _reduce(values: list[float], op, device: torch.device) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    world = dist.get_world_size()
    return [v / world for v in _reduce(values, dist.ReduceOp.SUM, device)]


def reduce_ranks(m: RankMeasurement, tp_size: int, warmup_steps: int) -> RankReduction:
    """Combine every rank's measurement (identical on every rank); a collective, so every rank must call it."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, m.as_record())
    return combine(gathered, tp_size, warmup_steps)


def _per_step(ranks: list[dict], key: str) -> list[list[float]]:
    """ranks[r][key][i] as one list per step i (every rank's value of it), over the steps all ranks have."""
    return [list(step) for step in zip(*(r[key] for r in ranks))]


def _mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def _by_rank(ranks: list[dict], section: str, key: str) -> list[float] | None:
    values = [(r.get(section) or {}).get(key) for r in ranks]
    return None if any(v is None for v in values) else values


def _local_times(ranks: list[dict], steps: int) -> list[list[float]] | None:
    local = [stragglers.local_times_s(r.get("phase_times_s") or {}) for r in ranks]
    return None if None in local else [times[:steps] for times in local]


def _slowest(ranks: list[dict], key: str) -> float | None:
    values = [r.get(key) for r in ranks]
    return None if any(v is None for v in values) else max(values)


def combine(ranks: list[dict], tp_size: int, warmup_steps: int) -> RankReduction:
    """Every rank's record (`RankMeasurement.as_record`, or a probe's record file) combined into one."""
    steps = _per_step(ranks, "step_times_s")
    starts = _per_step(ranks, "step_starts_wall")
    if len(steps) <= warmup_steps:
        raise RuntimeError(f"the ranks recorded {len(steps)} step(s), no more than the {warmup_steps} warm-up "
                           "step(s): no step was timed")
    check_labels(ranks)
    phases = {}
    for phase in ranks[0].get("phase_times_s") or {}:
        phases[phase] = [_mean(step) for step in zip(*(r["phase_times_s"][phase] for r in ranks))]
    sampled = {}
    for key in SAMPLED:
        values = [(r.get("sampled") or {}).get(key, math.nan) for r in ranks]
        sampled[key] = None if any(math.isnan(v) for v in values) else _mean(values)
    on_gpu = ranks[0]["peaks"].get("alloc_gib") is not None
    last = len(steps) - 1
    window_end = max(s[last] + t[last] for s, t in zip(zip(*starts), zip(*steps)))
    return RankReduction(
        step_times_s=[max(step) for step in steps],
        timed_window_s=window_end - min(starts[warmup_steps]),
        mean_rank_step_times_s=[_mean(step) for step in steps],
        losses=[None if None in step else _mean(step) for step in _per_step(ranks, "losses")],
        tokens=[math.fsum(step) / tp_size for step in _per_step(ranks, "tokens")],
        nonpad_tokens=[math.fsum(step) / tp_size for step in _per_step(ranks, "nonpad_tokens")],
        phase_times_s=phases,
        rank_step_times_s=[r["step_times_s"][:len(steps)] for r in ranks],
        rank_local_times_s=_local_times(ranks, len(steps)),
        nodes_by_rank=[r.get("node") for r in ranks],
        sampled=sampled,
        peak_rss_gib_by_rank=_by_rank(ranks, "peaks", "rss_gib"),
        peak_alloc_gib_by_rank=_by_rank(ranks, "peaks", "alloc_gib") if on_gpu else None,
        peak_reserved_gib_by_rank=_by_rank(ranks, "peaks", "reserved_gib") if on_gpu else None,
        build_peak_rss_gib_by_rank=_by_rank(ranks, "build_peaks", "rss_gib"),
        build_peak_alloc_gib_by_rank=_by_rank(ranks, "build_peaks", "alloc_gib") if on_gpu else None,
        build_peak_reserved_gib_by_rank=_by_rank(ranks, "build_peaks", "reserved_gib") if on_gpu else None,
        rss_before_build_gib_by_rank=(None if any(r.get("rss_before_build_gib") is None for r in ranks)
                                      else [r["rss_before_build_gib"] for r in ranks]),
        host_held_gib_by_rank=[r.get("host_held_gib", 0.0) for r in ranks],
        model_build_s=_slowest(ranks, "model_build_s"), wrap_s=_slowest(ranks, "wrap_s"),
        time_to_first_step_s=_slowest(ranks, "time_to_first_step_s"),
    )


# Why a batch holds no label tokens, and what gives it some.
_NO_LABELS_CAUSE = ("its samples' label tokens were all cut or masked: data.overflow truncate keeps each sample's "
                    "first train.seq_len tokens, and with data.loss_on assistant an assistant turn past them leaves "
                    "none; use a longer train.seq_len, data.overflow split or drop, or data.loss_on all")


def check_labels(ranks: list[dict]) -> None:
    """Refuse a trial whose loss cannot be a number: a step whose global batch holds no label tokens, or (raybench's
    loop takes each micro-batch's mean loss) a micro-batch with none, whose loss is nan. Every rank runs it on the
    same records, so every rank raises alike. Records without label counts (a user's loop) pass."""
    if not all(r.get("label_tokens") for r in ranks):
        return
    for step, counts in enumerate(_per_step(ranks, "label_tokens")):
        if sum(counts) == 0:
            raise ValueError(f"step {step}: the global batch holds no label tokens, so its loss is nan; "
                             f"{_NO_LABELS_CAUSE}")
    for step, unlabelled in enumerate(_per_step(ranks, "unlabelled_micro_batches")):
        if any(unlabelled):
            rank = next(r for r, n in enumerate(unlabelled) if n)
            raise ValueError(f"step {step}: {unlabelled[rank]} micro-batch(es) of rank {rank} hold no label tokens, "
                             f"so their loss (a mean over none) is nan; {_NO_LABELS_CAUSE}")


@dataclass(frozen=True)
class TrialFacts:
    """What rank 0 knows of the trial besides the reduced measurements."""

    train: TrainSpec
    world_size: int
    dp_size: int  # data-parallel ranks: each draws its own batch
    params_total: int
    params_trainable: int | None  # None: not known (a command stack's script did not report it)
    flops_per_token: float | None  # None: not known for the model the user's stack trained
    peak_tflops: float | None  # the device's dense peak for the trial's precision; None: MFU unknown
    comm_exposed_p50_s: float | None
    weights_cache: str | None
    weights_copy_s: float | None
    worker_wall_s: float
    process_trial_index: int  # trials the worker processes ran before this one (0: fresh processes)
    compiled: dict = field(default_factory=dict)  # train.compile's graph columns (techniques.compile); empty: nulls
    fp8: dict = field(default_factory=dict)  # train.fp8's columns (techniques.fp8.columns); empty: nulls
    profile: dict = field(default_factory=dict)  # train.profile_steps' columns (step_profile); empty: nulls
    comm_bus_gb_per_step: float | None = None  # the timed steps' collectives (collectives.bus_gb_per_step)
    allreduce_busbw_gbps: float | None = None  # the trial's ranks' all-reduce probe
    link_gbps: float | None = None  # the nominal rate of the link the ranks span (NVLink, one NIC; None: unknown)


def rank_result(r: RankReduction, facts: TrialFacts, provenance: dict, env: dict[str, str] | None = None,
                stack_version: str | None = None, data_taken: DataTaken | None = "rows") -> RankResult:
    """What rank 0 returns for every kind of trial (raybench's loop, a user's stack, a command's records): the
    metrics of the reduction and the facts, with where and with what they were measured.

    provenance: the row's hardware and software columns (`runtime.provenance.columns`); env: the environment the
    ranks ran in, of which the row keeps the allow-listed variables (None: this process's); stack_version: a
    user's stack's (None: raybench's loop); data_taken: what the trial took of raybench's tokenized data
    (raybench's loop always takes its rows)."""
    return RankResult(metrics=trial_metrics(r, facts), provenance=provenance, env=fingerprint.captured_env(env),
                      system=fingerprint.system_label(), stack_version=stack_version, data_taken=data_taken)


def trial_metrics(r: RankReduction, facts: TrialFacts) -> TrialMetrics:
    train = facts.train
    warm = train.warmup_steps
    timed = r.step_times_s[warm:]
    # Measured: every rank counts the tokens of its batches (a TP group's ranks share one batch).
    tokens_per_step = math.fsum(r.tokens[warm:]) / len(timed)
    tok_per_s = tokens_per_step * len(timed) / r.timed_window_s
    per_device = tok_per_s / facts.world_size
    nonpad_per_s = sum(r.nonpad_tokens[warm:]) / r.timed_window_s
    step_p50 = metrics.percentile(timed, 50)
    flops = facts.flops_per_token
    return TrialMetrics(
        **metrics.step_time_stats(timed),
        **_phase_columns({p: t[warm:] for p, t in r.phase_times_s.items()}, r.mean_rank_step_times_s[warm:]),
        comm_exposed_p50_s=facts.comm_exposed_p50_s,
        comm_exposed_frac=facts.comm_exposed_p50_s / step_p50 if facts.comm_exposed_p50_s is not None else None,
        **collectives.columns(facts.comm_bus_gb_per_step, step_p50, facts.profile.get("profile_comm_s"),
                              facts.allreduce_busbw_gbps, facts.link_gbps),
        steps_timed=len(timed),
        tokens_per_step=round(tokens_per_step),
        nonpad_tokens_per_step=sum(r.nonpad_tokens[warm:]) / len(timed),
        tok_per_s=tok_per_s,
        tok_per_s_per_device=per_device,
        nonpad_tok_per_s=nonpad_per_s,
        nonpad_tok_per_s_per_device=nonpad_per_s / facts.world_size,
        tflops_per_device=per_device * flops / 1e12 if flops is not None else None,
        mfu=metrics.mfu(per_device, flops, facts.peak_tflops) if flops is not None else None,
        flops_per_token=flops,
        # A nan loss stays nan: the trial's row is then an error (drivers.trial), never ok with a gap.
        loss_first=r.losses[0],
        loss_final=r.losses[-1],
        loss_by_step=list(r.losses) if any(x is not None for x in r.losses) else None,
        peak_rss_gib=max(r.peak_rss_gib_by_rank),
        peak_alloc_gib=_max(r.peak_alloc_gib_by_rank),
        peak_reserved_gib=_max(r.peak_reserved_gib_by_rank),
        peak_rss_gib_by_rank=r.peak_rss_gib_by_rank,
        peak_alloc_gib_by_rank=r.peak_alloc_gib_by_rank,
        peak_reserved_gib_by_rank=r.peak_reserved_gib_by_rank,
        build_peak_rss_gib=_max(r.build_peak_rss_gib_by_rank),
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
        **{column: facts.compiled.get(column) for column in compile_technique.COLUMNS},
        fp8_linears=facts.fp8.get("fp8_linears"),
        fp8_linear_kinds_json=facts.fp8.get("fp8_linear_kinds_json"),
        fp8_flops_frac=facts.fp8.get("fp8_flops_frac"),
        **{column: facts.profile.get(column) for column in PROFILE_COLUMNS},
        worker_wall_s=facts.worker_wall_s,
        process_trial_index=facts.process_trial_index,
        **r.sampled,
        step_time_p50_s_by_rank=[metrics.percentile(t[warm:], 50) for t in r.rank_step_times_s],
        **stragglers.columns(None if r.rank_local_times_s is None else [
            metrics.percentile(t[warm:], 50) for t in r.rank_local_times_s], r.nodes_by_rank, step_p50),
    )


def _phase_columns(phase_times_s: dict[str, list[float]], step_times_s: list[float]) -> dict:
    """The phase columns: raybench's own loop times its phases; a user's stack has none (null columns)."""
    if phase_times_s:
        return metrics.phase_stats(phase_times_s, step_times_s)
    none = {f"phase_{p}_{stat}_s": None for p in PHASES for stat in ("p50", "p90", "mean", "std")}
    return {**none, "phase_sum_over_step": None}


def _max(values: list[float] | None) -> float | None:
    return max(values) if values else None
