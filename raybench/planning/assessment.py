"""A trial's analytic estimate judged against its device: calibrated by measured peaks, replaced by a traced
rehearsal where one is stored, compared with the device memory less a margin, and pruned when it cannot fit.

The `Assessment` is what the plan attaches to every valid trial: payloads carry it as plain data
(`spec.payload.AssessmentData`: `to_data`, `from_data`) through Ray Tune's trial config and torchrun's payload
file, the estimate and plan tables show it, result rows store its columns (`row_fields`, from the plain data).
estimate.py stays pure arithmetic on the model; this module is where stored evidence and the sweep's memory
limit come in.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from raybench.planning import uncertainty
from raybench.planning.estimate import Estimate
from raybench.spec.hardware import gpu_memory_gib
from raybench.spec.payload import AssessmentData
from raybench.spec.sweep_settings import EstimateSpec

DEFAULT_MARGIN_FRACTION = 0.10
ESTIMATE_FIELDS = tuple(f.name for f in dataclasses.fields(Estimate))


@dataclass(frozen=True)
class Assessment:
    """The plan's memory and step-time judgement of one trial, per rank."""

    analytic: Estimate  # the analytic estimate, uncalibrated
    calibration: float | None  # median measured / estimated peak of the trial's model x strategy x device
    calibration_rows: int  # the measured rows that median comes from
    peak_calibrated_gib: float  # the analytic peak with its measured part scaled by `calibration`
    memory_gib: float | None  # what one rank may use; None when the sweep names no GPU or memory
    margin_gib: float | None  # kept free of the peak
    fits: bool | None  # the deciding peak plus the margin within memory_gib; None without a memory limit
    peak_basis: str  # "rehearsed" (a traced rehearsal decides the fit) or "analytic"
    rehearsed_peak_gib: float | None  # the rehearsal's reserved peak plus the memory no tensor holds
    rehearsed_step_time_s: float | None
    rehearsed_compute_s: float | None
    world_size: int  # ranks: with the model's size, how far the trial is from the rows its bands were derived on

    @property
    def limit_gib(self) -> float | None:
        """The most one rank's peak may reach: memory less the margin."""
        return None if self.memory_gib is None else self.memory_gib - self.margin_gib

    @property
    def deciding_peak_gib(self) -> float:
        """The peak the fit is judged on: the rehearsed one, else the calibrated estimate."""
        return self.rehearsed_peak_gib if self.peak_basis == "rehearsed" else self.peak_calibrated_gib

    @property
    def step_time_s(self) -> float | None:
        """The predicted step time: the rehearsal's, else the analytic guess."""
        return self.rehearsed_step_time_s if self.peak_basis == "rehearsed" else self.analytic.step_time_s

    @property
    def peak_interval_gib(self) -> tuple[float, float] | None:
        """Where the measured peak may lie, by the checked bands of this basis and scale (planning/uncertainty.py)."""
        # The band is of what a row measures (reserved on a GPU, RSS on CPU); the CUDA context is outside it.
        unmeasured = self.analytic.peak_gib - self.analytic.measured_part_gib
        return uncertainty.interval(self.deciding_peak_gib, self.band.reserved_peak, fixed=unmeasured)

    @property
    def step_time_interval_s(self) -> tuple[float, float] | None:
        return uncertainty.interval(self.step_time_s, self.band.step_time)

    @property
    def band(self) -> uncertainty.Band:
        """The relative error bands of this trial's predictions: its basis, widened by its model and world size."""
        return uncertainty.band(self.peak_basis, self.analytic.params_total, self.world_size)

    def as_dict(self) -> dict:
        """Plain JSON-safe data: the analytic estimate's keys, then the assessment's own, then its intervals
        (derived: `from_dict` recomputes them)."""
        judged = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "analytic"}
        intervals = {"peak_interval_gib": self.peak_interval_gib, "step_time_interval_s": self.step_time_interval_s}
        return {**self.analytic.as_dict(), **judged, **{k: list(v) if v else None for k, v in intervals.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> Assessment:
        analytic = Estimate(**{name: data[name] for name in ESTIMATE_FIELDS})
        judged = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name != "analytic"}
        return cls(analytic=analytic, **judged)

    def to_data(self) -> AssessmentData:
        """The plain data a payload carries."""
        return AssessmentData(self.as_dict())

    @classmethod
    def from_data(cls, data: AssessmentData) -> Assessment:
        return cls.from_dict(data.values)


def device_memory_gib(spec: EstimateSpec, device: str) -> float | None:
    """The memory one rank may use: estimate.device_memory_gib, else (GPU trials) the GPU table's entry."""
    if spec.device_memory_gib is not None:
        return spec.device_memory_gib
    return gpu_memory_gib(spec.gpu) if device == "cuda" else None


def margin_gib(spec: EstimateSpec, memory_gib: float) -> float:
    if spec.margin_gib is not None:
        return spec.margin_gib
    fraction = DEFAULT_MARGIN_FRACTION if spec.margin_fraction is None else spec.margin_fraction
    return fraction * memory_gib


def assess(est: Estimate, spec: EstimateSpec, calibration: tuple[float, int] | None,
           rehearsal: dict | None, world_size: int) -> tuple[Assessment, str | None]:
    """The trial's assessment, and why to skip the trial, if it must be.

    `calibration` is (median measured / estimated ratio, rows it comes from) for the trial's model x strategy x
    device, or None. It scales the part of the estimate that measurements cover. `rehearsal` is the trial's
    stored rehearsal (raybench/rehearse/), or None: when it traced the step, its peak (what the allocator
    would reserve, plus the part of the estimate no tensor holds) decides the fit instead; and wherever it traced
    the step (a ZeRO trial's FSDP2 twin too), its step time replaces the guess. `world_size` (the trial's ranks)
    widens the intervals of a trial unlike the rows the bands were derived on (planning/uncertainty.py).
    """
    factor, rows = calibration if calibration else (None, 0)
    calibrated = est.peak_gib if factor is None else est.peak_gib - est.measured_part_gib * (1 - factor)
    traced = rehearsal is not None and rehearsal.get("method") == "traced" and rehearsal.get("peak_gib") is not None
    # A step time from a trace: a traced rehearsal's, or a ZeRO trial's FSDP2 twin's (its memory stays analytic).
    timed = rehearsal is not None and rehearsal.get("compute_s") is not None
    rehearsed_peak = (rehearsal.get("reserved_gib") or rehearsal["peak_gib"]) + est.other_gib if traced else None
    peak = rehearsed_peak if traced else calibrated
    memory = device_memory_gib(spec, est.device)
    margin = None if memory is None else margin_gib(spec, memory)
    fits = None if memory is None else peak + margin <= memory
    assessment = Assessment(
        analytic=est, calibration=factor, calibration_rows=rows, peak_calibrated_gib=calibrated, memory_gib=memory,
        margin_gib=margin, fits=fits, peak_basis="rehearsed" if traced else "analytic",
        rehearsed_peak_gib=rehearsed_peak, rehearsed_step_time_s=rehearsal.get("step_time_s") if timed else None,
        rehearsed_compute_s=rehearsal.get("compute_s") if timed else None, world_size=world_size)
    if fits is not False or not spec.prune:
        return assessment, None
    unit = "GPU" if est.device == "cuda" else "worker"
    basis = f" (x{factor:.2f} calibrated from {rows} measured row(s))" if factor is not None else ""
    if traced:
        calibrated, basis = rehearsed_peak, " (rehearsed: traced at full scale)"
    of = f" of one {spec.gpu}" if spec.device_memory_gib is None and spec.gpu else ""
    return assessment, (f"estimated peak {calibrated:.1f} GiB per {unit}{basis} + {margin:.1f} GiB margin exceeds "
                        f"the {memory:.1f} GiB{of}; lower micro_batch or seq_len, raise ac_ratio, shard more (fsdp2, "
                        "ZeRO-3), or set estimate.prune: false to run it anyway")


def row_fields(assessment: AssessmentData | None, row: dict) -> dict:
    """Estimate columns of a result row, from the assessment its payload carried; for an ok row also the error:
    measured peak / estimate - 1.

    The measured peak is peak_reserved_gib on GPUs and peak_rss_gib on CPU (what `raybench report` shows); it
    is compared with the part of the raw estimate it covers (Estimate.measured_part_gib).
    """
    if assessment is None:
        return {}
    fields = {"est_peak_gib": assessment.analytic_peak_gib,
              "est_peak_calibrated_gib": assessment.peak_calibrated_gib,
              "est_step_time_s": assessment.analytic_step_time_s}
    measured = row.get("peak_reserved_gib") if row.get("device_type") == "cuda" else row.get("peak_rss_gib")
    if row.get("status") == "ok" and measured is not None and assessment.measured_part_gib > 0:
        error = measured / assessment.measured_part_gib - 1
        fields["est_peak_error"] = error if math.isfinite(error) else None
    return fields
